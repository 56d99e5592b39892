"""A cluster on this machine: the master plus worker processes joined over loopback.

The same code path as a LAN cluster (real processes, real ZeroMQ sockets), so what runs here is
what runs across devices. The processes share this machine's cores: each gets an equal share of
threads so that together they do not oversubscribe it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def thread_share(nodes: int) -> int:
    return max(1, (os.cpu_count() or 1) // nodes)


class LocalWorkers:
    """`count` worker processes joining the master at 127.0.0.1:`port`; stopped on exit."""

    def __init__(self, count: int, port: int, threads: int, state_dir: Path, verbose: bool) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        log_dir = state_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        for k in range(count):
            cmd = [
                sys.executable, "-m", "tui.cli", *(["-v"] if verbose else []), "join",
                f"127.0.0.1:{port}", "--threads", str(threads), "--name", f"local-{k + 1}",
                # Same machine, same disk: workers read the master's shard store, nothing ships.
                "--state-dir", str(state_dir),
            ]  # fmt: skip
            with open(log_dir / f"local-{k + 1}.log", "ab") as log_file:
                self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file))

    def stop(self, timeout: float = 5.0) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if exc[0] is not None and p.poll() is None:
                p.terminate()
        self.stop()
