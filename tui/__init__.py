"""The terminal: the edgetp command, its chat app and the join command."""

import edgetp.models  # noqa: F401  (first: its OpenMP setting must precede torch)
