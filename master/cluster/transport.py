"""The master's links to its workers: one CurveZMQ ROUTER socket, and the star allreduce on it.

Every worker connects a DEALER. Per layer block `send_step` hands the hidden state to every
worker, the master computes its own partial meanwhile, and `gather` adds the workers' partials:
two hops per sum, whatever the node count. Whatever else arrives (a join, a shard fetch, a
leave) goes to the caller's handler: who is a member, and what it holds, is master/cluster/hub.py's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from edgetp.models.layers import StepBatch
from edgetp.models.moe import Routing
from edgetp.models.rows_native import NativeBlocks
from edgetp.node import hop as hop_codes
from edgetp.node import messages as M
from edgetp.node import protocol as P
from edgetp.node.executor import Hidden
from edgetp.node.heartbeat import DATA_IO, DEAD_AFTER, HeartbeatServer, node_context
from edgetp.node.hop import HubHop
from edgetp.node.security import JoinToken, Keypair, secure_server

log = logging.getLogger(__name__)

STEP_TIMEOUT = 300.0  # s: a hard cap on one block's gather, beyond heartbeat liveness
ALLREDUCE_KEPT = 20_000  # recent per-sum latencies kept for the figures
HOPS_KEPT = 1024  # recent hops kept per worker for its figures


class ClusterError(Exception):
    """A node or the cluster failed; the message names the node and what to do."""


@dataclass(frozen=True)
class Malformed:
    """A message that did not decode, handed on as such: its sender is dropped."""

    why: str


Received = M.FromNode | Malformed
Handler = Callable[[bytes, Received], None]  # a message that is not a partial


class NodeDown(ClusterError):
    """One node failed, went silent or became unreachable; `identity` says which."""

    def __init__(self, identity: bytes, message: str) -> None:
        super().__init__(message)
        self.identity = identity


class _TokenHolders:
    """ZAP: admit only the client key that the current join token derives."""

    def __init__(self, token: JoinToken) -> None:
        self.allowed = token.client_keys().public

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.allowed:
            return True
        log.warning("refused a node: its key does not come from the current join token")
        return False


class Transport:
    """The master's sockets. Links are CurveZMQ: `keys` is the master's keypair and `token` the
    join token nodes must hold; both are made up for this process when not given (a local
    cluster hands the token to its own workers)."""

    def __init__(
        self,
        bind: str = "127.0.0.1",
        port: int = 0,
        keys: Keypair | None = None,
        token: JoinToken | None = None,
    ) -> None:
        if keys is None:
            public, secret = zmq.curve_keypair()
            keys = Keypair(public, secret)
        self.keys = keys
        self.token = token or JoinToken(keys.public, os.urandom(16))
        self.context = node_context()  # the heartbeats on an I/O thread of their own
        self.auth = ThreadAuthenticator(self.context, log=logging.getLogger("edgetp.auth"))
        self.auth.start()
        self.auth.configure_curve_callback("*", _TokenHolders(self.token))
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.AFFINITY, DATA_IO)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A node that joins again (restarted, or told it was dropped) may connect before this
        # socket has seen its old connection close: without a hand-over the new one would be
        # refused, and the HELLO queued on it lost with it.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
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
        self._step = 0
        self._batch: StepBatch | None = None  # rides on the step's first message
        self._sent_at = 0.0
        self._sent_shape: tuple[int, ...] = ()
        # Per sum: time from handing out the hidden state to holding every partial, less the
        # longest compute of any node (master included): the latency the allreduce adds.
        # (bounded: a server runs 60 sums a token for days)
        self.allreduce_seconds: deque[float] = deque(maxlen=ALLREDUCE_KEPT)
        self.sums = 0  # every sum since the start (the deque keeps the latest): one a block a step
        # Per worker: each sum's partial's arrival after its STEP went, less the worker's own
        # compute: what its link and hop cost, beside the round trip its link was timed at.
        self.hop_seconds: dict[bytes, deque[float]] = {}
        self.spin = P.spin_seconds()
        self.one_core = P.on_one_core()
        self._hop: HubHop | None = None  # the native loop, for the members it was made for
        # What a block's hidden state and the partials back travel as (`MemoryOptions.wire`):
        # "float16" halves a sum's bytes, a message with a value past its range going as float32
        self.wire = "float32"

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

    # -- messages ---------------------------------------------------------------------------
    def send(self, identity: bytes, message: M.FromMaster, tensors: Sequence[Hidden] = ()) -> None:
        self.send_frames(identity, M.encode(message, tensors))

    def send_frames(self, identity: bytes, frames: list[Any]) -> None:
        try:
            self.sock.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer is gone
            name = identity.decode(errors="replace")
            raise NodeDown(identity, f"node {name} is unreachable ({exc.strerror})") from exc

    def recv(
        self, timeout_ms: int, spin: float = 0.0
    ) -> tuple[bytes, Received, list[np.ndarray]] | None:
        """The next message, or None after `timeout_ms`; one that does not decode comes as
        `Malformed`, so that its sender is dropped. A HELLO gets the address it came from as
        its peer_address (for the cluster view)."""
        if not P.wait_readable(self.sock, timeout_ms, spin):
            return None
        identity, *frames = self.sock.recv_multipart(copy=False)
        peer = str(frames[0].get("Peer-Address")) if frames else ""
        return _decoded(identity.bytes, frames, peer)

    # -- the star allreduce -----------------------------------------------------------------
    def begin_step(self, batch: StepBatch) -> None:
        """A new step: its batch goes to the workers with the step's first block."""
        self._step += 1
        self._batch = batch

    def send_step(
        self,
        identities: list[bytes],
        block: P.Block,
        layer: int,
        h: Hidden,
        routing: Routing | None = None,
    ) -> None:
        """Hand the hidden state to every worker for one block of one layer, and an FFN block's
        choice of experts (`routing`) where the model has them."""
        step = M.Step(step=self._step, layer=layer, block=block, batch=self._batch)
        if routing is not None:
            step = msgspec.structs.replace(
                step, experts=routing.experts.tolist(), expert_weights=routing.weights.tolist()
            )
        self._batch = None
        self._sent_at = time.perf_counter()
        self._sent_shape = tuple(h.shape)  # what each partial must be
        frames = M.encode(step, (h if block == P.HEAD else M.for_the_wire(h, self.wire),))
        for identity in identities:
            self.send_frames(identity, frames)
        if self.one_core:  # the I/O thread these sends woke writes them first (`on_one_core`)
            os.sched_yield()

    def gather(
        self,
        names: Mapping[bytes, str],
        block: P.Block,
        layer: int,
        handle: Handler,
        local_compute: float = 0.0,
    ) -> tuple[np.ndarray | None, dict[bytes, dict[str, Any]]]:
        """The sum of the partials of the workers `names` (identity -> name) for the block just
        sent (None without workers), and the step figures any of them reported.

        `local_compute` is how long the master spent on its own partial meanwhile.
        """
        partials, figures = self._collect(names, block, layer, handle, local_compute)
        if not partials:
            return None, figures
        # A fixed order: the same sum whichever partial came first. The partials are read-only
        # views of the messages; the sum is a new array.
        first, *rest = partials
        total = first.astype(np.float32)  # float16 on the wire: summed in float32
        for p in rest:
            total += p
        return total, figures

    def gather_rows(
        self,
        names: Mapping[bytes, str],
        widths: Mapping[bytes, int],
        layer: int,
        handle: Handler,
        local_compute: float = 0.0,
    ) -> list[np.ndarray]:
        """The workers' logits for the HEAD just sent, in the order of `names`: each (R, its
        `widths` rows of the lm_head)."""
        partials, _ = self._collect(names, P.HEAD, layer, handle, local_compute, widths)
        return partials

    def _collect(
        self,
        names: Mapping[bytes, str],
        block: P.Block,
        layer: int,
        handle: Handler,
        local_compute: float,
        widths: Mapping[bytes, int] | None = None,
    ) -> tuple[list[np.ndarray], dict[bytes, dict[str, Any]]]:
        """Every worker's partial for the block just sent, in the order of `names`, and the
        step figures any of them reported."""
        waiting = dict(names)
        slowest = local_compute
        partials: dict[bytes, np.ndarray] = {}
        figures: dict[bytes, dict[str, Any]] = {}
        deadline = time.monotonic() + STEP_TIMEOUT
        spin = self.spin  # partials are due within a step: spin after each arrival, else sleep
        while waiting:
            msg = self.recv(50, spin)
            spin = self.spin if msg is not None else 0.0
            if msg is None:
                self._check_silence(waiting)
                if time.monotonic() > deadline:
                    raise ClusterError(f"no partials within {STEP_TIMEOUT:.0f} s")
                continue
            identity, message, tensors = msg
            partial = self._arrived(
                identity, message, tensors, names, waiting, block, layer, handle, widths
            )
            if partial is not None:
                partials[identity] = partial
                assert isinstance(message, M.Partial)
                if message.figures is not None:
                    figures[identity] = message.figures
                slowest = max(slowest, message.compute)
                if widths is None:
                    hop_s = time.perf_counter() - self._sent_at - message.compute
                    self._hops(identity).append(hop_s)
        if names and widths is None:  # a sum's (the head's logits are not summed)
            self.allreduce_seconds.append(time.perf_counter() - self._sent_at - slowest)
            self.sums += 1
        return [partials[identity] for identity in names], figures

    def _arrived(
        self,
        identity: bytes,
        message: Received,
        tensors: list[np.ndarray],
        names: Mapping[bytes, str],
        waiting: dict[bytes, str],
        block: P.Block,
        layer: int,
        handle: Handler,
        widths: Mapping[bytes, int] | None = None,
    ) -> np.ndarray | None:
        """A message that came while partials were due: a partial for this block from a node
        still `waiting` (taken off it); None for anything else, which is handled (or raised: a
        node that failed or sent nonsense). A partial has the shape of what was sent, or (rows
        sent, the node's `widths`) for a HEAD."""
        if isinstance(message, M.Partial):
            key = (message.step, message.layer, message.block)
            if key != (self._step, layer, block) or identity not in waiting:
                return None  # left over from a failed step
            shape = self._sent_shape
            if widths is not None:
                shape = (*shape[:-1], widths[identity])
            if len(tensors) != 1 or tensors[0].shape != shape:
                got = [t.shape for t in tensors]
                raise NodeDown(
                    identity, f"node {waiting[identity]} sent a malformed partial ({got})"
                )
            del waiting[identity]
            return tensors[0]
        if isinstance(message, Malformed) and identity in waiting:
            raise NodeDown(identity, f"node {names[identity]} sent {message.why}")
        if isinstance(message, M.Error) and identity in names:
            raise NodeDown(identity, f"node {names[identity]} failed: {message.message}")
        handle(identity, message)
        return None

    # -- the star allreduce of a whole decode step, natively (node/hop.py) ------------------
    def decode_layers(
        self,
        blocks: NativeBlocks,
        names: Mapping[bytes, str],
        h: np.ndarray,
        handle: Handler,
        post_norms: np.ndarray | None = None,
        eps: float = 0.0,
        attention_alone: bool = False,
    ) -> tuple[np.ndarray, dict[bytes, dict[str, Any]], float]:
        """Every layer of a decode step: each block's STEP to every worker, this process's
        partial, the workers' partials gathered and summed into the residual stream, with no
        Python between messages; what the native loop does not take comes here as in `gather`.
        The new hidden state, the step figures any worker reported, and this process's compute
        seconds. `post_norms`: each block's sum normed before the residual (`HubHop`);
        `attention_alone`: the workers hold no attention, so only FFN blocks are summed."""
        identities = list(names)
        hop = self._hop
        if hop is None or hop.identities != identities or hop.blocks is not blocks:
            if hop is not None:
                hop.close()
            hop = self._hop = HubHop(self.sock, blocks, identities, self.one_core, post_norms, eps)
        first = None
        if self._batch is not None:
            block0: P.Block = P.FFN if attention_alone else P.ATTENTION
            step = M.Step(step=self._step, layer=0, block=block0, batch=self._batch)
            self._batch = None
            first = M.encode(step, (M.for_the_wire(h, self.wire),))[0]
        hop.begin(self._step, h, first, attention_alone, self.wire == "float16")
        self._sent_shape = tuple(h.shape)
        figures: dict[bytes, dict[str, Any]] = {}
        deadline, at = time.monotonic() + STEP_TIMEOUT, (0, 0)
        while True:
            status = hop.run(50)
            if status == hop_codes.DONE:
                break
            state = hop.state
            layer = int(state.layer)
            block: P.Block = P.FFN if state.ffn else P.ATTENTION
            waiting = {i: n for k, (i, n) in enumerate(names.items()) if not hop.received[k]}
            if (state.layer, state.ffn) != at:  # a block further on: its own deadline
                deadline, at = time.monotonic() + STEP_TIMEOUT, (state.layer, state.ffn)
            if status == hop_codes.SEND_FAILED:
                identity = identities[state.failed]
                raise NodeDown(identity, f"node {names[identity]} is unreachable")
            if status == hop_codes.ERROR:
                raise ClusterError(f"the cluster socket failed: {zmq.strerror(zmq.zmq_errno())}")
            if status == hop_codes.TIMEOUT:
                self._check_silence(waiting)
                if time.monotonic() > deadline:
                    raise ClusterError(f"no partials within {STEP_TIMEOUT:.0f} s")
                continue
            frames, peer = hop.message()  # FOREIGN
            if not frames:
                continue  # more frames than any message: nobody's partial
            identity, message, tensors = _decoded(frames[0], frames[1:], peer)
            partial = self._arrived(
                identity, message, tensors, names, waiting, block, layer, handle
            )
            if partial is not None:
                assert isinstance(message, M.Partial)
                k = identities.index(identity)
                hop.partials[k] = partial
                hop.received[k] = 1
                hop.hops[2 * layer + int(state.ffn), k] = (
                    time.perf_counter() - state.sent_at - message.compute
                )
                state.slowest = max(state.slowest, message.compute)
                if message.figures is not None:
                    figures[identity] = message.figures
        summed = slice(1, None, 2) if attention_alone else slice(None)  # blocks with messages
        self.allreduce_seconds.extend(hop.allreduce[summed].tolist())
        self.sums += len(hop.allreduce[summed])
        for k, identity in enumerate(identities):
            self._hops(identity).extend(hop.hops[summed, k].tolist())
        return hop.h, figures, float(hop.state.own_compute_s)

    def _hops(self, identity: bytes) -> deque[float]:
        return self.hop_seconds.setdefault(identity, deque(maxlen=HOPS_KEPT))

    def _check_silence(self, waiting: Mapping[bytes, str]) -> None:
        """NodeDown for a node whose partial is due and whose heartbeats stopped."""
        for identity, name in waiting.items():
            silence = self.heartbeat.silence(name)
            if silence > DEAD_AFTER:
                raise NodeDown(
                    identity,
                    f"node {name} stopped answering mid-step (no heartbeat for {silence:.1f} s)",
                )

    def close(self) -> None:
        """Close the sockets (after whatever BYEs the caller sent); safe to call twice."""
        if self.sock.closed:
            return
        if self._hop is not None:
            self._hop.close()
        self.heartbeat.close()
        self.sock.disable_monitor()
        self.sock.close(linger=1000)  # let the BYEs leave before the socket goes
        self.auth.stop()
        self.context.term()


def _decoded(identity: bytes, frames: list[Any], peer: str) -> tuple[bytes, Received, list]:
    """A received message as (identity, message, tensors); one that does not decode comes as
    `Malformed`, so that its sender is dropped. A HELLO gets the address it came from as its
    peer_address (for the cluster view)."""
    try:
        message, tensors = M.decode_from_node(frames)
    except M.ProtocolError as exc:
        return identity, Malformed(str(exc)), []  # its reader logs it
    if isinstance(message, M.Hello):
        message = msgspec.structs.replace(message, peer_address=peer)
    return identity, message, tensors
