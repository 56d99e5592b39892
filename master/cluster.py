"""The master's side of the cluster: who is a member, what each holds, and shipping its shards.

The sockets and the star allreduce are master/transport.py's; the `Hub` decides who takes part
in them: workers join (HELLO), are planned in and sent their slice (WELCOME), fetch their shards
(FETCH/CHUNK), and leave or go silent.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from master.transport import MALFORMED, ClusterError, NodeDown, Transport
from memory.shards import Manifest, ShardStore
from memory.window import FIGURES_KEPT
from models.rows_native import NativeBlocks
from node import protocol as P
from node.heartbeat import DEAD_AFTER
from node.security import JoinToken, Keypair
from node.worker import Capacity

log = logging.getLogger(__name__)

FIRST_BEAT = 10.0  # s a worker has, after WELCOME, to send its first heartbeat
MEASURE_TIMEOUT = 10.0  # s the workers have to answer MEASURE (a probe takes ~0.1 s)
LINK_PROBE_BYTES = 1 << 18  # the large ECHO: 21 ms each way at 100 Mbit/s
LINK_PROBE_ROUNDS = 5  # round trips of a sum's message, for their median
# Round trips of it timed first and not counted: a node's first ECHOs run its cold Python path
# (938, 548, 342 us, then ~310, at cpu=0.5), and a median of three of them put a 2-device
# split's sums above the compute it saves when its tokens came 0.66x of one device's.
LINK_PROBE_WARMUP = 1
# Round trips of the large ECHO, for their median: each takes ~0.4 s at 10 Mbit/s. They have
# MEASURE_TIMEOUT of their own, and a link too slow for all of them in it is timed by those that
# fit (its transfer dwarfs any noise): down to ~0.4 Mbit/s, one round in 10 s.
LINK_RATE_ROUNDS = 3


@dataclass(frozen=True)
class Link:
    """A worker's link to the master, as the master timed it with ECHOs: the round trip of a
    message the size of a sum's (Hub.measure_links), and the bytes a second a large one added
    (inf: too fast to tell apart from the round trip's noise)."""

    rtt_s: float
    bytes_per_s: float


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
    failure: str = ""  # why it was dropped, when it said (an ERROR) or sent what it should not
    rejoin: bool = True  # once dropped, whether to ask it to join again (not if it is too small)
    window: int | None = None  # layers of its slice in memory, as planned
    slice: dict[str, list[int]] | None = None  # its share of every layer, as planned
    head_rows: int = 0  # its rows of the lm_head, as planned
    link: Link | None = None  # as last timed (Hub.measure_links); None: not timed
    # Its latest step's figures (loader, memory), and every step's since the last clear.
    figures: dict[str, Any] = field(default_factory=dict)
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=FIGURES_KEPT))


