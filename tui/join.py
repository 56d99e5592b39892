"""`edgetp join` (and its alias `node`): this device joins a master's cluster and computes its
slice of every step until it leaves.

The master is named (HOST[:PORT], its host looked up before the slow imports of torch and the
worker) or found on the LAN by its mDNS announcement; the join token comes from the command
line, EDGETP_TOKEN or the state folder, where a successful join keeps it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import TYPE_CHECKING

from edgetp.node.protocol import DEFAULT_PORT

if TYPE_CHECKING:
    from edgetp.node.security import JoinToken


def join(args: argparse.Namespace) -> None:
    """Join the master `args` names (or one found on the LAN) and serve it; join again
    whenever the master drops this node from its plan."""
    given = None if args.master is None else _master_address(args.master)  # before torch loads
    from edgetp.memory.budget import parse_size
    from edgetp.memory.files import default_state_dir
    from edgetp.memory.window import keep_imports_out_of_collections
    from edgetp.models.kernels import set_threads
    from edgetp.node.probes import measure_capacity
    from edgetp.node.security import TOKEN_ENV, JoinToken, load_node_token
    from edgetp.node.worker import Worker
    from edgetp.tui.progress import progress_bar

    keep_imports_out_of_collections()

    threads = set_threads(args.threads)
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    state_dir = args.state_dir or default_state_dir()
    text = args.token or os.environ.get(TOKEN_ENV)
    token = JoinToken.parse(text) if text else load_node_token(state_dir)
    address = given or _find_master(args.cluster, args.interface, token)
    capacity = measure_capacity(threads, budget, args.window, state_dir, args.speed)
    rejoin = True
    while rejoin:  # a master that dropped this node from its plan asks it to join again
        with progress_bar("fetching shards", in_bytes=True) as fetch_progress:
            worker = Worker(
                address,
                capacity,
                state_dir,
                args.name,
                args.model,
                fetch_progress,
                token=token,
                drop_cache=args.drop_cache,
            )
            rejoin = worker.run()
        if rejoin:
            print("edgetp join: dropped from the master's plan; joining again", file=sys.stderr)


def _master_address(text: str) -> str:
    """HOST:PORT from `edgetp join HOST[:PORT]`, the host looked up now: ZeroMQ retries a name
    that does not resolve until the join gives up, 30 s later, saying only that no master
    answered."""
    host, _, port = text.rpartition(":") if ":" in text else (text, ":", str(DEFAULT_PORT))
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"the master's port must be in 1..65535, got {port!r} in {text!r}")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)  # [IPv6]
    except socket.gaierror as exc:
        raise ValueError(
            f"cannot find the master's host {host!r} ({exc.strerror}): check the name, or give "
            "its IP address (the master prints the command to run on a device)"
        ) from None
    return f"{host}:{port}"


BROWSE_SECONDS = 3.0


def _find_master(cluster: str | None, interface: str | None, token: JoinToken | None) -> str:
    """HOST:PORT of the master found on the LAN, asking when there are several."""
    from edgetp.node.discovery import browse
    from edgetp.node.security import fingerprint

    print(f"edgetp: looking for masters on the LAN ({BROWSE_SECONDS:.0f} s)...", file=sys.stderr)
    ads = browse(BROWSE_SECONDS, interface)
    if token:  # a master whose key is not the token's cannot be the one meant
        ads = [a for a in ads if a.fingerprint == fingerprint(token.master_public)] or ads
    if cluster:
        ads = [a for a in ads if a.cluster == cluster]
    if not ads:
        what = f"no master named {cluster!r}" if cluster else "no master"
        raise ValueError(
            f"{what} answered on the LAN within {BROWSE_SECONDS:.0f} s (multicast may be "
            f"blocked here); give its address: edgetp join HOST:PORT --token TOKEN"
        )
    if len(ads) == 1:
        ad = ads[0]
    elif sys.stdin.isatty():
        for i, a in enumerate(ads, 1):
            print(f"  {i}. {a.cluster}  {a.model}  {a.address}", file=sys.stderr)
        choice = input(f"join which master [1-{len(ads)}]? ").strip()
        if not choice.isdigit() or not 1 <= int(choice) <= len(ads):
            raise ValueError(f"no master numbered {choice!r}")
        ad = ads[int(choice) - 1]
    else:
        names = ", ".join(f"{a.cluster} ({a.address})" for a in ads)
        raise ValueError(f"several masters answered: {names}; pick one with --cluster NAME")
    print(f"edgetp: joining {ad.cluster} at {ad.address} ({ad.model})", file=sys.stderr)
    return ad.address
