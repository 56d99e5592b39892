"""The terminal: the edgetp command, its chat app and the join command."""

import models  # noqa: F401  (first: its OpenMP setting must precede torch)
