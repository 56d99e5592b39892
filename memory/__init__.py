"""Memory: shards on disk, the budget, the sliding window and the expert pool."""

import edgetp.models  # noqa: F401  (first: its OpenMP setting must precede torch)
