"""The master's side of the cluster: membership, shard shipping, and the star allreduce hub.

One ROUTER socket; every worker connects a DEALER. Per layer block the hub sends the hidden
state to every worker (`send`), the master computes its own partial meanwhile, and `gather`
adds the workers' partials: two hops per sum, whatever the node count.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from memory.shards import Manifest, ShardStore
from node import protocol as P
from node.heartbeat import DEAD_AFTER, HeartbeatServer
from node.security import JoinToken, Keypair, secure_server
from node.worker import Capacity

log = logging.getLogger(__name__)

STEP_TIMEOUT = 300.0  # s: a hard cap on one block's gather, beyond heartbeat liveness
ALLREDUCE_KEPT = 20_000  # recent per-sum latencies kept for the figures
FIGURES_KEPT = 4096  # per-step figures kept per node for benchmarks
FIRST_BEAT = 10.0  # s a worker has, after WELCOME, to send its first heartbeat


class ClusterError(Exception):
    """A node or the cluster failed; the message names the node and what to do."""


@dataclass
class Member:
    identity: bytes
    name: str
    capacity: Capacity
    model: str | None
    address: str = ""
    ready: bool = False
    alive: bool = True
    beat_seen: bool = False
    window: int | None = None  # layers of its slice in memory, as planned
    slice: dict[str, list[int]] | None = None  # its share of every layer, as planned
    # Its latest step's figures (loader, memory), and every step's since the last clear.
    figures: dict[str, Any] = field(default_factory=dict)
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=FIGURES_KEPT))


class _TokenHolders:
    """ZAP: admit only the client key that the current join token derives."""

    def __init__(self, token: JoinToken) -> None:
        self.allowed = token.client_keys().public

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.allowed:
            return True
        log.warning("refused a node: its key does not come from the current join token")
        return False


class Hub:
    """The master's sockets. Links are CurveZMQ: `keys` is the master's keypair and `token` the
    join token nodes must hold; both are made up for this process when not given (a local
    cluster hands the token to its own workers)."""

    def __init__(
        self,
        bind: str = "127.0.0.1",
        port: int = 0,
        model_names: tuple[str, ...] = (),
        ship_rate: float | None = None,
        keys: Keypair | None = None,
        token: JoinToken | None = None,
    ) -> None:
        if keys is None:
            public, secret = zmq.curve_keypair()
            keys = Keypair(public, secret)
        self.keys = keys
        self.token = token or JoinToken(keys.public, os.urandom(16))
        self.context = zmq.Context()
        self.auth = ThreadAuthenticator(self.context, log=logging.getLogger("edgetp.auth"))
        self.auth.start()
        self.auth.configure_curve_callback("*", _TokenHolders(self.token))
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        secure_server(self.sock, keys)
        try:
            if port:
                self.sock.bind(f"tcp://{bind}:{port}")
                self.port = port
            else:
                self.port = self.sock.bind_to_random_port(f"tcp://{bind}")
        except zmq.ZMQError as exc:
            self.sock.close(linger=0)
            self.auth.stop()
            self.context.term()
            raise ClusterError(
                f"cannot listen for devices on {bind}:{port} ({exc.strerror}): pick another "
                "cluster port, or stop what is using it"
            ) from exc
        self._watch_handshakes()
        self.address = f"{bind}:{self.port}"  # where nodes join
        self.heartbeat = HeartbeatServer(self.context, bind, keys)
        self.model_names = model_names  # names a worker may ask for (None: any)
        self.ship_rate = ship_rate  # bytes/s cap on shard shipping, for shared links
        self.members: list[Member] = []
        self.pending: list[Member] = []  # joined while serving; planned in at the next re-plan
        self.store: ShardStore | None = None
        self.shipped_bytes = 0
        self._step = 0
        self.planned = False  # an engine runs on the members: a node joining waits for a re-plan
        self._sent_at = 0.0
        self._hello_from = ""  # the peer address of the HELLO being handled
        # Per sum: time from handing out the hidden state to holding every partial, less the
        # longest compute of any node (master included): the latency the allreduce adds.
        # (bounded: a server runs 60 sums a token for days)
        self.allreduce_seconds: deque[float] = deque(maxlen=ALLREDUCE_KEPT)

    def _watch_handshakes(self) -> None:
        """Log every connection that fails the Curve handshake (no token, wrong master key)."""
        monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )

        def watch() -> None:
            while True:
                try:
                    event = recv_monitor_message(monitor)
                except zmq.ZMQError:
                    return
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                log.warning(
                    "refused a connection on %s: the Curve handshake failed (%s); "
                    "a node needs the join token this master printed",
                    event["endpoint"].decode(errors="replace"),
                    zmq.Event(event["event"]).name,
                )
            monitor.close(0)

        threading.Thread(target=watch, name="handshake-log", daemon=True).start()

    # -- plumbing ---------------------------------------------------------------------------
    def _send(self, identity: bytes, header: dict[str, Any], tensors: tuple = ()) -> None:
        self._send_frames(identity, P.encode(header, tensors))

    def _send_frames(self, identity: bytes, frames: list[Any]) -> None:
        try:
            self.sock.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer is gone
            member = self._member(identity)
            if member is not None:
                member.alive = False  # a re-plan leaves it out
            raise ClusterError(f"node {identity.decode(errors='replace')} is unreachable") from exc

    def _recv(
        self, timeout_ms: int, spin: bool = False
    ) -> tuple[bytes, dict[str, Any], list] | None:
        if not P.wait_readable(self.sock, timeout_ms, spin):
            return None
        identity, *frames = self.sock.recv_multipart(copy=False)
        try:
            header, tensors = P.decode(frames)
            if header["op"] == P.HELLO:  # where the node connects from, for the cluster view
                self._hello_from = str(frames[0].get("Peer-Address"))
        except P.ProtocolError as exc:
            log.warning("dropped a malformed message from %r: %s", identity.bytes, exc)
            return None
        return identity.bytes, header, tensors

    def _member(self, identity: bytes) -> Member | None:
        return next((m for m in self.members if m.identity == identity), None)

    # -- joining and shipping ---------------------------------------------------------------
    def _handle_control(self, identity: bytes, header: dict[str, Any]) -> None:
        """Messages that may come at any time outside a step."""
        op = header["op"]
        if op == P.HELLO:
            self._hello(identity, header)
        elif op == P.FETCH:
            self._serve_chunk(identity, header)
        elif op == P.READY:
            member = self._member(identity)
            if member:
                member.ready = True
                log.info("node %s ready", member.name)
        elif op == P.LEAVE:
            member = self._member(identity)
            if member:
                member.alive = False
                log.info(
                    "node %s left; its share goes to the others at the next re-plan", member.name
                )
        elif op == P.ERROR:
            member = self._member(identity)
            name = member.name if member else identity.decode(errors="replace")
            raise ClusterError(f"node {name} failed: {header.get('message')}")

    def _hello(self, identity: bytes, header: dict[str, Any]) -> None:
        name = str(header.get("name", identity.decode(errors="replace")))
        reason = None
        if header.get("version") != P.PROTOCOL_VERSION:
            reason = (
                f"protocol version {header.get('version')} does not match the master's "
                f"{P.PROTOCOL_VERSION}: run the same edgetp version on every device"
            )
        elif header.get("model") and self.model_names and header["model"] not in self.model_names:
            reason = (
                f"this node asked for model {header['model']!r} but the master runs "
                f"{self.model_names[0]!r}"
            )
        if reason:
            log.warning("refused node %s: %s", name, reason)
            self._send(identity, {"op": P.REFUSE, "reason": reason})
            return
        capacity = Capacity(**header["capacity"])
        member = Member(identity, name, capacity, header.get("model"), self._hello_from)
        # Answer at once: planning and splitting a big model can take minutes before WELCOME,
        # and the node should know meanwhile that it is in, and watch the master's heartbeat.
        self._send(identity, {"op": P.ACCEPTED, "heartbeat_port": self.heartbeat.port})
        if self.planned:  # serving: it takes a share at the next re-plan, between requests
            self.pending.append(member)
            log.info("node %s joined; it gets a share at the next re-plan", name)
        else:
            self.members.append(member)
            log.info("node %s joined (capacity %s)", name, capacity)

    def _serve_chunk(self, identity: bytes, header: dict[str, Any]) -> None:
        ref_sha = str(header.get("sha256", ""))
        path = self.store.root / f"{ref_sha}.safetensors" if self.store else None
        if path is None or not path.is_file() or len(ref_sha) != 64:
            self._send(identity, {"op": P.ERROR, "message": f"no shard {ref_sha}"})
            return
        offset, size = int(header["offset"]), min(int(header["size"]), P.CHUNK_SIZE)
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if self.ship_rate:
            time.sleep(len(data) / self.ship_rate)
        self.shipped_bytes += len(data)
        reply = P.encode({"op": P.CHUNK, "sha256": ref_sha, "offset": offset})
        try:
            self.sock.send_multipart([identity, *reply, data], copy=False)
        except zmq.ZMQError:  # the node went away mid-transfer; its silence is noticed later
            log.warning("node %s left during a shard transfer", identity.decode(errors="replace"))

    def wait_for_workers(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.members) < count:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(self.members)} of {count} workers joined within {timeout:.0f} s"
                )
            msg = self._recv(100)
            if msg:
                self._handle_control(msg[0], msg[1])

    def membership_changed(self, wait: float = 0.0) -> bool:
        """Between requests: take in joins and leaves (waiting up to `wait` s); True when the
        plan no longer matches the members."""
        deadline = time.monotonic() + wait
        while True:
            msg = self._recv(0 if time.monotonic() >= deadline else 50)
            if msg:
                self._handle_control(msg[0], msg[1])
                continue
            for m in self.members:
                if m.alive and self.heartbeat.silence(m.name) > DEAD_AFTER:
                    m.alive = False
                    log.warning("node %s stopped answering; dropping it", m.name)
            if self.pending or any(not m.alive for m in self.members):
                return True
            if time.monotonic() >= deadline:
                return False

    def take_in_changes(self) -> None:
        """Drop the members that left and admit the pending ones, before a re-plan."""
        for m in self.members:
            if not m.alive:
                self.heartbeat.forget(m.name)
        self.members = [m for m in self.members if m.alive] + self.pending
        self.pending = []
        for m in self.members:
            m.ready = False

    def ship(
        self,
        manifest: Manifest,
        store: ShardStore,
        context: int,
        slots: int,
        timeout: float = 600.0,
        progress: Callable[[int, int], None] | None = None,
        windows: list[int] | None = None,
    ) -> None:
        """Tell each worker its slice and shards (node k+1 of the manifest), serve the fetches.

        `windows[k]` is node k's window (index 0, the master, is not used here).
        """
        self.store = store
        for k, member in enumerate(self.members, start=1):
            member.window = windows[k] if windows else None
            member.slice = manifest.slices[k]
            welcome = {
                "op": P.WELCOME,
                "node": k,
                "config": manifest.config,
                "slice": manifest.slices[k],
                "shards": [vars(r) for r in manifest.nodes[k]],
                "rope_freq_factors": manifest.extra.get("rope_freq_factors"),
                "context": context,
                "slots": slots,
                "window": member.window,
                "heartbeat_port": self.heartbeat.port,
            }
            self._send(member.identity, welcome)
        welcomed = time.monotonic()
        deadline = welcomed + timeout
        while not all(m.ready for m in self.members):
            for m in self.members:
                # A worker's first beat comes just after WELCOME; allow it FIRST_BEAT to start.
                silent = min(self.heartbeat.silence(m.name), time.monotonic() - welcomed)
                if silent > max(DEAD_AFTER, FIRST_BEAT if not m.beat_seen else 0.0):
                    raise ClusterError(f"node {m.name} stopped answering while loading its shards")
                m.beat_seen = m.beat_seen or self.heartbeat.silence(m.name) != float("inf")
            if time.monotonic() > deadline:
                raise ClusterError(f"workers did not load their shards within {timeout:.0f} s")
            msg = self._recv(100)
            if msg:
                self._handle_control(msg[0], msg[1])

    # -- the star allreduce -----------------------------------------------------------------
    def send(
        self, block: str, layer: int, h: np.ndarray | torch.Tensor, batch: dict | None = None
    ) -> None:
        """Hand the hidden state to every worker for one block of one layer."""
        dead = [m.name for m in self.members if not m.alive]
        if dead:
            raise ClusterError(f"node {', '.join(dead)} left the cluster")
        if batch is not None:
            self._step += 1
        header: dict[str, Any] = {"op": P.STEP, "step": self._step, "layer": layer, "block": block}
        if batch is not None:
            header["batch"] = batch
        self._sent_at = time.perf_counter()
        frames = P.encode(header, (h,))
        for m in self.members:
            self._send_frames(m.identity, frames)

    def gather(self, block: str, layer: int, local_compute: float = 0.0) -> np.ndarray | None:
        """The sum of every worker's partial for the block just sent (None without workers).

        `local_compute` is how long the master spent on its own partial meanwhile.
        """
        waiting = {m.identity: m for m in self.members}
        waiting_members = dict(waiting)
        slowest = local_compute
        partials: dict[bytes, np.ndarray] = {}
        deadline = time.monotonic() + STEP_TIMEOUT
        spin = True  # partials are due within a step: spin after each arrival, else sleep
        while waiting:
            msg = self._recv(50, spin)
            spin = msg is not None
            if msg is None:
                for m in waiting.values():
                    if self.heartbeat.silence(m.name) > DEAD_AFTER:
                        m.alive = False
                        raise ClusterError(
                            f"node {m.name} stopped answering mid-step (no heartbeat for "
                            f"{self.heartbeat.silence(m.name):.1f} s); the request failed"
                        )
                if time.monotonic() > deadline:
                    raise ClusterError(f"no partials within {STEP_TIMEOUT:.0f} s")
                continue
            identity, header, tensors = msg
            op = header["op"]
            if op == P.PARTIAL:
                stale = (header["step"], header["layer"], header["block"]) != (
                    self._step,
                    layer,
                    block,
                )
                if stale or identity not in waiting:
                    continue  # left over from a failed step
                del waiting[identity]
                partials[identity] = tensors[0]
                if "figures" in header:
                    member = waiting_members[identity]
                    member.figures = header["figures"]
                    member.history.append(header["figures"])
                slowest = max(slowest, float(header.get("compute", 0.0)))
            elif op == P.ERROR:
                m = self._member(identity)
                if m:
                    m.alive = False
                raise ClusterError(
                    f"node {m.name if m else identity!r} failed: {header.get('message')}"
                )
            else:
                self._handle_control(identity, header)
        if not self.members:
            return None
        self.allreduce_seconds.append(time.perf_counter() - self._sent_at - slowest)
        # A fixed order: the same sum whichever partial came first. The partials are read-only
        # views of the messages; the sum is a new array.
        first, *rest = (partials[m.identity] for m in self.members)
        total = first.copy()
        for p in rest:
            total += p
        return total

    def close(self, reason: str = "master shutting down") -> None:
        """Say BYE (and why) to every live worker and close; safe to call twice."""
        if self.sock.closed:
            return
        for m in self.members:
            if m.alive:
                try:
                    self._send(m.identity, {"op": P.BYE, "reason": reason})
                except ClusterError:
                    pass
        self.heartbeat.close()
        self.sock.disable_monitor()
        self.sock.close(linger=1000)  # let the BYEs leave before the socket goes
        self.auth.stop()
        self.context.term()