class Hub:
    """The workers' membership and their shards, over the master's `Transport`.

    Members are planned in; a worker that joins while an engine runs (`planned`) waits in
    `pending` for the next re-plan, and one the plan left out (its link would slow every
    token: `master.plan.workers_to_plan`) waits in `standby`, joined and beating, until a
    re-plan weighs it again. As the engine's `Remote`, it runs the allreduce on the members and
    marks one lost when the transport says so.
    """

    def __init__(
        self,
        bind: str = "127.0.0.1",
        port: int = 0,
        model_names: tuple[str, ...] = (),
        ship_rate: float | None = None,
        keys: Keypair | None = None,
        token: JoinToken | None = None,
    ) -> None:
        self.transport = Transport(bind, port, keys, token)
        self.keys, self.token = self.transport.keys, self.transport.token
        self.port, self.address = self.transport.port, self.transport.address
        self.heartbeat = self.transport.heartbeat
        self.allreduce_seconds = self.transport.allreduce_seconds
        self.model_names = model_names  # names a worker may ask for (None: any)
        self.ship_rate = ship_rate  # bytes/s cap on shard shipping, for shared links
        self.members: list[Member] = []
        self.pending: list[Member] = []  # joined while serving; planned in at the next re-plan
        self.standby: list[Member] = []  # left out of the plan; weighed again at the next one
        self.restarts: dict[str, int] = {}  # node name -> times its process was restarted here
        self.store: ShardStore | None = None
        self.shipped_bytes = 0
        self.planned = False  # an engine runs on the members: a node joining waits for a re-plan
        self._measured: set[bytes] = set()  # members that answered the last MEASURE

    def _send(self, identity: bytes, header: dict[str, Any], tensors: tuple = ()) -> None:
        try:
            self.transport.send(identity, header, tensors)
        except NodeDown as lost:
            self._lose(lost)
            raise

    def _lose(self, lost: NodeDown) -> None:
        member = self._member(lost.identity)
        if member is not None:
            member.alive = False  # a re-plan leaves it out

    def _next(self, timeout_ms: int) -> bool:
        """Handle the next message outside a step, if one comes within `timeout_ms`."""
        msg = self.transport.recv(timeout_ms)
        if msg:
            self._handle_control(msg[0], msg[1])
        return msg is not None

    def _member(self, identity: bytes) -> Member | None:
        return next((m for m in [*self.members, *self.standby] if m.identity == identity), None)

    # -- joining and shipping ---------------------------------------------------------------
    def _handle_control(self, identity: bytes, header: dict[str, Any]) -> None:
        """Messages that may come at any time outside a step. One that does not hold what its
        op needs is logged and its sender dropped (a node) or refused (a HELLO): a peer with
        the token must not be able to stop the master."""
        try:
            self._control(identity, header)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            member = self._member(identity)
            who = member.name if member else identity.decode(errors="replace")
            log.warning("dropped node %s: a malformed %r message (%r)", who, header.get("op"), exc)
            if member is not None:
                member.alive = False  # a re-plan leaves it out
                member.failure = f"a malformed {header.get('op')!r} message"
            else:
                self._send_quietly(identity, {"op": P.REFUSE, "reason": "malformed message"})

    def _send_quietly(self, identity: bytes, header: dict[str, Any]) -> None:
        try:
            self.transport.send(identity, header)
        except NodeDown:
            pass

    def _control(self, identity: bytes, header: dict[str, Any]) -> None:
        op = header["op"]
        if op == MALFORMED:
            raise ValueError(header["why"])
        if op == P.HELLO:
            self._hello(identity, header)
        elif op == P.FETCH:
            self._serve_chunk(identity, header)
        elif op == P.MEASURED:
            member = self._member(identity)
            speed = float(header["speed"])
            if not 0.0 < speed < math.inf:  # a NaN, a zero or a negative would skew every share
                raise ValueError(f"a measured speed of {speed!r}")
            if member:
                member.capacity = replace(member.capacity, speed=speed)
                self._measured.add(identity)
        elif op == P.READY:
            member = self._member(identity)
            if member:
                member.ready = True
                log.info("node %s ready", member.name)
        elif op == P.LEAVE:
            member = self._member(identity)
            if member:
                member.alive, member.failure = False, "it left"
                log.info(
                    "node %s left; its share goes to the others at the next re-plan", member.name
                )
        elif op == P.ERROR:  # mid-step the transport raises it; here it drops the node
            member = self._member(identity)
            if member is None:
                who = identity.decode(errors="replace")
                log.warning("ignored an error from %s, not a member: %s", who, header["message"])
                return
            if not member.alive:  # dropped already: its other errors say no more
                return
            member.alive, member.failure = False, str(header["message"])
            log.warning("node %s failed (%s); the next plan leaves it out", member.name,
                        member.failure)  # fmt: skip

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
        c = header["capacity"]
        window = c.get("window")
        message_s = float(c.get("message_s", 0.0))  # 0: a node that did not measure it
        if not 0.0 <= message_s < 1.0:  # a NaN or a negative would skew every share
            raise ValueError(f"a capacity whose message_s is {message_s!r}")
        capacity = Capacity(
            int(c["memory_budget"]),
            int(c["cores"]),
            float(c["speed"]),
            None if window is None else int(window),
            None if c.get("disk") is None else float(c["disk"]),
            message_s,
        )
        address = header.get("peer_address", "")
        member = Member(identity, name, capacity, header.get("model"), address)
        # Answer at once: planning and splitting a big model can take minutes before WELCOME,
        # and the node should know meanwhile that it is in, and watch the master's heartbeat.
        self._send(identity, {"op": P.ACCEPTED, "heartbeat_port": self.heartbeat.port})
        # The same identity again (a restarted worker, a peer dropped before): one entry each.
        self.pending = [m for m in self.pending if m.identity != identity]
        self.standby = [m for m in self.standby if m.identity != identity]
        for old in [m for m in self.members if m.identity == identity]:
            old.alive = False  # planned or not, the new process holds none of its slice
            if not self.planned:
                self.members.remove(old)
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
            self.transport.send_frames(identity, [*reply, data])
        except NodeDown:  # the node went away mid-transfer; its silence is noticed later
            log.warning("node %s left during a shard transfer", identity.decode(errors="replace"))

    def wait_for_workers(
        self, count: int, timeout: float, check: Callable[[], None] | None = None
    ) -> None:
        """Until `count` workers are members; `check` raises if one can no longer come (a local
        worker that died)."""
        deadline = time.monotonic() + timeout
        while len(self.members) < count:
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(self.members)} of {count} workers joined within {timeout:.0f} s"
                )
            self._next(100)

    def membership_changed(self, wait: float = 0.0) -> bool:
        """Between requests: take in joins and leaves (waiting up to `wait` s); True when the
        plan no longer matches the members."""
        deadline = time.monotonic() + wait
        while True:
            if self._next(0 if time.monotonic() >= deadline else 50):
                continue
            for m in [*self.members, *self.standby]:
                if m.alive and self.heartbeat.silence(m.name) > DEAD_AFTER:
                    m.alive = False
                    log.warning("node %s stopped answering; dropping it", m.name)
            for m in [m for m in self.standby if not m.alive]:  # the plan goes on without it
                self.standby.remove(m)
                self.heartbeat.forget(m.name)
                # One that was only paused joins again when it wakes, as in take_in_changes.
                why = f"dropped from standby ({m.failure or 'it stopped answering'})"
                self._send_quietly(m.identity, {"op": P.BYE, "reason": why, "rejoin": m.rejoin})
            if self.pending or any(not m.alive for m in self.members):
                return True
            if time.monotonic() >= deadline:
                return False

    def take_in_changes(self) -> None:
        """Drop the members that left, admit the pending ones and those on standby (the plan
        weighs them again), before a re-plan. A dropped
        node that may still be there (it went silent for a while, or failed) is told so: it
        joins again, rather than wait for steps that no longer come to it."""
        weighed = self.members + self.standby
        staying = {m.identity for m in weighed if m.alive} | {m.identity for m in self.pending}
        for m in weighed:
            if not m.alive:
                self.heartbeat.forget(m.name)
                if m.identity not in staying:  # not a restarted process of the same name
                    why = f"dropped from the plan ({m.failure or 'it stopped answering'})"
                    bye = {"op": P.BYE, "reason": why, "rejoin": m.rejoin}
                    self._send_quietly(m.identity, bye)
        self.members = [m for m in weighed if m.alive] + self.pending
        self.pending, self.standby = [], []
        for m in self.members:
            m.ready = False

    def leave_out(self, members: list[Member], reason: str) -> None:
        """Put `members` on standby for this plan, and tell them why (they wait for the next)."""
        for m in members:
            self.members.remove(m)
            self.standby.append(m)
            m.slice, m.head_rows, m.window, m.ready, m.figures = None, 0, None, False, {}
            log.warning("node %s is on standby: %s", m.name, reason)
            self._send_quietly(m.identity, {"op": P.STANDBY, "reason": reason})

    def measure_speeds(self, own: Callable[[], float], timeout: float = MEASURE_TIMEOUT) -> float:
        """Every member measures its speed again while the master runs `own` (its own probe),
        all at one moment: on one host (emulated devices) a probe reads what the host's memory
        gives at that moment, and probes taken at each node's start, one while another loads,
        differed by 10-20% between identical devices. Each answer replaces the member's
        figure; a member that does not answer within `timeout` keeps the one it joined with.
        Returns what `own` measured."""
        asked = [m for m in self.members if m.alive]
        self._measured = set()
        for member in asked:
            try:
                self._send(member.identity, {"op": P.MEASURE})
            except NodeDown:
                log.warning("node %s went away before measuring", member.name)
        speed = own()
        deadline = time.monotonic() + timeout
        waiting = [m for m in asked if m.alive and m.identity not in self._measured]
        while waiting and time.monotonic() < deadline:
            self._next(100)
            waiting = [m for m in asked if m.alive and m.identity not in self._measured]
        for member in waiting:
            log.warning(
                "node %s did not measure its speed again within %.0f s; its figure from "
                "joining (%s GB/s) stands", member.name, timeout, member.capacity.speed
            )  # fmt: skip
        return speed

    def measure_links(self, message_bytes: int = 4, timeout: float = MEASURE_TIMEOUT) -> None:
        """Time each member's link: LINK_PROBE_ROUNDS round trips of an ECHO carrying
        `message_bytes` (a sum's hidden state, where the plan asks), after LINK_PROBE_WARMUP not
        counted, and LINK_RATE_ROUNDS of one carrying LINK_PROBE_BYTES, or as many as fit;
        each kind within `timeout` of its own round trips, one member at a time (so that no
        member's transfer waits on another's). A member that does not answer within `timeout`
        keeps no figure, logged."""
        payloads = (
            np.zeros(max(message_bytes // 4, 1), np.float32),
            np.zeros(LINK_PROBE_BYTES // 4, np.float32),
        )
        for member in [m for m in self.members if m.alive]:
            small: list[float] = []
            large: list[float] = []
            slow = False  # the large rounds left would not fit their time
            try:  # each kind within `timeout` of its own round trips
                for k in range(LINK_PROBE_WARMUP + LINK_PROBE_ROUNDS):
                    deadline = time.monotonic() + timeout - sum(small)
                    small.append(self._echo(member, payloads[0], deadline))
                    if k >= LINK_RATE_ROUNDS or slow:
                        continue
                    deadline = time.monotonic() + timeout - sum(large)
                    large.append(self._echo(member, payloads[1], deadline))
                    left = LINK_RATE_ROUNDS - len(large)
                    slow = sum(large) + 1.2 * left * large[-1] > timeout
            except (NodeDown, TimeoutError) as exc:
                member.link = None
                log.warning("could not time the link to node %s (%s)", member.name, exc)
                continue
            rtt = float(np.median(small[LINK_PROBE_WARMUP:]))
            extra = float(np.median(large)) - rtt
            rate = 2 * (payloads[1].nbytes - payloads[0].nbytes) / extra if extra > 0 else math.inf
            member.link = Link(rtt, rate)

    def _echo(self, member: Member, payload: np.ndarray, deadline: float) -> float:
        """Seconds for one ECHO of `payload` to `member` and back; other messages that come
        meanwhile are handled as they would be."""
        started = time.perf_counter()
        self._send(member.identity, {"op": P.ECHO}, (payload,))
        while time.monotonic() < deadline and member.alive:
            msg = self.transport.recv(100)
            if msg is None:
                continue
            if msg[0] == member.identity and msg[1].get("op") == P.ECHOED:
                return time.perf_counter() - started
            self._handle_control(msg[0], msg[1])
        raise TimeoutError("no answer to ECHO")

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
            member.head_rows = 0
            if manifest.heads:
                a, b = manifest.head_rows[k]
                member.head_rows = b - a
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
            if manifest.heads:
                welcome["head"] = {"rows": manifest.head_rows[k], **vars(manifest.heads[k - 1])}
            self._send(member.identity, welcome)
        welcomed = time.monotonic()
        deadline = welcomed + timeout
        while not all(m.ready for m in self.members):
            for m in self.members:
                # A worker's first beat comes just after WELCOME; allow it FIRST_BEAT to start.
                if not m.alive:  # it said ERROR, or a new process of the same name joined
                    raise ClusterError(
                        f"node {m.name} failed while loading its shards: "
                        f"{m.failure or 'it joined again'}"
                    )
                silent = min(self.heartbeat.silence(m.name), time.monotonic() - welcomed)
                if silent > max(DEAD_AFTER, FIRST_BEAT if not m.beat_seen else 0.0):
                    m.alive = False  # a re-plan leaves it out
                    raise ClusterError(f"node {m.name} stopped answering while loading its shards")
                m.beat_seen = m.beat_seen or self.heartbeat.silence(m.name) != float("inf")
            if time.monotonic() > deadline:
                raise ClusterError(f"workers did not load their shards within {timeout:.0f} s")
            self._next(100)

    # -- the engine's Remote: the star allreduce on the members ------------------------------
    def begin_step(self, batch: dict[str, Any]) -> None:
        self.transport.begin_step(batch)

    def send(self, block: str, layer: int, h: np.ndarray | torch.Tensor) -> None:
        """Hand the hidden state to every member for one block of one layer."""
        dead = [m.name for m in self.members if not m.alive]
        if dead:
            raise ClusterError(f"node {', '.join(dead)} left the cluster")
        try:
            self.transport.send_step([m.identity for m in self.members], block, layer, h)
        except NodeDown as lost:
            self._lose(lost)
            raise

    def gather(self, block: str, layer: int, local_compute: float = 0.0) -> np.ndarray | None:
        """The sum of every member's partial for the block just sent (None without workers)."""
        names = {m.identity: m.name for m in self.members}
        try:
            total, figures = self.transport.gather(
                names, block, layer, self._handle_control, local_compute
            )
        except NodeDown as lost:
            self._lose(lost)
            raise
        self._take_figures(figures)
        return total

    def gather_rows(self, layer: int, local_compute: float = 0.0) -> list[np.ndarray]:
        """Every member's logits for the HEAD just sent (as `layer`), in member order."""
        names = {m.identity: m.name for m in self.members}
        widths = {m.identity: m.head_rows for m in self.members}
        try:
            return self.transport.gather_rows(
                names, widths, layer, self._handle_control, local_compute
            )
        except NodeDown as lost:
            self._lose(lost)
            raise

    def decode_layers(self, blocks: NativeBlocks, h: np.ndarray) -> tuple[np.ndarray, float]:
        """Every layer of a decode step through the native loop (`Transport.decode_layers`):
        the new hidden state and this process's compute seconds."""
        dead = [m.name for m in self.members if not m.alive]
        if dead:
            raise ClusterError(f"node {', '.join(dead)} left the cluster")
        names = {m.identity: m.name for m in self.members}
        try:
            h, figures, compute = self.transport.decode_layers(
                blocks, names, h, self._handle_control
            )
        except NodeDown as lost:
            self._lose(lost)
            raise
        self._take_figures(figures)
        return h, compute

    def _take_figures(self, figures: dict[bytes, dict[str, Any]]) -> None:
        for m in self.members:
            if m.identity in figures:
                m.figures = figures[m.identity]
                m.history.append(m.figures)

    def close(self, reason: str = "master shutting down") -> None:
        """Say BYE (and why) to every live worker and close; safe to call twice."""
        if self.transport.sock.closed:
            return
        for m in [*self.members, *self.standby]:
            if m.alive:
                try:
                    self._send(m.identity, {"op": P.BYE, "reason": reason})
                except ClusterError:
                    pass
        self.transport.close()
