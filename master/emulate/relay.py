"""The link relay (relay.c): the latency of an emulated device's link, added outside the
project's transport.

This kernel has no netem, so a worker with an rtt reaches the master through a relay on the
bridge that holds every byte rtt/2 each way. The round-trip benchmarks start one on loopback too.
"""

from __future__ import annotations

import contextlib
import select
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from edgetp.master.emulate.host import DeviceError, in_cgroups
from edgetp.models.cbuild import built

RELAY_SOURCE = Path(__file__).with_name("relay.c")
RELAY_READY_TIMEOUT = 10.0  # s


def start_relay(
    half_us: int,
    listen: str,
    target: str,
    ports: Sequence[int],
    cgroups: Iterable[Path] = (),
    what: str = "the link relay",
) -> subprocess.Popen[bytes]:
    """relay.c, holding every byte `half_us` each way from `listen`:port to `target`:port for
    each port, started (in `cgroups`, if given) and listening; DeviceError naming `what` if it
    does not start. `stop_relay` ends it."""
    cmd = [str(built(RELAY_SOURCE, ("-O2",))), str(half_us), listen, target, *map(str, ports)]
    folders = list(cgroups)
    proc = subprocess.Popen(
        in_cgroups(folders, cmd) if folders else cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], RELAY_READY_TIMEOUT)
    if not ready or proc.stdout.readline().strip() != b"ready":
        stop_relay(proc)
        raise DeviceError(f"{what} did not start")
    return proc


def stop_relay(proc: subprocess.Popen[bytes]) -> None:
    """End a relay `start_relay` started, killing it if it does not exit by itself."""
    with contextlib.suppress(OSError):
        assert proc.stdin is not None
        proc.stdin.close()  # a relay exits when its input closes
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
