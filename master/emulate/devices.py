"""Local nodes run as devices of their own, on one Linux machine, as root.

- cpu: a CFS quota (cgroup v1 `cpu`) over a 10 ms period (CPU_PERIOD_US says why): cpu=0.5 runs
  5 ms of every 10.
- mem: a limit on the cgroup v1 `memory` controller, which charges the page cache too: a node
  whose slice does not fit reads it from disk, and one that overruns is killed by the kernel
  (counted by `figures`).
- disk: a read rate (cgroup v1 `blkio` throttle) on the block device holding the shards.
- link, rtt: each worker in a network namespace, on a veth pair to a bridge where the master
  listens; tc tbf limits the rate each way (the master's own rate on the bridge, its uplink).
  This kernel has no netem, so latency comes from a relay (relay.c) on the bridge that holds
  every byte rtt/2 each way between a worker and the master: outside the transport's code.

Every name carries the creating process's id (cgroups and namespaces `edgetp-<pid>-<node>`,
links `etp<pid>...`). A run removes what it made on exit, Ctrl-C included; a master killed
outright cannot, so each run first removes what runs whose process is gone left behind.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from edgetp.master.emulate.host import (
    CONTROLLERS,
    DeviceError,
    block_device,
    check_host,
    cpu_list,
    in_cgroups,
    keyed,
    own_cgroup,
    remove_cgroup,
    remove_leftovers,
    run_tool,
    threads_cpu_seconds,
)
from edgetp.master.emulate.relay import start_relay, stop_relay
from edgetp.master.emulate.spec import DeviceSpec, device_specs

log = logging.getLogger(__name__)

MIN_QUOTA_US = 1000  # the kernel refuses a shorter CFS quota
# The CFS period: short enough that a throttled node waits at most 5 ms (cpu=0.5) in the middle
# of a sum, where the kernel's default of 100 ms would stall it for 50. Not shorter: on these
# virtual machines a node that stops and starts every period loses its caches, and SmolLM2 on one
# node at cpu=0.5 took 2.05x its unconstrained time at 10 ms, 2.4x at 4 ms and 3.3x at 2 ms.
CPU_PERIOD_US = 10_000


def cpu_period_us(cores: float) -> int:
    """CPU_PERIOD_US, or the shortest period whose quota for `cores` the kernel accepts."""
    return max(CPU_PERIOD_US, int(-(-MIN_QUOTA_US // cores)))


class EmulatedDevices:
    """Node k (0: the master) of a local cluster runs as `specs[k]`; a context manager that
    makes the cgroups and the network on entry and removes them on exit."""

    def __init__(self, specs: Sequence[DeviceSpec], shard_dir: Path) -> None:
        self.specs = list(specs)
        self.shard_dir = shard_dir
        self.tag = f"edgetp-{os.getpid()}"
        self.cgroups: list[dict[str, Path]] = []
        self.parents: dict[str, Path] = {}
        self.networked = any(s.networked for s in self.specs)
        self.subnet: ipaddress.IPv4Network | None = None
        self.bridge = f"etp{os.getpid()}b"
        self.namespaces: list[str] = []
        self.veths: list[str] = []  # each worker's host end of its veth pair
        self.relays: list[subprocess.Popen[bytes]] = []
        self.master_entered = False

    # -- the parts each node sees ------------------------------------------------------------

    @property
    def master_host(self) -> str:
        """Where the master's hub binds."""
        return self._address(254) if self.networked else "127.0.0.1"

    def worker_host(self, k: int) -> str:
        """The address worker k joins: the master's, or its relay's where it has an rtt."""
        if not self.networked:
            return "127.0.0.1"
        return self._address(100 + k) if self.specs[k].rtt else self._address(254)

    def threads(self, k: int) -> int | None:
        return self.specs[k].threads

    def wrap(self, k: int, cmd: Sequence[str]) -> list[str]:
        """`cmd` run as worker k's device: in its cgroups, then in its namespace."""
        inner = ["ip", "netns", "exec", self.namespaces[k], *cmd] if self.networked else list(cmd)
        return in_cgroups(self.cgroups[k].values(), inner)

    def enter_master(self) -> None:
        """This process (the master) into node 0's cgroups, with what it already holds."""
        for folder in self.cgroups[0].values():
            (folder / "cgroup.procs").write_text(str(os.getpid()))
        self.master_entered = True

    def start_links(self, ports: Sequence[int]) -> None:
        """A relay per worker with an rtt, holding each byte rtt/2 each way on these ports
        (the hub's and its heartbeat's), once the master listens on them."""
        for k, spec in enumerate(self.specs[1:], start=1):
            if spec.rtt:
                # The relay is the wire, not a device: out of the master's cgroups (whose quota
                # and core it would share, so that a busy master delayed its own link), into
                # this run's own, where it may also take a real-time priority.
                self.relays.append(
                    start_relay(
                        round(spec.rtt / 2 * 1e6),
                        self.worker_host(k),
                        self.master_host,
                        ports,
                        self.parents.values(),
                        f"the link relay for node {k}",
                    )
                )

    def oom_kills(self, k: int) -> int:
        """How many processes the kernel killed in node k for going over its memory limit."""
        if k >= len(self.cgroups):
            return 0
        return keyed(self.cgroups[k]["memory"] / "memory.oom_control").get("oom_kill", 0)

    def cpu_seconds(self) -> list[float]:
        """Per node, the CPU time every thread in its cgroup has run so far: what its quota
        bounds. Threads that have exited are not in it, so take differences over a span in
        which the nodes' threads live (a timed run)."""
        return [threads_cpu_seconds(folders["cpu"] / "tasks") for folders in self.cgroups]

    def figures(self) -> list[dict[str, Any]]:
        """Per node: its spec, the cores it runs on, the cgroup's peak memory (page cache
        included), how often the kernel killed in it for memory, and how much of the time its CPU
        quota throttled it."""
        rows = []
        for k, folders in enumerate(self.cgroups):
            memory, cpu = folders["memory"], folders["cpu"]
            oom = keyed(memory / "memory.oom_control")
            stat = keyed(cpu / "cpu.stat")
            rows.append({
                "node": k,
                "device": self.specs[k].as_json(),
                "cores": cpu_list((folders["cpuset"] / "cpuset.cpus").read_text()),
                "peak_memory_bytes": self._peak_memory(k),
                "oom_kills": oom.get("oom_kill", 0),
                "throttled_periods": stat.get("nr_throttled", 0),
                "periods": stat.get("nr_periods", 0),
            })  # fmt: skip
        return rows

    def _peak_memory(self, k: int) -> int:
        """The cgroup's peak usage; for the master, which entered its cgroup after it started
        and so left its earlier charge behind, at least its own peak RSS."""
        peak = int((self.cgroups[k]["memory"] / "memory.max_usage_in_bytes").read_text())
        if k == 0 and self.master_entered:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        return peak

    # -- making and removing ------------------------------------------------------------------

    def __enter__(self) -> EmulatedDevices:
        check_host(self.specs)
        for name in remove_leftovers():
            log.info("removed %s, left over by an earlier run", name)
        self.parents = {c: own_cgroup(c) for c in CONTROLLERS}
        try:
            for k, spec in enumerate(self.specs):
                self.cgroups.append(self._make_cgroups(k, spec))
            if self.networked:
                self._make_network()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for proc in self.relays:
            stop_relay(proc)
        self.relays = []
        if self.master_entered:
            for parent in self.parents.values():
                (parent / "cgroup.procs").write_text(str(os.getpid()))
            self.master_entered = False
        for folders in self.cgroups:
            for folder in folders.values():
                remove_cgroup(folder)
        self.cgroups = []
        # A pair is deleted with either end, at once; with its namespace only once the last
        # process in it is gone, which a node ending late outlived (a host end was left behind).
        for veth in self.veths:
            run_tool("ip", "link", "del", veth, check=False)
        self.veths = []
        for name in self.namespaces:
            if name:
                run_tool("ip", "netns", "del", name, check=False)
        self.namespaces = []
        if self.subnet is not None:
            run_tool("ip", "link", "del", self.bridge, check=False)
            self.subnet = None

    def _make_cgroups(self, k: int, spec: DeviceSpec) -> dict[str, Path]:
        folders = {c: self.parents[c] / f"{self.tag}-{k}" for c in CONTROLLERS}
        for folder in folders.values():
            folder.mkdir()
        cpuset = folders["cpuset"]
        (cpuset / "cpuset.mems").write_text((self.parents["cpuset"] / "cpuset.mems").read_text())
        (cpuset / "cpuset.cpus").write_text(",".join(map(str, self._cores(k, spec))))
        if spec.cpu is not None:
            period = cpu_period_us(spec.cpu)
            (folders["cpu"] / "cpu.cfs_period_us").write_text(str(period))
            (folders["cpu"] / "cpu.cfs_quota_us").write_text(str(round(spec.cpu * period)))
        if spec.mem is not None:
            memory = folders["memory"]
            # What the master holds when it enters comes with it (deprecated in newer kernels,
            # where a move leaves the charge behind: the figures then under-count the master).
            with contextlib.suppress(OSError):
                (memory / "memory.move_charge_at_immigrate").write_text("3")
            (memory / "memory.limit_in_bytes").write_text(str(spec.mem))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to limit
                (memory / "memory.memsw.limit_in_bytes").write_text(str(spec.mem))
        if spec.disk is not None:
            device = block_device(self.shard_dir)
            (folders["blkio"] / "blkio.throttle.read_bps_device").write_text(
                f"{device} {spec.disk}"
            )
        return folders

    def _cores(self, k: int, spec: DeviceSpec) -> list[int]:
        """Node k's own cores: as many as its quota needs (all without one), taken in turn from
        this process's, so that each device's threads wake each other on a core of their own."""
        cores = cpu_list((self.parents["cpuset"] / "cpuset.cpus").read_text())
        if spec.cpu is None:
            return cores
        need = min(len(cores), max(1, math.ceil(spec.cpu - 1e-9)))
        start = sum(max(1, math.ceil((s.cpu or len(cores)) - 1e-9)) for s in self.specs[:k])
        return sorted({cores[(start + i) % len(cores)] for i in range(need)})

    def _address(self, host: int) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + host)

    def _make_network(self) -> None:
        self.subnet = _free_subnet()
        prefix = self.subnet.prefixlen
        run_tool("ip", "link", "add", self.bridge, "type", "bridge")
        run_tool("ip", "addr", "add", f"{self._address(254)}/{prefix}", "dev", self.bridge)
        run_tool("ip", "link", "set", self.bridge, "up")
        if self.specs[0].link:
            _shape(self.bridge, self.specs[0].link)
        self.namespaces = [""]  # the master stays in this namespace, on the bridge
        pid = os.getpid()
        for k, spec in enumerate(self.specs[1:], start=1):
            ns, host_end, node_end = f"{self.tag}-{k}", f"etp{pid}h{k}", f"etp{pid}p{k}"
            run_tool("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            run_tool("ip", "link", "add", host_end, "type", "veth", "peer", "name", node_end)
            self.veths.append(host_end)
            run_tool("ip", "link", "set", node_end, "netns", ns)
            run_tool("ip", "link", "set", host_end, "master", self.bridge, "up")
            inside = ("ip", "-n", ns)
            run_tool(*inside, "link", "set", node_end, "name", "eth0")
            run_tool(*inside, "addr", "add", f"{self._address(k)}/{prefix}", "dev", "eth0")
            run_tool(*inside, "link", "set", "eth0", "up")
            run_tool(*inside, "link", "set", "lo", "up")
            if spec.link:
                _shape(host_end, spec.link)  # master -> node
                _shape("eth0", spec.link, ns)  # node -> master
            if spec.rtt:
                run_tool("ip", "addr", "add", f"{self.worker_host(k)}/{prefix}", "dev", self.bridge)


def _shape(dev: str, bits_per_s: int, ns: str | None = None) -> None:
    """tbf at `bits_per_s` on `dev`'s egress, with a burst of 1 ms of the rate (at least a
    few packets) and a queue of 200 ms."""
    burst = max(bits_per_s // 8 // 1000, 16 * 1514)
    prefix = ("ip", "netns", "exec", ns) if ns else ()
    run_tool(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{bits_per_s}bit",
         "burst", str(burst), "latency", "200ms")  # fmt: skip


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 172.30.0.0/16 no interface here uses, picked by this process's id."""
    used = run_tool("ip", "-4", "-o", "addr", "show")
    start = os.getpid() % 256
    for i in range(256):
        net = ipaddress.IPv4Network(f"172.30.{(start + i) % 256}.0/24")
        if f" {str(net.network_address)[:-1]}" not in used:
            return net
    raise DeviceError("no free /24 in 172.30.0.0/16 for the emulated devices' network")


@contextlib.contextmanager
def emulated(
    specs: Sequence[DeviceSpec] | None, nodes: int, shard_dir: Path
) -> Iterator[EmulatedDevices | None]:
    """`nodes` emulated devices of `specs` (one for all, or one per node), made now and removed
    on exit, also on SIGTERM; None without specs."""
    if not specs:
        yield None
        return
    devices = EmulatedDevices(device_specs(specs, nodes), shard_dir)
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_term)  # unwinds through the cleanup below
    try:
        with devices:
            yield devices
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def _exit_on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
