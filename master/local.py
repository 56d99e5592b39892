"""A cluster on this machine: the master plus worker processes joined over loopback.

The same code path as a LAN cluster (real processes, real ZeroMQ sockets), so what runs here is
what runs across devices. The processes share this machine's cores: each gets an equal share of
threads so that together they do not oversubscribe it, or, given emulated devices
(master/emulate/), each runs as its device, with that device's threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from master.cluster import Hub
from master.engine import Engine
from master.plan import plan_slices
from master.session import Session
from master.transport import ClusterError
from memory.budget import ALL_RESIDENT, MemoryOptions
from memory.files import default_state_dir
from models.kernels import device_cores, set_threads
from models.source import ModelSource
from node.device import plan_shapes, prepare
from node.security import TOKEN_ENV, JoinToken

if TYPE_CHECKING:
    from master.emulate.devices import EmulatedDevices

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 120.0  # s for a local worker to start and say HELLO


def thread_share(nodes: int) -> int:
    return max(1, device_cores() // nodes)


class LocalWorkers:
    """`count` worker processes joining the master at 127.0.0.1:`port`, or each as its emulated
    device where `devices` are given; stopped on exit."""

    def __init__(
        self,
        count: int,
        port: int,
        threads: int,
        state_dir: Path,
        verbose: bool,
        token: JoinToken,
        first: int = 1,
        memory: MemoryOptions = ALL_RESIDENT,
        devices: EmulatedDevices | None = None,
    ) -> None:
        # The token goes by environment, not argv, where any local user could read it.
        env = os.environ | {TOKEN_ENV: str(token)}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.devices = devices
        self.first = first
        log_dir = state_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        for k in range(first - 1, first - 1 + count):
            node = k + 1  # the master is node 0
            host = devices.worker_host(node) if devices else "127.0.0.1"
            own_threads = (devices.threads(node) if devices else None) or threads
            cmd = [
                sys.executable, "-m", "tui.cli", *(["-v"] if verbose else []), "join",
                f"{host}:{port}", "--threads", str(own_threads), "--name", f"local-{node}",
                # Same machine, same disk: workers read the master's shard store, nothing ships.
                "--state-dir", str(state_dir), *memory.node_args(),
            ]  # fmt: skip
            if devices:
                cmd = devices.wrap(node, cmd)
            self.logs.append(log_dir / f"local-{node}.log")
            with open(self.logs[-1], "ab") as log_file:
                self.procs.append(
                    subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file, env=env)
                )

    def check(self) -> None:
        """Raises ClusterError naming a worker that has exited, why, and where its log is."""
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                continue
            node = self.first + i
            why = f"exited with code {p.returncode}"
            if p.returncode < 0:
                why = f"was killed by signal {-p.returncode}"
            if self.devices and self.devices.oom_kills(node):
                spec = self.devices.specs[node].describe()
                why = f"was killed by the kernel: over its device's memory limit ({spec})"
            last = _last_line(self.logs[i])
            raise ClusterError(
                f"local worker local-{node} {why}"
                + (f": {last}" if last else "")
                + f" (log: {self.logs[i]})"
            )

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


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


@contextlib.contextmanager
def local_session(
    source: ModelSource,
    nodes: int,
    capacities: Sequence[float] | None = None,
    threads: int | None = None,
    state_dir: Path | None = None,
    context: int | None = None,
    slots: int = 1,
    verbose: bool = False,
    memory: MemoryOptions = ALL_RESIDENT,
    devices: EmulatedDevices | None = None,
) -> Iterator[Session]:
    """A started session over `nodes` processes on this machine (1: this process alone).

    Every node gets the same memory options (budget, window, page-cache dropping). After a
    node fails, the session re-plans on the nodes left, with equal shares. With `devices`
    (entered, one spec per node), each node runs as its device: this process too.
    """
    if nodes < 1:
        raise ValueError(f"--local-nodes must be at least 1, got {nodes}")
    if capacities is not None and len(capacities) != nodes:
        raise ValueError(f"{len(capacities)} capacities given for {nodes} nodes")
    state_dir = state_dir or default_state_dir()
    if devices:
        if len(devices.specs) != nodes:
            raise ValueError(f"{len(devices.specs)} devices given for {nodes} nodes")
        devices.enter_master()  # before the kernel check below, which runs as this device
        threads = threads or devices.threads(0)
    if nodes == 1:
        set_threads(threads)
        with Session(source, None, state_dir, context, slots, memory) as session:
            session.start()
            yield session
        return
    threads = threads or thread_share(nodes)
    set_threads(threads)  # workers of a device with a CPU quota take that device's threads
    # One device: every node's kernels are checked in one child now (each node would check its
    # own, one after another, each importing torch again); the workers then read the table.
    plan = plan_slices(source.config, capacities or [1.0] * nodes)
    prepare(plan_shapes(source, plan, memory.dtype), install=False)
    hub = Hub(devices.master_host if devices else "127.0.0.1", 0, model_names=(source.name,))
    if devices:
        devices.start_links([hub.port, hub.heartbeat.port])
    # Processes sharing this machine's cores get equal shares (their measurements would only
    # see each other starting); emulated devices are planned by what each measured.
    session = Session(
        source, hub, state_dir, context, slots, memory, capacities, equal_shares=devices is None
    )
    with (
        session,
        LocalWorkers(
            nodes - 1,
            hub.port,
            threads,
            state_dir,
            verbose,
            hub.token,
            memory=memory,
            devices=devices,
        ) as workers,
    ):
        session.start(workers=nodes - 1, timeout=JOIN_TIMEOUT, check=workers.check)
        yield session
        session.close()  # says BYE: the workers then exit on their own
        workers.stop()


@contextlib.contextmanager
def local_engine(source: ModelSource, nodes: int, **options: Any) -> Iterator[Engine]:
    """The engine of a `local_session` with these `options` (for one-shot runs, benchmarks)."""
    with local_session(source, nodes, **options) as session:
        assert session.engine is not None
        yield session.engine
