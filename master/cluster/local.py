"""A cluster on this machine: the master plus worker processes joined over loopback.

The same code path as a LAN cluster (real processes, real ZeroMQ sockets), so what runs here is
what runs across devices. The processes share this machine's cores: each gets an equal share of
threads so that together they do not oversubscribe it, or, given emulated devices
(master/emulate/), each runs as its device, with that device's threads.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import runpy
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.hub import Hub
from edgetp.master.cluster.session import Session
from edgetp.master.cluster.transport import ClusterError
from edgetp.memory.budget import ALL_RESIDENT, MemoryOptions, device_memory_budget, oom_kills
from edgetp.memory.files import default_state_dir
from edgetp.models.kernels import device_cores, set_threads
from edgetp.models.source import ModelSource
from edgetp.node import children
from edgetp.node.children import Child
from edgetp.node.probes import measure_speed
from edgetp.node.security import TOKEN_ENV, JoinToken

if TYPE_CHECKING:
    from edgetp.master.emulate.devices import EmulatedDevices

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 120.0  # s for a local worker to start and say HELLO
# A local worker that exits is started again after a wait that doubles with each exit, from
# the first (longer than the 2 s that mark a silent node dead, so the master has let go of the
# old process before the new one says HELLO under its name) up to the longest; one that ran
# for STEADY_S starts over at the first.
RESTART_WAIT_S = (3.0, 60.0)
STEADY_S = 60.0


def thread_share(nodes: int) -> int:
    return max(1, device_cores() // nodes)


@functools.cache
def machine_speed(threads: int) -> float:
    """This machine's speed probe, taken once per master process for all the local workers it
    starts (with this process's BLAS threads, which `local_session` sets to the workers' share
    first): they share its cores, so their shares are equal (the figure is only shown), and a
    probe each, taken while the others start, would measure them starting (0.3-0.5 s of CPU
    each, most of it faulting in the probe's 256 MB)."""
    return measure_speed(threads)


def local_worker_speed(threads: int) -> float | None:
    """`machine_speed` for the local workers to take, or None under a memory limit (a
    container): there each worker probes itself, so that the probe's memory is a worker's, which
    the out-of-memory killer takes first, and the master lives to say what happened."""
    return None if device_memory_budget() is not None else machine_speed(threads)


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
        self.env = os.environ | {TOKEN_ENV: str(token)}
        self.cmds: list[list[str]] = []
        self.procs: list[subprocess.Popen[bytes] | Child] = []
        self.logs: list[Path] = []
        self.devices = devices
        self.first = first
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._oom_kills = oom_kills()  # in this process's memory cgroup, before the workers
        log_dir = state_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        if devices is None:
            children.start_server()  # each worker forked from it, see node/children.py
        speed = None if devices else local_worker_speed(threads)
        for k in range(first - 1, first - 1 + count):
            node = k + 1  # the master is node 0
            host = devices.worker_host(node) if devices else "127.0.0.1"
            own_threads = (devices.threads(node) if devices else None) or threads
            cmd = [
                sys.executable, "-m", "edgetp.tui.cli", *(["-v"] if verbose else []), "join",
                f"{host}:{port}", "--threads", str(own_threads), "--name", f"local-{node}",
                # Same machine, same disk: workers read the master's shard store, nothing ships.
                "--state-dir", str(state_dir), *memory.node_args(),
                *([] if speed is None else ["--speed", str(speed)]),
            ]  # fmt: skip
            self.cmds.append(devices.wrap(node, cmd) if devices else cmd)
            self.logs.append(log_dir / f"local-{node}.log")
            self.procs.append(self._spawn(len(self.procs)))

    def _spawn(self, i: int) -> subprocess.Popen[bytes] | Child:
        if self.devices is None:  # `python -m tui.cli join ...`, forked: see node/children.py
            args = (self.cmds[i][3:], str(self.logs[i]))
            name = f"edgetp-local-{self.first + i}"
            oom = children.OOM_WORKER  # taken before the master, which says what happened
            return children.start(_run_worker, args, name, self.env, oom_score_adj=oom)
        with open(self.logs[i], "ab") as log_file:  # an emulated device's: started in its cgroups
            return subprocess.Popen(
                self.cmds[i], stdout=subprocess.DEVNULL, stderr=log_file, env=self.env
            )

    def supervise(self, hub: Hub) -> None:
        """From now on, start a worker that exits again, after RESTART_WAIT_S, counting it in
        `hub.restarts`; it joins as a new node and is planned in at the next re-plan."""
        self._supervisor = threading.Thread(
            target=self._restart_exited, args=(hub,), name="edgetp-local-workers", daemon=True
        )
        self._supervisor.start()

    def _restart_exited(self, hub: Hub) -> None:
        waits = [RESTART_WAIT_S[0]] * len(self.procs)
        started = [time.monotonic()] * len(self.procs)
        due: dict[int, float] = {}  # worker -> when it starts again
        while not self._stopping.wait(0.2):
            now = time.monotonic()
            for i, p in enumerate(self.procs):
                if p.poll() is None:
                    continue
                name = f"local-{self.first + i}"
                if i not in due:
                    if now - started[i] >= STEADY_S:
                        waits[i] = RESTART_WAIT_S[0]
                    due[i] = now + waits[i]
                    log.warning("%s; starting it again in %.0f s", self.exit_reason(i), waits[i])
                    waits[i] = min(2 * waits[i], RESTART_WAIT_S[1])
                elif now >= due[i]:
                    del due[i]
                    self.procs[i] = self._spawn(i)
                    started[i] = now
                    hub.restarts[name] = hub.restarts.get(name, 0) + 1
                    log.warning(
                        "local worker %s started again (restart %d)", name, hub.restarts[name]
                    )

    def stop_supervising(self) -> None:
        """No more restarts: the cluster is shutting down and its workers exit on their own."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()

    def exit_reason(self, i: int) -> str:
        """Why worker `i` exited, and where its log is."""
        p, node = self.procs[i], self.first + i
        why = f"exited with code {p.returncode}"
        if p.returncode is not None and p.returncode < 0:
            why = f"was killed by signal {-p.returncode}"
        last = _last_line(self.logs[i])
        if self.devices and self.devices.oom_kills(node):
            spec = self.devices.specs[node].describe()
            why = f"was killed by the kernel: over its device's memory limit ({spec})"
        elif not self.devices and (oom_kills() or 0) > (self._oom_kills or 0):
            # The code says little (a worker forked by a server that was killed too reads 255),
            # and its log's last line is whatever it printed before: not the reason.
            why = (
                f"{why}, and the kernel's out-of-memory killer has ended processes here: this "
                "machine's memory (or its container's limit) cannot hold the master and "
                f"{len(self.procs)} worker(s): run fewer --local-nodes, or give more memory"
            )
            last = ""
        return (
            f"local worker local-{node} {why}"
            + (f": {last}" if last else "")
            + f" (log: {self.logs[i]})"
        )

    def check(self) -> None:
        """Raises ClusterError naming a worker that has exited, why, and where its log is."""
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                raise ClusterError(self.exit_reason(i))

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_supervising()
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_supervising()
        for p in self.procs:
            if exc[0] is not None and p.poll() is None:
                p.terminate()
        self.stop()


def _run_worker(argv: list[str], log: str) -> None:
    """A local worker in a forked child: what `python -m tui.cli *argv` runs, logging to `log`."""
    children.redirect_output(None, log)
    sys.argv = ["edgetp.tui.cli", *argv]
    runpy.run_module("edgetp.tui.cli", run_name="__main__", alter_sys=True)


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
    standby: bool = True,
) -> Iterator[Session]:
    """A started session over `nodes` processes on this machine (1: this process alone).

    Every node gets the same memory options (budget, window, page-cache dropping). After a
    node fails, the session re-plans on the nodes left, with equal shares. With `devices`
    (entered, one spec per node), each node runs as its device: this process too, and one
    whose link would slow every token is left on standby (unless not `standby`).
    """
    if nodes < 1:
        raise ValueError(f"--local-nodes must be at least 1, got {nodes}")
    if capacities is not None and len(capacities) != nodes:
        raise ValueError(f"{len(capacities)} capacities given for {nodes} nodes")
    state_dir = state_dir or default_state_dir()
    if devices:
        if len(devices.specs) != nodes:
            raise ValueError(f"{len(devices.specs)} devices given for {nodes} nodes")
        devices.enter_master()  # before its kernel checks, which run as this device
        threads = threads or devices.threads(0)
    if nodes == 1:
        set_threads(threads)
        with Session(source, None, state_dir, context, slots, memory) as session:
            session.start()
            yield session
        return
    threads = threads or thread_share(nodes)
    set_threads(threads)  # workers of a device with a CPU quota take that device's threads
    hub = Hub(devices.master_host if devices else "127.0.0.1", 0, model_names=(source.name,))
    if devices:
        devices.start_links([hub.port, hub.heartbeat.port])
    # Processes sharing this machine's cores get equal shares (their measurements would only
    # see each other starting); emulated devices are planned by what each measured.
    session = Session(
        source,
        hub,
        state_dir,
        context,
        slots,
        memory,
        capacities,
        equal_shares=devices is None,
        standby=standby,
        one_device=devices is None,  # an emulated device checks its own kernels, as itself
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
        workers.supervise(hub)
        yield session
        workers.stop_supervising()
        session.close()  # says BYE: the workers then exit on their own
        workers.stop()


@contextlib.contextmanager
def local_engine(source: ModelSource, nodes: int, **options: Any) -> Iterator[Engine]:
    """The engine of a `local_session` with these `options` (for one-shot runs, benchmarks)."""
    with local_session(source, nodes, **options) as session:
        assert session.engine is not None
        yield session.engine
