"""A cluster across the LAN: the master's keys and join token, its mDNS announcement, and a
`Session` that devices joining with `edgetp join` become part of at any time.

`edgetp master`, `edgetp serve` and `edgetp chat` all run their cluster through here.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from edgetp.master.cluster.hub import Hub
from edgetp.master.cluster.session import Session
from edgetp.memory.budget import ALL_RESIDENT, MemoryOptions
from edgetp.models.source import ModelSource
from edgetp.node.discovery import Announcer, MasterAd, announce_addresses
from edgetp.node.protocol import PROTOCOL_VERSION
from edgetp.node.security import fingerprint, master_keys, master_token


@dataclass(frozen=True)
class LanOptions:
    """Where the master listens for devices and how it makes itself known."""

    bind: str = "0.0.0.0"
    port: int = 0  # 0: any free port
    new_token: bool = False  # rotate the join token: old tokens stop working
    announce: bool = True  # on mDNS, so that `edgetp join` finds the master without an address
    cluster: str | None = None  # the name announced (default: this host's)
    interface: str | None = None  # the IPv4 address to announce on (default: every one)
    # Plan in every device that joins, also one whose link the probes say would slow every
    # token (`workers_to_plan`): its owner may know the link better than probes on a busy host.
    every_device: bool = False


@contextlib.contextmanager
def lan_session(
    source: ModelSource,
    state_dir: Path,
    lan: LanOptions,
    context: int | None = None,
    slots: int = 1,
    memory: MemoryOptions = ALL_RESIDENT,
    capacities: Sequence[float] | None = None,
    who: str = "edgetp master",
    workers: int = 0,
    join_timeout: float = 600.0,
    progress: Callable[[str, int, int], None] | None = None,
) -> Iterator[Session]:
    """A started session whose hub admits devices holding the join token, once `workers` of
    them have joined (0: the master starts alone). The token, and the command a device runs
    to join, are printed on stderr first."""
    master_dir = state_dir / "master"
    keys = master_keys(master_dir)
    token = master_token(master_dir, keys, rotate=lan.new_token)
    hub = Hub(lan.bind, lan.port, model_names=(source.name,), keys=keys, token=token)
    announcer = None
    session = Session(
        source,
        hub,
        master_dir,
        context,
        slots,
        memory,
        capacities,
        progress=progress,
        standby=not lan.every_device,
    )
    try:
        if lan.announce:
            addresses = announce_addresses(lan.bind, lan.interface)
            ad = MasterAd(
                lan.cluster or socket.gethostname(),
                source.name,
                PROTOCOL_VERSION,
                fingerprint(keys.public),
                addresses[0],
                hub.port,
            )
            announcer = Announcer(ad, addresses, lan.interface)
        print(
            f"{who}: devices join this cluster on port {hub.port} (key {fingerprint(keys.public)})"
            f"\non each device run:  edgetp join THIS_HOST:{hub.port} --token {token}",
            file=sys.stderr,
            flush=True,
        )
        if workers:
            print(f"{who}: waiting for {workers} device(s) to join", file=sys.stderr, flush=True)
        session.start(workers, join_timeout)
        yield session
    finally:
        if announcer:
            announcer.close()
        session.close()
