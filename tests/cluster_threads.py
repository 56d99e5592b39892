"""The test process as the master of a cluster on this machine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from edgetp.master.cluster.local import thread_share
from edgetp.models.kernels import set_threads


@contextlib.contextmanager
def master_threads(nodes: int) -> Iterator[None]:
    """This process's share of the cores as the master of `nodes` local processes, as
    `--local-nodes` gives it (more threads than cores slow every node down), then all again.
    Usable as a decorator."""
    set_threads(thread_share(nodes))
    try:
        yield
    finally:
        set_threads()
