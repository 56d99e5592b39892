"""A worker node: join a master, fetch and verify its shards, then compute its slice per step."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import statistics
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from memory.budget import device_memory_budget
from memory.files import default_state_dir, measure_disk_read
from memory.pages import weight_buffer
from memory.shards import ShardRef, ShardStore, file_digests
from memory.window import (
    LayerWindow,
    ShardChanged,
    StreamFigures,
    return_freed_memory,
    step_figures,
)
from models.config import ModelConfig
from models.kernels import compute_clock, cpu_quota_cores, kernel_set, linear
from models.layers import Slice, StepBatch
from node import protocol as P
from node.executor import Hidden, SliceExecutor, check_kernels_before_loading, make_executor
from node.heartbeat import DEAD_AFTER, HeartbeatClient
from node.hop import ERROR, FOREIGN, WorkerHop
from node.hop import available as hop_available
from node.kvcache import KVCache
from node.security import (
    JoinToken,
    Keypair,
    fingerprint,
    save_node_token,
    secure_client,
    secure_server,
)

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 30.0  # s to wait for the master's answer to HELLO
FETCH_WINDOW = 8  # chunk requests in flight


class NodeError(Exception):
    """Why a node stopped, in words for the person who started it."""


@dataclass(frozen=True)
class Capacity:
    memory_budget: int  # bytes
    cores: int
    speed: float  # measured matrix-vector throughput, GB/s of weights
    window: int | None = None  # layers to keep in memory, when forced with --window
    disk: float | None = None  # GB/s read from its disk, measured where it may stream
    message_s: float = 0.0  # its time to send or to receive one message (measure_message_cost)

    def score(self) -> float:
        """What the plan divides work by."""
        return max(self.speed, 1e-3)


PROBE_WIDTH = 1024  # the probe matrix's columns
PROBE_MIN_BYTES = 16 << 20
PROBE_MAX_BYTES = 256 << 20  # a server's L3 can pass 100 MB: the probe is a start-up cost
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def _probe_bytes() -> int:
    """Twice the largest cache of this CPU, within PROBE_MIN_BYTES and PROBE_MAX_BYTES."""
    largest = 0
    for size in CPU_CACHES.glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):  # sysfs prints sizes as "32768K"
            largest = max(largest, int(size.read_text().strip().removesuffix("K")) << 10)
    return min(PROBE_MAX_BYTES, max(PROBE_MIN_BYTES, 2 * largest))


def measure_capacity(
    threads: int,
    memory_budget: int | None = None,
    window: int | None = None,
    disk_dir: Path | None = None,
    speed: float | None = None,
) -> Capacity:
    """What this device can do: its speed (`measure_speed`, unless given), its memory budget,
    what a message costs it, and, when a window or a memory limit may make it stream its slice
    from `disk_dir`, how fast it reads that disk."""
    speed = measure_speed(threads) if speed is None else speed
    limited = memory_budget is not None or window is not None
    if memory_budget is None:
        under_limit = device_memory_budget()  # 0 where the limit leaves nothing: refused
        limited = limited or under_limit is not None
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory_budget = physical if under_limit is None else under_limit
    disk = measure_disk_read(disk_dir) if limited and disk_dir is not None else None
    disk = None if disk is None else round(disk, 3)
    message_s = round(measure_message_cost(), 7)
    return Capacity(int(memory_budget), threads, speed, window, disk, message_s)


PROBE_ROUNDS = 5  # a speed probe's runs, of PROBE_SECONDS each: it gives their median
PROBE_SECONDS = 0.05


def measure_speed(
    threads: int, rounds: int = PROBE_ROUNDS, seconds: float = PROBE_SECONDS
) -> float:
    """A quick (~0.25 s) measurement of how fast this device streams weights through a matmul,
    GB/s: the median of `rounds` runs of `seconds`.

    The matrix is twice the largest CPU cache: a decode step streams its weights from memory,
    and a matrix that fits in a cache shared with other cores measures what they do with it (a
    16 MB one moved 2x between starts on a 2-core VM). Under a CPU quota the loop is timed in
    CPU seconds and scaled by the quota: wall time there measures where in the quota's period
    the loop ran and who else ran on the core, not the device. What it reads still moves with
    its host's memory traffic (two processes probing at once on a 2-core VM: 11-17 GB/s over
    eight probes, yet within 10% of each other at each): the master has every node measure
    again at the same moment before it plans (MEASURE). Even so, two identical cpu=0.5 devices
    measured up to 1.35x apart in one 0.1 s run (their ratio's standard deviation 0.09-0.11
    over 40 pairs), and a plan made on such a pair is kept for as long as no other would be
    1.5x faster: the median of five runs of 0.05 s, 0.05-0.07 and 1.16x at the furthest
    (`docs/bench/probe_pairs.py`, docs/bench/probe-pairs-cpu0.5.txt).
    """
    rows = _probe_bytes() // (4 * PROBE_WIDTH)
    # In the pages weights live in (memory.pages): the probe reads memory as a decode step does.
    w = weight_buffer(rows * PROBE_WIDTH * 4).view(torch.float32).view(rows, PROBE_WIDTH)
    w.fill_(0.5)
    x = torch.randn(1, PROBE_WIDTH)
    linear(x, w)
    quota = cpu_quota_cores()
    clock = compute_clock(threads)
    speeds = []
    for _ in range(rounds):
        wall_start, start, n = time.perf_counter(), clock(), 0
        while time.perf_counter() - wall_start < seconds:
            linear(x, w)
            n += 1
        speeds.append(n * w.numel() * 4 / (clock() - start) / 1e9)
    speed = statistics.median(speeds)
    if quota is not None:
        speed *= min(quota, threads)
    return round(speed, 2)


PROBE_PAYLOAD = 4096  # bytes a probe message carries: a hidden state of 1024 floats
PROBE_ROUND_TRIPS = 300
PROBE_TIMEOUT_MS = 5000  # a probe message not through by then: no figure, not a hang


def measure_message_cost() -> float:
    """This device's time to send or to receive one message of a sum: the CPU a ZeroMQ
    message costs its two threads (the caller's and the I/O thread's), over CURVE as the
    cluster's links are, over its cores' share under a CPU quota.

    A round trip between a ROUTER and a DEALER of one context, over TCP on the loopback, is
    four such messages (two sends, two receives), all on this device. On emulated cpu=0.5
    devices this is what a node's share of the sums costs it, next to its weights: the master
    handles every worker's messages of every sum, a worker one exchange (master.plan
    `with_messages`). Taken in CPU seconds: wall time would count the link and the quota's
    throttled periods. Free, it counts both threads as if on one core: a bound, where the I/O
    thread has a core of its own. Python's calls around each message count too (a few us of
    the ~40 measured here; a decode step's messages go through C)."""
    context = zmq.Context()  # its own I/O thread, as a node has
    context.setsockopt(zmq.RCVTIMEO, PROBE_TIMEOUT_MS)
    context.setsockopt(zmq.SNDTIMEO, PROBE_TIMEOUT_MS)
    try:
        server, client = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
        keys = Keypair(*zmq.curve_keypair())
        secure_server(server, keys)
        client.curve_serverkey = keys.public
        client.curve_publickey, client.curve_secretkey = zmq.curve_keypair()
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")
        payload = bytes(PROBE_PAYLOAD)

        def round_trip() -> None:
            client.send_multipart([b"probe", payload])
            server.send_multipart(server.recv_multipart())
            client.recv_multipart()

        for _ in range(20):  # the CURVE handshake and the first buffers
            round_trip()
        start = time.process_time()
        for _ in range(PROBE_ROUND_TRIPS):
            round_trip()
        cpu = time.process_time() - start
    except zmq.ZMQError as exc:  # no loopback, say: the plan then counts no messages for it
        log.warning("could not measure what a message costs this device (%s)", exc)
        return 0.0
    finally:
        context.destroy(linger=0)
    quota = cpu_quota_cores()
    return cpu / PROBE_ROUND_TRIPS / 4 / (min(quota, 1.0) if quota is not None else 1.0)


