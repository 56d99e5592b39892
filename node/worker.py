"""A worker node: join a master, fetch and verify its shards, then compute its slice per step.

What the device can do is node/probes.py's; the messages are node/messages.py's; a STEP's checks
and compute are node/steps.py's; a decode step's steady run of blocks goes through the native
loop (node/hop.py) where the device builds it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from edgetp.memory.figures import StreamFigures
from edgetp.memory.files import default_state_dir
from edgetp.memory.shards import ShardRef, ShardStore, file_digests
from edgetp.memory.window import (
    LayerWindow,
    ShardChanged,
    return_freed_memory,
    step_figures,
)
from edgetp.models.errors import HubUnreachable
from edgetp.models.kernels import activations, kernel_set, set_activations
from edgetp.models.layers import StepBatch
from edgetp.node import messages as M
from edgetp.node import protocol as P
from edgetp.node.executor import Hidden, SliceExecutor, check_kernels_before_loading, make_executor
from edgetp.node.heartbeat import DATA_IO, DEAD_AFTER, HeartbeatClient, node_context
from edgetp.node.hop import ERROR, FOREIGN, WorkerHop
from edgetp.node.hop import available as hop_available
from edgetp.node.messages import Capacity
from edgetp.node.probes import measure_speed
from edgetp.node.security import JoinToken, fingerprint, save_node_token, secure_client
from edgetp.node.steps import Work, partial, read_serving

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 30.0  # s to wait for the master's answer to HELLO
FETCH_WINDOW = 8  # chunk requests in flight


class NodeError(Exception):
    """Why a node stopped, in words for the person who started it."""


@dataclass
class Held:
    """The slice a serving node holds: its executor, the native loop over it (None where the
    device has none), the loader's totals at its last report, and the current step's batch."""

    executor: SliceExecutor
    hop: WorkerHop | None
    reported: StreamFigures = field(default_factory=StreamFigures)
    batch: StepBatch | None = None
    closed: bool = False

    def close(self) -> None:
        """Its weights and KV cache go (a re-plan, a standby, the end); safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if self.hop is not None:
            self.hop.close()
        self.executor.close()


