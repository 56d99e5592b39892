"""The master's side of the cluster: who is a member, what each holds, and shipping its shards.

The sockets and the star allreduce are master/cluster/transport.py's; the rules of membership are
master/cluster/membership.py's state machine. The `Hub` is the I/O around both: workers join
(HELLO),
are planned in and sent their slice (WELCOME), fetch their shards (FETCH/CHUNK), and leave or go
silent; each of those is an event it applies, and it sends what the transition says.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np

from edgetp.master.cluster import membership as S
from edgetp.master.cluster.membership import Link, Member
from edgetp.master.cluster.transport import ClusterError, Malformed, NodeDown, Received, Transport
from edgetp.memory.shards import Manifest, ShardStore
from edgetp.memory.splitter import NodeShards
from edgetp.models.config import ModelConfig
from edgetp.models.kernels import activations
from edgetp.models.kvformat import DEFAULT_KV_FORMAT
from edgetp.models.layers import Slice, StepBatch
from edgetp.models.moe import Routing
from edgetp.models.rows_native import NativeBlocks
from edgetp.node import messages as M
from edgetp.node import protocol as P
from edgetp.node.executor import Hidden
from edgetp.node.heartbeat import DEAD_AFTER
from edgetp.node.security import JoinToken, Keypair

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


class Hub:
    """The workers' membership and their shards, over the master's `Transport`.

    Every worker the hub knows is in `nodes`, in the order they joined; its status says where
    it stands (master/cluster/membership.py): `members` are the plan's (or the plan being made's),
    `pending` joined since and wait for the next plan, `standby` were left out of this one
    (their link would slow every token: `master.cluster.plan.workers_to_plan`) and are weighed
    again at
    the next. As the engine's `Remote`, it runs the allreduce on the members and marks one lost
    when the transport says so.
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
        self.nodes: list[Member] = []  # every worker not dropped, in the order they joined
        self.restarts: dict[str, int] = {}  # node name -> times its process was restarted here
        self.store: ShardStore | None = None
        self.shipped_bytes = 0
        self._measured: set[bytes] = set()  # members that answered the last MEASURE
        self._split: dict[bytes, M.SplitDone] = {}  # members' answers to the last SPLIT

    @property
    def members(self) -> list[Member]:
        """The plan's workers (lost ones too, until the re-plan), in join order."""
        return [m for m in self.nodes if m.state in S.IN_PLAN]

    @property
    def pending(self) -> list[Member]:
        """Workers that joined since the plan was made: they take a share at the next."""
        return [m for m in self.nodes if m.state is S.State.PENDING]

    @property
    def standby(self) -> list[Member]:
        return [m for m in self.nodes if m.state is S.State.STANDBY]

    # -- membership: events in, effects out ---------------------------------------------------
    def apply(self, member: Member, event: S.Event) -> None:
        """Apply `event` to `member` and carry out what the transition says."""
        member.status, effects = S.apply(member.status, event)
        for effect in effects:
            if isinstance(effect, S.SendBye):
                self._send_quietly(member.identity, M.Bye(effect.reason, effect.rejoin))
            elif isinstance(effect, S.SendStandby):
                self._send_quietly(member.identity, M.Standby(effect.reason))
            else:
                self.heartbeat.forget(member.name)
        if member.state is S.State.GONE:
            self.nodes = [m for m in self.nodes if m is not member]

    @contextmanager
    def _losing_nodes(self) -> Iterator[None]:
        """A node the transport reports down (NodeDown) is marked lost; the error goes on."""
        try:
            yield
        except NodeDown as lost:
            member = self._member(lost.identity)
            if member is not None:
                self.apply(member, S.Failed(str(lost)))
            raise

    def _member(self, identity: bytes) -> Member | None:
        """The node of `identity`: the newest, where a process joined again with it."""
        return next((m for m in reversed(self.nodes) if m.identity == identity), None)

    def _send(self, identity: bytes, message: M.FromMaster, tensors: Sequence[Hidden] = ()) -> None:
        with self._losing_nodes():
            self.transport.send(identity, message, tensors)

    def _send_quietly(self, identity: bytes, message: M.FromMaster) -> None:
        try:
            self.transport.send(identity, message)
        except NodeDown:
            pass

    def _next(self, timeout_ms: int) -> bool:
        """Handle the next message outside a step, if one comes within `timeout_ms`."""
        msg = self.transport.recv(timeout_ms)
        if msg:
            self._handle_control(msg[0], msg[1])
        return msg is not None

    # -- messages outside a step ----------------------------------------------------------------
    def _handle_control(self, identity: bytes, message: Received) -> None:
        """Messages that may come at any time outside a step. One that did not decode drops its
        sender (a node) or is refused (a stranger's HELLO), saying why: a peer with the token
        must not be able to stop the master."""
        member = self._member(identity)
        if isinstance(message, Malformed):
            who = member.name if member else identity.decode(errors="replace")
            log.warning("dropped node %s: it sent a malformed message (%s)", who, message.why)
            if member is not None:
                self.apply(member, S.Failed(f"a malformed message ({message.why})"))
            else:  # a HELLO of another protocol version says so
                self._send_quietly(identity, M.Refuse(message.why))
        elif isinstance(message, M.Hello):
            self._hello(identity, message)
        elif isinstance(message, M.Fetch):
            self._serve_chunk(identity, message)
        elif member is None:
            log.warning("ignored %s from %s, not a member", message, identity.decode("replace"))
        elif isinstance(message, M.Measured):
            member.capacity = msgspec.structs.replace(member.capacity, speed=message.speed)
            self._measured.add(identity)
        elif isinstance(message, M.SplitDone):
            self._split[identity] = message
            if message.unreachable:
                log.warning("node %s cannot reach the hub (%s): the master splits its share and "
                            "ships it", member.name, message.unreachable)  # fmt: skip
            else:
                log.info("node %s split its share: %d bytes of the model's file in %d "
                         "requests", member.name, message.fetched, message.requests)  # fmt: skip
        elif isinstance(message, M.Ready):
            self.apply(member, S.Ready())
            log.info("node %s ready", member.name)
        elif isinstance(message, M.Leave):
            log.info("node %s left; its share goes to the others at the next re-plan", member.name)
            self.apply(member, S.Failed("it left"))
        elif isinstance(message, M.Error):  # mid-step the transport raises it; here it drops
            if member.alive:  # once dropped, its other errors say no more
                log.warning("node %s failed (%s); the next plan leaves it out", member.name,
                            message.message)  # fmt: skip
            self.apply(member, S.Failed(message.message))
        # a PARTIAL or an ECHOED left over from a step or a probe that failed: nothing to do

    def _hello(self, identity: bytes, hello: M.Hello) -> None:
        reason = M.version_mismatch(hello.version)
        if reason is None and hello.model and self.model_names:
            if hello.model not in self.model_names:
                reason = (
                    f"this node asked for model {hello.model!r} but the master runs "
                    f"{self.model_names[0]!r}"
                )
        if reason:
            log.warning("refused node %s: %s", hello.name, reason)
            self._send_quietly(identity, M.Refuse(reason))
            return
        # Answer at once: planning and splitting a big model can take minutes before WELCOME,
        # and the node should know meanwhile that it is in, and watch the master's heartbeat.
        try:
            self._send(identity, M.Accepted(self.heartbeat.port))
        except NodeDown:  # it went before this master read its HELLO (it gave up waiting)
            log.warning("node %s left before its HELLO was answered", hello.name)
            return
        # The same identity again (a restarted worker, a peer dropped before): the new process
        # holds none of the old one's slice.
        for old in [m for m in self.nodes if m.identity == identity]:
            self.apply(old, S.Superseded())
        self.nodes.append(
            Member(identity, hello.name, hello.capacity, hello.model, hello.peer_address)
        )
        log.info("node %s joined (capacity %s); it gets a share at the next plan", hello.name,
                 hello.capacity)  # fmt: skip

    def _serve_chunk(self, identity: bytes, fetch: M.Fetch) -> None:
        path = self.store.root / f"{fetch.sha256}.safetensors" if self.store else None
        if path is None or not path.is_file():  # (its name is a sha256: M.Fetch)
            self._send(identity, M.Error(f"no shard {fetch.sha256}"))
            return
        with open(path, "rb") as f:
            f.seek(fetch.offset)
            data = f.read(min(fetch.size, P.CHUNK_SIZE))
        if self.ship_rate:
            time.sleep(len(data) / self.ship_rate)
        self.shipped_bytes += len(data)
        reply = M.encode(M.Chunk(fetch.sha256, fetch.offset))
        try:
            self.transport.send_frames(identity, [*reply, data])
        except NodeDown:  # the node went away mid-transfer; its silence is noticed later
            log.warning("node %s left during a shard transfer", identity.decode(errors="replace"))

    # -- between requests -------------------------------------------------------------------------
    def wait_for_workers(
        self, count: int, timeout: float, check: Callable[[], None] | None = None
    ) -> None:
        """Until `count` workers have joined; `check` raises if one can no longer come (a local
        worker that died)."""
        deadline = time.monotonic() + timeout
        while len([m for m in self.nodes if m.alive]) < count:
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(self.nodes)} of {count} workers joined within {timeout:.0f} s"
                )
            self._next(100)

    def watch_membership(self, wait: float = 0.0) -> bool:
        """Between requests: handle joins, fetches and leaves, and drop the nodes gone silent
        (waiting up to `wait` s); True, at once, when the plan no longer matches the nodes."""
        deadline = time.monotonic() + wait
        while True:
            if self._next(0 if time.monotonic() >= deadline else 50):
                continue
            for m in [m for m in self.nodes if m.alive and m.state is not S.State.PENDING]:
                if self.heartbeat.silence(m.name) > DEAD_AFTER:
                    log.warning("node %s stopped answering; dropping it", m.name)
                    self.apply(m, S.Failed("it stopped answering"))
            if any(m.state in (S.State.PENDING, S.State.LOST) for m in self.nodes):
                return True
            if time.monotonic() >= deadline:
                return False

    def take_in(self) -> None:
        """Before a plan: every live node is weighed in it (pending, on standby or planned
        before), and the lost ones are dropped, each told why: one that may still be there (it
        went silent for a while, or failed) joins again, rather than wait for steps that no
        longer come to it."""
        for m in list(self.nodes):
            self.apply(m, S.TakenIn())

    def leave_out(self, members: list[Member], reason: str) -> None:
        """Put `members` on standby for this plan, and tell them why (they wait for the next)."""
        for m in members:
            m.slice, m.head_rows, m.window, m.figures = None, 0, None, {}
            log.warning("node %s is on standby: %s", m.name, reason)
            self.apply(m, S.LeftOut(reason))

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
                self._send(member.identity, M.Measure())
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
        self._send(member.identity, M.Echo(), (payload,))
        while time.monotonic() < deadline and member.alive:
            msg = self.transport.recv(100)
            if msg is None:
                continue
            if msg[0] == member.identity and isinstance(msg[1], M.Echoed):
                return time.perf_counter() - started
            self._handle_control(msg[0], msg[1])
        raise TimeoutError("no answer to ECHO")

    def split_shares(
        self,
        model: M.RemoteModel,
        slices: Sequence[Slice],
        dtype: str,
        head_rows: Sequence[tuple[int, int]] | None,
        timeout: float = 3600.0,
    ) -> list[NodeShards | None]:
        """Each worker splits its own share of the plan (node k+1's) from the model's file on
        the hub, fetching only its slices' bytes (SPLIT); their shards, in plan order, None for
        a worker that cannot reach the hub. A worker that fails otherwise, or stops answering,
        fails the split, saying which and why."""
        self._split = {}
        for k, member in enumerate(self.members, start=1):
            job = M.Split(k, model, list(slices), dtype, list(head_rows or []))
            self._send(member.identity, job)
        asked = time.monotonic()
        while not all(m.identity in self._split for m in self.members):
            for m in self.members:
                if not m.alive:  # it said ERROR, or a new process of the same name joined
                    raise ClusterError(
                        f"node {m.name} could not split its share: {m.failure or 'it joined again'}"
                    )
                if min(self.heartbeat.silence(m.name), time.monotonic() - asked) > DEAD_AFTER:
                    why = f"node {m.name} stopped answering while splitting its share"
                    self.apply(m, S.Failed(why))
                    raise ClusterError(why)
            if time.monotonic() > asked + timeout:
                raise ClusterError(f"workers did not split their shares within {timeout:.0f} s")
            self._next(100)
        done = [self._split[m.identity] for m in self.members]
        return [None if d.unreachable else NodeShards(d.layers, d.head) for d in done]

    def ship(
        self,
        manifest: Manifest,
        store: ShardStore,
        context: int,
        slots: int,
        timeout: float = 600.0,
        progress: Callable[[int, int], None] | None = None,
        windows: list[int] | None = None,
        kv_format: str = DEFAULT_KV_FORMAT,
    ) -> None:
        """Tell each worker its slice and shards (node k+1 of the manifest), serve the fetches.

        `windows[k]` is node k's window (index 0, the master, is not used here); every node
        stores keys and values as `kv_format`.
        """
        self.store = store
        config = ModelConfig.from_dict(manifest.config)
        for k, member in enumerate(self.members, start=1):
            member.window = windows[k] if windows else None
            member.slice = manifest.slices[k]
            member.head_rows, head = 0, None
            if manifest.heads:
                a, b = manifest.head_rows[k]
                member.head_rows, head = b - a, M.HeadRows((a, b), manifest.heads[k - 1])
            welcome = M.Welcome(
                node=k,
                config=config,
                slice=Slice.from_dict(manifest.slices[k]),
                shards=manifest.nodes[k],
                context=context,
                slots=slots,
                heartbeat_port=self.heartbeat.port,
                window=member.window,
                rope_freq_factors=manifest.extra.get("rope_freq_factors"),
                head=head,
                activations=activations(),
                kv_format=kv_format,
            )
            self.apply(member, S.Welcomed())
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
                    why = f"node {m.name} stopped answering while loading its shards"
                    self.apply(m, S.Failed(why))  # a re-plan leaves it out
                    raise ClusterError(why)
                m.beat_seen = m.beat_seen or self.heartbeat.silence(m.name) != float("inf")
            if time.monotonic() > deadline:
                raise ClusterError(f"workers did not load their shards within {timeout:.0f} s")
            self._next(100)

    # -- the engine's Remote: the star allreduce on the members ------------------------------

    @property
    def sums(self) -> int:
        """Every sum since the start: a step pays one a block whatever its batch, so
        concurrent sequences share them (`/v1/cluster`, `/metrics`)."""
        return self.transport.sums

    def begin_step(self, batch: StepBatch) -> None:
        self.transport.begin_step(batch)

    def _identities(self) -> dict[bytes, str]:
        """The members' identities and names, for a step; ClusterError if one is lost."""
        dead = [m.name for m in self.members if not m.alive]
        if dead:
            raise ClusterError(f"node {', '.join(dead)} left the cluster")
        return {m.identity: m.name for m in self.members}

    def send(self, block: P.Block, layer: int, h: Hidden, routing: Routing | None = None) -> None:
        """Hand the hidden state (and an FFN's experts, `routing`) to every member for one block
        of one layer."""
        identities = list(self._identities())
        with self._losing_nodes():
            self.transport.send_step(identities, block, layer, h, routing)

    def gather(self, block: P.Block, layer: int, local_compute: float = 0.0) -> np.ndarray | None:
        """The sum of every member's partial for the block just sent (None without workers)."""
        names = {m.identity: m.name for m in self.members}
        with self._losing_nodes():
            total, figures = self.transport.gather(
                names, block, layer, self._handle_control, local_compute
            )
        self._take_figures(figures)
        return total

    def gather_rows(self, layer: int, local_compute: float = 0.0) -> list[np.ndarray]:
        """Every member's logits for the HEAD just sent (as `layer`), in member order."""
        names = {m.identity: m.name for m in self.members}
        widths = {m.identity: m.head_rows for m in self.members}
        with self._losing_nodes():
            return self.transport.gather_rows(
                names, widths, layer, self._handle_control, local_compute
            )

    def decode_layers(
        self,
        blocks: NativeBlocks,
        h: np.ndarray,
        post_norms: np.ndarray | None,
        eps: float,
        attention_alone: bool = False,
    ) -> tuple[np.ndarray, float]:
        """Every layer of a decode step through the native loop (`Transport.decode_layers`):
        the new hidden state and this process's compute seconds."""
        names = self._identities()
        with self._losing_nodes():
            h, figures, compute = self.transport.decode_layers(
                blocks, names, h, self._handle_control, post_norms, eps, attention_alone
            )
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
        for m in list(self.nodes):
            self.apply(m, S.Closed(reason))
        self.transport.close()