class Worker:
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
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, self.name.encode())
        if token:
            secure_client(self.sock, token)
        # Until the master answers, watch the handshake: a refused token shows up only here.
        self._handshake_events = self.sock.get_monitor_socket(
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
    def _send(self, header: dict[str, Any], tensors: tuple[torch.Tensor, ...] = ()) -> None:
        self.sock.send_multipart(P.encode(header, tensors), copy=False)

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
            welcome = self._handshake()
            if welcome["op"] == P.BYE:  # on standby until the master stopped
                log.info("master said bye: %s", welcome.get("reason", ""))
                return bool(welcome.get("rejoin"))
            try:
                executor = self._load(read_welcome(welcome))
            except Exception as exc:  # tell the master, which is waiting for READY
                self._send({"op": P.ERROR, "message": f"{type(exc).__name__}: {exc}"})
                raise
            self._send({"op": P.READY, "fetched": self.fetched_bytes})
            log.info("node %s ready: slice %s", self.name, executor.slice)
            return self._serve(executor)
        except KeyboardInterrupt:  # stopped by its owner: tell the master, which re-plans
            self._send({"op": P.LEAVE})
            log.info("node %s leaving", self.name)
            return False
        finally:
            if self.heartbeat:
                self.heartbeat.close()
            if self._handshake_events is not None:
                self.sock.disable_monitor()
                self._handshake_events.close(0)
            self.sock.close(0)
            self.context.term()

    def _handshake(self) -> dict[str, Any]:
        """Join: the master's WELCOME, or its BYE to a node it left on standby."""
        self._send(
            {
                "op": P.HELLO,
                "version": P.PROTOCOL_VERSION,
                "name": self.name,
                "capacity": asdict(self.capacity),
                "model": self.model,
            }
        )
        header, _ = P.decode(self._recv(HANDSHAKE_TIMEOUT, "joining"))
        if header["op"] == P.REFUSE:
            raise NodeError(f"the master refused this node: {header['reason']}")
        if header["op"] != P.ACCEPTED:
            raise NodeError(f"unexpected answer to HELLO: {header['op']!r}")
        self.sock.disable_monitor()
        self._handshake_events.close(0)
        self._handshake_events = None
        if self.token:
            save_node_token(self.state_dir, self.token)
        self.heartbeat = HeartbeatClient(
            self.context, f"tcp://{self.host}:{header['heartbeat_port']}", self.name, self.token
        )
        header, on_standby = self._await_plan()
        if header["op"] == P.BYE:
            if on_standby:  # the master stopped (or dropped it) while it waited: no failure
                return header
            if "rejoin" in header:  # dropped, not shutting down
                raise NodeError(f"the master said: {header.get('reason')}")
            raise NodeError(
                f"the master stopped before giving this node a slice: {header['reason']}"
            )
        if header["op"] != P.WELCOME:
            raise NodeError(f"unexpected message before WELCOME: {header['op']!r}")
        return header

    def _await_plan(self) -> tuple[dict[str, Any], bool]:
        """The master's next message past its probes (answered meanwhile) and STANDBY (said
        in the log): a WELCOME, or anything else for the caller to refuse; and whether a
        STANDBY came. The master plans (and may split a big model) before it says which slice
        is ours; however long that takes, or this node stays on standby, its heartbeat says it
        is alive."""
        on_standby = False
        while True:
            header, tensors = P.decode(self._recv(float("inf"), "waiting for the master's plan"))
            if header["op"] == P.STANDBY:
                log.warning("node %s is on standby: %s", self.name, header.get("reason"))
                on_standby = True
                continue
            try:
                probe = read_probe(header, tensors)
            except P.ProtocolError as exc:
                raise NodeError(f"the master sent a malformed message: {exc}") from exc
            if probe is None:
                return header, on_standby
            self._answer(probe)

    def _answer(self, probe: Measure | Echo) -> None:
        """Answer what the master asks before it plans, joining or serving: MEASURE with this
        device's speed now (every other node measures its own at the same moment), ECHO with
        its tensor back at once."""
        if isinstance(probe, Measure):
            self._send({"op": P.MEASURED, "speed": measure_speed(self.capacity.cores)})
        else:
            self._send({"op": P.ECHOED}, (probe.payload,))

    def _load(self, welcome: Welcome) -> SliceExecutor:
        config, s, refs = welcome.config, welcome.slice, welcome.shards
        self.refs = refs
        head = [welcome.head[1]] if welcome.head else []
        held = list(zip(refs + head, [self.store.checksum(r) for r in refs + head], strict=True))
        self._fetch_total = sum(r.size for r, checksum in held if checksum is None)
        verified = [self._fetch(r) if checksum is None else checksum for r, checksum in held]
        verified = verified[: len(refs)]
        factors = welcome.rope_freq_factors
        freq = torch.tensor(factors) if factors else None
        paths = [self.store.path(r) for r in refs]
        window = welcome.window or config.n_layers
        rows = welcome.head[0][1] - welcome.head[0][0] if welcome.head else 0
        head = (self.store.path(welcome.head[1]), "lm_head", rows) if welcome.head else None
        check_kernels_before_loading(paths, window, head)
        weights = LayerWindow(paths, window, self.drop_cache, verified)
        executor = make_executor(config, s, weights, welcome.context, welcome.slots, freq)
        try:
            if welcome.head:
                executor.hold_head(self.store.load(welcome.head[1]), welcome.head[0])
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
                    self._send(
                        {"op": P.FETCH, "sha256": ref.sha256, "offset": next_offset, "size": size}
                    )
                    pending.append(next_offset)
                    next_offset += size
                frames = self._recv(30.0, f"fetching shard {ref.filename}")
                header = P.decode_header(frames[0])
                if header["op"] == P.ERROR:
                    raise NodeError(
                        f"the master could not send {ref.filename}: {header['message']}"
                    )
                if header["op"] != P.CHUNK or header.get("offset") != pending[0]:
                    raise NodeError(f"unexpected message while fetching {ref.filename}: {header}")
                pending.popleft()
                data = frames[1].buffer
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

    def _reload(self, welcome: Welcome) -> tuple[SliceExecutor, WorkerHop | None]:
        """A re-plan's slice loaded (READY said), and the native loop over it."""
        before = self.fetched_bytes
        try:
            executor = self._load(welcome)
        except Exception as exc:
            self._send({"op": P.ERROR, "message": f"{type(exc).__name__}: {exc}"})
            raise
        self._send({"op": P.READY, "fetched": self.fetched_bytes - before})
        log.info("node %s re-planned: slice %s", self.name, executor.slice)
        return executor, _native_loop(self.sock, executor)

    def _serve(self, executor: SliceExecutor) -> bool:
        """Compute partials until the master says BYE; True when it asks this node to join
        again (it was dropped from the plan)."""
        reported = StreamFigures()  # the loader's totals at the last report
        batch: StepBatch | None = None  # the step's, sent with its first block
        hop = _native_loop(self.sock, executor)
        try:
            while True:
                frames = self._next_work(hop, executor)
                try:
                    header, work = read_message(frames, executor.config, executor.cache, batch)
                except P.ProtocolError as exc:
                    # Only the master (its key) can send here, so this is a bug or a mismatched
                    # version, never a reason to stop: log it, and answer what the master may be
                    # waiting for, so that it drops this node rather than wait for a partial.
                    log.warning("ignored a malformed message from the master: %s", exc)
                    if _waits_for_answer(frames):
                        self._send({"op": P.ERROR, "message": f"malformed message: {exc}"})
                    continue
                if isinstance(work, (Measure, Echo)):  # a re-plan comes
                    self._answer(work)
                    continue
                if isinstance(work, Standby):  # a re-plan left this node out: free its slice
                    if hop is not None:
                        hop.close()
                        hop = None
                    executor.close()
                    del executor  # its weights and KV cache go while it waits
                    return_freed_memory()
                    log.warning("node %s is on standby: %s", self.name, work.reason)
                    header, _ = self._await_plan()
                    if header["op"] == P.WELCOME:
                        try:
                            welcome = read_welcome(header)
                        except P.ProtocolError as exc:  # the master waits for READY: say why
                            self._send({"op": P.ERROR, "message": f"malformed message: {exc}"})
                            raise NodeError(f"the master sent a malformed WELCOME: {exc}") from exc
                        executor, hop = self._reload(welcome)
                        reported, batch = StreamFigures(), None
                        continue
                    if header["op"] != P.BYE:
                        raise NodeError(f"unexpected message on standby: {header['op']!r}")
                    work = None
                if work is None:  # BYE
                    if header.get("rejoin") is False:  # dropped for good: say why, as an error
                        raise NodeError(f"the master said: {header.get('reason')}")
                    log.info("master said bye: %s", header.get("reason", ""))
                    return bool(header.get("rejoin"))
                if isinstance(work, Welcome):  # a re-plan: a new slice, maybe new shards
                    if hop is not None:
                        hop.close()
                    executor.close()
                    executor, hop = self._reload(work)
                    reported, batch = StreamFigures(), None
                    continue
                batch, layer, block, h = work.batch, work.layer, work.block, work.hidden
                try:
                    if "batch" in header:
                        executor.begin_step(batch)
                        if hop is not None:  # the step's other blocks go natively, or none
                            hop.begin_step(batch.size if executor.native_step else 0)
                    started = time.perf_counter()
                    try:
                        if block == P.HEAD:
                            partial = executor.logits(h)
                        else:
                            partial = self._partial(executor, block, layer, h)
                    except ShardChanged as changed:  # nothing computed yet: fetch it, go on
                        self._fetch_again(changed)
                        executor.weights.retry(layer)
                        partial = self._partial(executor, block, layer, h)
                except Exception as exc:  # report, then stop: the master fails the request
                    self._send({"op": P.ERROR, "message": f"{type(exc).__name__}: {exc}"})
                    raise
                reply = {
                    "op": P.PARTIAL,
                    "step": header["step"],
                    "layer": layer,
                    "block": block,
                    "compute": time.perf_counter() - started,
                }
                if block == P.FFN and layer == executor.config.n_layers - 1:
                    reply["figures"] = step_figures(executor.weights, reported)
                    reply["figures"]["kernels"] = kernel_set()
                    reported = replace(executor.weights.figures)
                self._send(reply, (partial,))
        finally:
            if hop is not None:
                hop.close()

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

    @staticmethod
    def _partial(executor: SliceExecutor, block: str, layer: int, h: np.ndarray) -> Hidden:
        """This node's partial of one block: a decode step's rows (B, D) stay arrays
        (`StepBatch.rows`); any other step goes to torch."""
        compute = executor.attention if block == P.ATTENTION else executor.ffn
        if executor.rows:
            return compute(layer, h)
        with torch.inference_mode():
            return compute(layer, torch.from_numpy(h.copy()))  # the message's memory is read-only


def _native_loop(sock: zmq.Socket, executor: SliceExecutor) -> WorkerHop | None:
    """The native per-sum loop for a slice with native blocks, where this device runs it."""
    if executor.native is None or not hop_available():
        return None
    return WorkerHop(sock, executor.native)


@dataclass(frozen=True)
class Welcome:
    """What a WELCOME tells a node: its slice of the model, and how to hold it."""

    config: ModelConfig
    slice: Slice
    shards: list[ShardRef]
    context: int
    slots: int
    window: int | None
    rope_freq_factors: list[float] | None
    head: tuple[tuple[int, int], ShardRef] | None = None  # its rows of the lm_head, their shard


def read_welcome(header: dict[str, Any]) -> Welcome:
    """A WELCOME's contents, or ProtocolError saying what is wrong with them."""
    try:
        config = ModelConfig.from_dict(header["config"])
        shards = [ShardRef(str(r["sha256"]), int(r["size"])) for r in header["shards"]]
        welcome = Welcome(
            config,
            Slice.from_dict(header["slice"]),
            shards,
            int(header["context"]),
            int(header["slots"]),
            None if header.get("window") is None else int(header["window"]),
            header.get("rope_freq_factors"),
            _read_head(header.get("head")),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise P.ProtocolError(f"a WELCOME without a usable plan ({exc!r})") from exc
    if len(shards) != config.n_layers or welcome.context < 1 or welcome.slots < 1:
        raise P.ProtocolError(
            f"a WELCOME with {len(shards)} shards for {config.n_layers} layers, context "
            f"{welcome.context}, {welcome.slots} slots"
        )
    return welcome


def _read_head(head: dict[str, Any] | None) -> tuple[tuple[int, int], ShardRef] | None:
    """A WELCOME's rows of the lm_head and their shard, where the plan splits the head."""
    if head is None:
        return None
    a, b = (int(v) for v in head["rows"])
    if not 0 <= a <= b:
        raise ValueError(f"lm_head rows {head['rows']!r}")
    return (a, b), ShardRef(str(head["sha256"]), int(head["size"]))


@dataclass(frozen=True)
class Step:
    """One block of one layer to compute: what a STEP tells a node."""

    batch: StepBatch  # the step's (sent with its first block)
    layer: int
    block: str
    hidden: np.ndarray  # decode (B, D), else (B, T, D)


@dataclass(frozen=True)
class Measure:
    """What a MEASURE asks: this device's speed, now (a plan follows)."""


@dataclass(frozen=True)
class Echo:
    """What an ECHO asks: its tensor back, at once."""

    payload: np.ndarray


@dataclass(frozen=True)
class Standby:
    """A STANDBY: a re-plan leaves this node out, for `reason`."""

    reason: str


def read_probe(header: dict[str, Any], tensors: list[np.ndarray]) -> Measure | Echo | None:
    """A MEASURE or an ECHO, which come whenever the master is about to plan; None for any
    other message. ProtocolError for an ECHO without exactly one tensor."""
    if header["op"] == P.MEASURE:
        return Measure()
    if header["op"] == P.ECHO:
        if len(tensors) != 1:
            raise P.ProtocolError(f"an ECHO with {len(tensors)} tensors, not one")
        return Echo(tensors[0])
    return None


def read_message(
    frames: list[Any], config: ModelConfig, cache: KVCache, batch: StepBatch | None
) -> tuple[dict[str, Any], Step | Welcome | Standby | Measure | Echo | None]:
    """What a serving node is told: a `Step` (checked against what it holds: `config`,
    `cache`, the step's `batch` so far), a `Welcome` (a re-plan), a `Standby` (a re-plan
    without it), a `Measure`, an `Echo` or None (BYE), with the header. ProtocolError for
    anything else."""
    header, tensors = P.decode(frames)
    op = header["op"]
    if op == P.STEP:
        return header, read_step(header, tensors, config, cache, batch)
    if op == P.WELCOME:
        return header, read_welcome(header)
    if (probe := read_probe(header, tensors)) is not None:
        return header, probe
    if op == P.BYE:
        return header, None
    if op == P.STANDBY:
        return header, Standby(str(header.get("reason", "")))
    raise P.ProtocolError(f"unexpected {op!r} while serving steps")


def read_step(
    header: dict[str, Any],
    tensors: list[np.ndarray],
    config: ModelConfig,
    cache: KVCache,
    batch: StepBatch | None,
) -> Step:
    """A STEP's batch (its own, or the step's so far), layer, block and hidden state, checked
    against what this node holds; ProtocolError for anything it could not compute."""
    try:
        if "batch" in header:
            batch = StepBatch.from_dict(header["batch"])
            if not all(isinstance(v, int) for v in (*batch.slots, *batch.starts, *batch.lengths)):
                raise TypeError(f"batch {header['batch']!r} is not whole numbers")
        layer, block, _ = header["layer"], header["block"], int(header["step"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise P.ProtocolError(f"a STEP without a usable header ({exc!r})") from exc
    if batch is None:
        raise P.ProtocolError("a STEP before any batch was given")
    head = block == P.HEAD and layer == config.n_layers
    if not head and (
        not (isinstance(layer, int) and 0 <= layer < config.n_layers)
        or block not in (P.ATTENTION, P.FFN)
    ):
        raise P.ProtocolError(f"a STEP for layer {layer!r}, block {block!r}")
    if not (
        0 < batch.size == len(batch.starts) == len(batch.lengths)
        and all(0 <= slot < cache.slots for slot in batch.slots)
        and all(0 <= a and 0 < n and a + n <= cache.max_context
                for a, n in zip(batch.starts, batch.lengths, strict=True))
    ):  # fmt: skip
        raise P.ProtocolError(f"a STEP batch this node cannot hold: {batch}")
    shape = (batch.size, config.hidden) if batch.rows else (batch.size, batch.width, config.hidden)
    if head:  # the final-normed rows the master takes logits of: one per sequence, or per token
        rows = tensors[0].shape[0] if len(tensors) == 1 and tensors[0].ndim == 2 else 0
        shape = (rows if 0 < rows <= batch.size * batch.width else -1, config.hidden)
    if len(tensors) != 1 or tensors[0].shape != shape or tensors[0].dtype != np.float32:
        got = [(t.dtype.name, t.shape) for t in tensors]
        raise P.ProtocolError(f"a STEP's hidden state is {got}, not one float32 {shape}")
    return Step(batch, layer, block, tensors[0])


def _waits_for_answer(frames: list[Any]) -> bool:
    """Whether a message that did not make sense may have been a STEP (the master waits for
    its partial) or a WELCOME (it waits for READY), as far as its header can be read."""
    try:
        return P.decode_header(frames[0])["op"] in (P.STEP, P.WELCOME)
    except (P.ProtocolError, IndexError, TypeError):
        return False