class Worker:
    """A node's life: join the master, fetch and load the slice it plans for this device, and
    serve that slice's blocks until the master says BYE."""

    def __init__(
        self,
        master: str,
        capacity: Capacity,
        state_dir: Path | None = None,
        name: str | None = None,
        model: str | None = None,
        progress: Callable[[int, int], None] | None = None,
        token: JoinToken | None = None,
        drop_cache: bool = False,
    ) -> None:
        self.endpoint = f"tcp://{master}"
        self.spin = P.spin_seconds()
        self.drop_cache = drop_cache
        self.token = token
        self.state_dir = state_dir or default_state_dir()
        self.host = master.rsplit(":", 1)[0]
        self.capacity = capacity
        self.store = ShardStore(self.state_dir / "shards")
        self.name = name or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.model = model
        self.progress = progress
        self.context = node_context()  # the heartbeats on an I/O thread of their own
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.AFFINITY, DATA_IO)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, self.name.encode())
        if token:
            secure_client(self.sock, token)
        # Until the master answers, watch the handshake: a refused token shows up only here.
        self._handshake_events: zmq.Socket | None = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        self.heartbeat: HeartbeatClient | None = None
        self.fetched_bytes = 0
        self.refs: list[ShardRef] = []  # this node's shards, layer by layer, as planned
        self.resumed_bytes = 0
        self._fetch_total = 0

    # -- plumbing ---------------------------------------------------------------------------
    def _send(self, message: M.FromNode, tensors: Sequence[Hidden] = ()) -> None:
        self.sock.send_multipart(M.encode(message, tensors), copy=False)

    def _fail(self, exc: BaseException) -> None:
        """Tell the master why this node stops (it may be waiting for a partial or READY)."""
        self._send(M.Error(message=f"{type(exc).__name__}: {exc}"))

    def _decode(self, frames: list[Any], doing: str) -> tuple[M.FromMaster, list[np.ndarray]]:
        """The master's message and its tensors; NodeError (after telling the master) for one
        that does not follow the protocol, outside serving, where nothing can go on without it."""
        try:
            return M.decode_from_master(frames)
        except M.ProtocolError as exc:
            self._send(M.Error(message=f"malformed message: {exc}"))
            raise NodeError(f"the master sent a malformed message while {doing}: {exc}") from exc

    def _recv(self, timeout: float, waiting_for: str) -> list[Any]:
        """The next message's frames; fails if the master goes silent or `timeout` passes."""
        deadline = time.monotonic() + timeout
        spin = self.spin  # only right after the last message: an idle node sleeps
        while True:
            if P.wait_readable(self.sock, 100, spin):
                return self.sock.recv_multipart(copy=False)
            spin = 0.0
            self._check_handshake()
            if self.heartbeat and self.heartbeat.master_silence() > DEAD_AFTER:
                raise NodeError(
                    f"the master at {self.endpoint} stopped answering while {waiting_for} "
                    f"(no heartbeat for {self.heartbeat.master_silence():.1f} s)"
                )
            if time.monotonic() > deadline:
                raise NodeError(f"no answer from the master at {self.endpoint} while {waiting_for}")

    def _stop_watching_handshake(self) -> None:
        """Once the master answered (or the node stops): the handshake's events say no more."""
        if self._handshake_events is not None:
            self.sock.disable_monitor()
            self._handshake_events.close(0)
            self._handshake_events = None

    def _check_handshake(self) -> None:
        if self._handshake_events is None or not self._handshake_events.poll(0):
            return
        event = recv_monitor_message(self._handshake_events)["event"]
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = (
                "the master refused this node's join token (wrong, or rotated with "
                "--new-token): use the token the master prints now"
            )
        elif self.token is None:
            why = "the master requires a join token: run edgetp join HOST --token TOKEN"
        else:
            why = (
                f"the secure handshake with {self.endpoint} failed: the token names master key "
                f"{fingerprint(self.token.master_public)}, which is not this master's"
            )
        raise NodeError(why)

    # -- lifecycle --------------------------------------------------------------------------
    def run(self) -> bool:
        """Join, sync shards, then serve steps until the master says BYE. True when the master
        dropped this node from its plan and asks it to join again (`edgetp join` does)."""
        self.sock.connect(self.endpoint)
        try:
            plan = self._join()
            if isinstance(plan, M.Bye):  # on standby until the master stopped
                log.info("master said bye: %s", plan.reason)
                return bool(plan.rejoin)
            return self._serve(self._take_plan(plan))
        except KeyboardInterrupt:  # stopped by its owner: tell the master, which re-plans
            self._send(M.Leave())
            log.info("node %s leaving", self.name)
            return False
        finally:
            if self.heartbeat:
                self.heartbeat.close()
            self._stop_watching_handshake()
            self.sock.close(0)
            self.context.term()

    def _join(self) -> M.Welcome | M.Bye:
        """Join: the master's WELCOME, or its BYE to a node it left on standby."""
        hello = M.Hello(P.PROTOCOL_VERSION, self.name, self.capacity, self.model)
        self._send(hello)
        answer, _ = self._decode(self._recv(HANDSHAKE_TIMEOUT, "joining"), "joining")
        if isinstance(answer, M.Refuse):
            raise NodeError(f"the master refused this node: {answer.reason}")
        if not isinstance(answer, M.Accepted):
            raise NodeError(f"unexpected answer to HELLO: {answer}")
        self._stop_watching_handshake()
        if self.token:
            save_node_token(self.state_dir, self.token)
        self.heartbeat = HeartbeatClient(
            self.context, f"tcp://{self.host}:{answer.heartbeat_port}", self.name, self.token
        )
        plan, on_standby = self._await_plan()
        if isinstance(plan, M.Bye):
            if on_standby:  # the master stopped (or dropped it) while it waited: no failure
                return plan
            if plan.rejoin is not None:  # dropped, not shutting down
                raise NodeError(f"the master said: {plan.reason}")
            raise NodeError(f"the master stopped before giving this node a slice: {plan.reason}")
        return plan

    def _await_plan(self) -> tuple[M.Welcome | M.Bye, bool]:
        """The master's next WELCOME or BYE past its probes (answered meanwhile) and STANDBY
        (said in the log); and whether a STANDBY came. The master plans (and may split a big
        model) before it says which slice is ours; however long that takes, or this node stays
        on standby, its heartbeat says it is alive."""
        on_standby = False
        while True:
            frames = self._recv(float("inf"), "waiting for the master's plan")
            message, tensors = self._decode(frames, "waiting for the master's plan")
            if isinstance(message, M.Welcome | M.Bye):
                return message, on_standby
            if isinstance(message, M.Standby):
                log.warning("node %s is on standby: %s", self.name, message.reason)
                on_standby = True
            elif isinstance(message, M.Measure | M.Echo | M.Split):
                self._answer(message, tensors)
            else:
                raise NodeError(f"unexpected message before WELCOME: {message}")

    def _answer(self, probe: M.Measure | M.Echo | M.Split, tensors: list[np.ndarray]) -> None:
        """Answer what the master asks before it plans, joining or serving: MEASURE with this
        device's speed now (every other node measures its own at the same moment), ECHO with
        its tensor back at once, SPLIT with its own share split from the model's file."""
        if isinstance(probe, M.Measure):
            self._send(M.Measured(speed=measure_speed(self.capacity.cores)))
        elif isinstance(probe, M.Split):
            self._split(probe)
        else:
            self._send(M.Echoed(), tensors)

    def _split(self, job: M.Split) -> None:
        """Split this node's share from the model's files on the hub, fetching by byte ranges
        only the rows and columns its slices hold (into a sparse mirror kept for a re-plan),
        and say what it wrote (SPLIT-DONE), or why it could not (ERROR)."""
        from edgetp.memory.splitter import split_node
        from edgetp.models.ranges import Remote, RemoteFile, RemoteModel
        from edgetp.models.source import open_remote

        m = job.model
        model = RemoteModel(
            {n: Remote(f.url, f.size, f.etag, dict(f.headers)) for n, f in m.files.items()}, m.small
        )
        remotes: list[RemoteFile] = []
        try:
            source, remotes = open_remote(model, self.state_dir / "remote" / model.key())
            heads = [(a, b) for a, b in job.head_rows] or None
            share = split_node(source, job.slices, job.node, self.store, job.dtype, heads)
        except HubUnreachable as exc:  # the master may reach it: it splits this share then
            log.warning("node %s cannot reach the hub: %s", self.name, exc)
            self._send(M.SplitDone([], unreachable=str(exc)))
            return
        except Exception as exc:  # the master waits for SPLIT-DONE: tell it why not
            log.warning("node %s could not split its share: %s", self.name, exc)
            self._send(M.Error(message=f"splitting its share of the model: {exc}"))
            return
        fetched = sum(r.fetched for r in remotes)
        requests = sum(r.requests for r in remotes)
        log.info("node %s split its share: %d bytes of the model's files in %d requests",
                 self.name, fetched, requests)  # fmt: skip
        self._send(M.SplitDone(share.layers, share.extra, fetched, requests))

    def _take_plan(self, welcome: M.Welcome) -> Held:
        """A plan's slice loaded and READY said (or ERROR, and the failure raised), with the
        native loop over it."""
        before = self.fetched_bytes
        try:
            executor = self._load(welcome)
        except Exception as exc:  # tell the master, which is waiting for READY
            self._fail(exc)
            raise
        self._send(M.Ready(fetched=self.fetched_bytes - before))
        log.info("node %s ready: slice %s", self.name, executor.slice)
        return Held(executor, _native_loop(self.sock, executor))

    def _load(self, welcome: M.Welcome) -> SliceExecutor:
        config, s, refs = welcome.config, welcome.slice, welcome.shards
        self.refs = refs
        head_ref = [welcome.head.shard] if welcome.head else []
        wanted = refs + head_ref
        held = list(zip(wanted, [self.store.checksum(r) for r in wanted], strict=True))
        self._fetch_total = sum(r.size for r, checksum in held if checksum is None)
        verified = [self._fetch(r) if checksum is None else checksum for r, checksum in held]
        verified = verified[: len(refs)]
        factors = welcome.rope_freq_factors
        freq = torch.tensor(factors) if factors else None
        paths = [self.store.path(r) for r in refs]
        window = welcome.window or config.n_layers
        rows = welcome.head.rows[1] - welcome.head.rows[0] if welcome.head else 0
        head = (self.store.path(welcome.head.shard), "lm_head", rows) if welcome.head else None
        set_activations(welcome.activations)
        check_kernels_before_loading(paths, window, head, config.n_stacked)
        weights = LayerWindow(paths, window, self.drop_cache, verified, config.n_stacked)
        executor = make_executor(
            config, s, weights, welcome.context, welcome.slots, freq, welcome.kv_format
        )
        try:
            if welcome.head:
                executor.hold_head(self.store.load(welcome.head.shard), welcome.head.rows)
            executor.admit_native()
        except Exception:
            executor.close()
            raise
        return executor

    def _fetch(self, ref: ShardRef) -> int:
        """Fetch one shard in chunks into a .part file, resuming one left by an earlier run;
        its xxh3 once verified."""
        part = self.store.partial_path(ref)
        offset = part.stat().st_size if part.exists() else 0
        if offset > ref.size:
            part.unlink()
            offset = 0
        self.resumed_bytes += offset
        pending: deque[int] = deque()
        next_offset = offset
        with open(part, "ab") as f:
            while offset < ref.size:
                while next_offset < ref.size and len(pending) < FETCH_WINDOW:
                    size = min(P.CHUNK_SIZE, ref.size - next_offset)
                    self._send(M.Fetch(sha256=ref.sha256, offset=next_offset, size=size))
                    pending.append(next_offset)
                    next_offset += size
                frames = self._recv(30.0, f"fetching shard {ref.filename}")
                message, _ = self._decode(frames, f"fetching shard {ref.filename}")
                if isinstance(message, M.Error):  # no such shard on the master
                    raise NodeError(f"the master could not send {ref.filename}: {message.message}")
                if not isinstance(message, M.Chunk) or message.offset != pending[0]:
                    raise NodeError(f"unexpected message while fetching {ref.filename}: {message}")
                pending.popleft()
                data = frames[1].buffer if len(frames) == 2 else b""
                f.write(data)
                offset += len(data)
                self.fetched_bytes += len(data)
                if self.progress:
                    self.progress(self.fetched_bytes, self._fetch_total)
        sha256, checksum = file_digests(part)
        if sha256 != ref.sha256:
            part.unlink()
            raise NodeError(f"shard {ref.filename} arrived corrupt (sha256 mismatch); run again")
        os.replace(part, self.store.path(ref))
        self.store.record(ref, checksum)
        return checksum

    # -- serving ----------------------------------------------------------------------------
    def _serve(self, held: Held) -> bool:
        """Compute partials until the master says BYE; True when it asks this node to join
        again (it was dropped from the plan)."""
        try:
            while True:
                frames = self._next_work(held.hop, held.executor)
                executor = held.executor
                try:
                    message, tensors, work = read_serving(
                        frames, executor.config, executor.cache, held.batch
                    )
                except M.ProtocolError as exc:
                    # Only the master (its key) can send here, so this is a bug or a mismatched
                    # version, never a reason to stop: log it, and answer what the master may be
                    # waiting for, so that it drops this node rather than wait for a partial.
                    log.warning("ignored a malformed message from the master: %s", exc)
                    if M.op_of(frames) in ("step", "welcome"):
                        self._send(M.Error(message=f"malformed message: {exc}"))
                    continue
                if work is not None:
                    self._compute(held, work)
                elif isinstance(message, M.Measure | M.Echo | M.Split):  # a re-plan comes
                    self._answer(message, tensors)
                elif isinstance(message, M.Welcome):  # a re-plan: a new slice, maybe new shards
                    held.close()
                    held = self._take_plan(message)
                elif isinstance(message, M.Standby):  # a re-plan left this node out
                    held.close()
                    plan = self._stand_by(message.reason)
                    if isinstance(plan, M.Bye):
                        return self._bye(plan)
                    held = self._take_plan(plan)
                elif isinstance(message, M.Bye):
                    return self._bye(message)
        finally:
            held.close()

    def _stand_by(self, reason: str) -> M.Welcome | M.Bye:
        """Wait, its slice freed, for a later plan's WELCOME (or the master's BYE)."""
        return_freed_memory()  # its weights and KV cache went: give the memory back
        log.warning("node %s is on standby: %s", self.name, reason)
        return self._await_plan()[0]

    @staticmethod
    def _bye(bye: M.Bye) -> bool:
        """Whether to join again, after a BYE while serving or on standby."""
        if bye.rejoin is False:  # dropped for good: say why, as an error
            raise NodeError(f"the master said: {bye.reason}")
        log.info("master said bye: %s", bye.reason)
        return bool(bye.rejoin)

    def _compute(self, held: Held, work: Work) -> None:
        """One block's partial (a shard that changed on disk fetched again first), sent with its
        compute time, and after a step's last block the loader's figures."""
        executor = held.executor
        held.batch = work.batch
        try:
            if work.begins:
                executor.begin_step(work.batch)
                if held.hop is not None:  # the step's other blocks go natively, or none
                    held.hop.begin_step(work.batch.size if executor.native_step else 0)
            started = time.perf_counter()
            try:
                result = partial(executor, work)
            except ShardChanged as changed:  # nothing computed yet: fetch it, go on
                self._fetch_again(changed)
                assert isinstance(executor.weights, LayerWindow)  # only a window reads files
                executor.weights.retry(work.layer)
                result = partial(executor, work)
        except Exception as exc:  # report, then stop: the master fails the request
            self._fail(exc)
            raise
        compute = time.perf_counter() - started
        reply = M.Partial(step=work.step, layer=work.layer, block=work.block, compute=compute)
        if work.block == P.FFN and work.layer == executor.config.n_layers - 1:
            figures = step_figures(executor.weights, held.reported)
            figures |= executor.sequence_figures | {
                "kernels": kernel_set(),
                "activations": activations(),
            }
            reply = msgspec.structs.replace(reply, figures=figures)
            held.reported = replace(executor.weights.figures)
        self._send(reply, (M.for_the_wire(result, work.wire),))

    def _next_work(self, hop: WorkerHop | None, executor: SliceExecutor) -> list[Any]:
        """The next message for the Python path: after the native loop has served the decode
        blocks it takes (node/hop.py), or straight from the socket."""
        if hop is None or hop.state.B == 0:
            return self._recv(float("inf"), "waiting for work")
        try:
            while True:
                status = hop.serve(100)
                if status == FOREIGN:
                    return hop.frames()
                if status == ERROR:
                    raise NodeError(
                        f"the link to the master at {self.endpoint} failed: "
                        f"{zmq.strerror(zmq.zmq_errno())}"
                    )
                self._check_handshake()  # TIMEOUT: no message for 100 ms
                if self.heartbeat and self.heartbeat.master_silence() > DEAD_AFTER:
                    raise NodeError(
                        f"the master at {self.endpoint} stopped answering while waiting for "
                        f"work (no heartbeat for {self.heartbeat.master_silence():.1f} s)"
                    )
        finally:
            executor.weights.figures.compute_s += hop.take_compute()

    def _fetch_again(self, changed: ShardChanged) -> None:
        """A shard that changed on this device's disk since it was verified (rot, or a process
        writing there): fetch it from the master again, mid-step (the master serves fetches
        while it waits for partials)."""
        ref = self.refs[changed.layer]
        started, before = time.perf_counter(), self.fetched_bytes
        log.warning("%s; fetching it from the master again", changed)
        try:
            self._fetch(ref)
        except NodeError as exc:  # the master's copy is no better (one disk, in a local cluster)
            raise NodeError(f"{changed}; fetching it again failed: {exc}") from exc
        log.warning(
            "shard %s fetched again (%d bytes in %.2f s); the step goes on",
            ref.filename,
            self.fetched_bytes - before,
            time.perf_counter() - started,
        )


def _native_loop(sock: zmq.Socket, executor: SliceExecutor) -> WorkerHop | None:
    """The native per-sum loop for a slice with native blocks, where this device runs it."""
    if executor.native is None or not hop_available():
        return None
    return WorkerHop(sock, executor.native)
