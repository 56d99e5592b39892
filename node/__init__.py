"""A node: joins a master, holds its slices, computes its partial of every step."""

import edgetp.models  # noqa: F401  (first: its OpenMP setting must precede torch)
