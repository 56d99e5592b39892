"""The master: plans the split, runs the generation loop with its nodes, serves the bridge."""

import edgetp.models  # noqa: F401  (first: its OpenMP setting must precede torch)
