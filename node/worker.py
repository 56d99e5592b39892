"""A worker node: join a master, fetch and verify its shards, then compute its slice per step."""

from __future__ import annotations

import logging
import os
import socket
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
from memory.files import default_state_dir
from memory.shards import ShardRef, ShardStore, sha256_file
from memory.window import LayerWindow, StreamFigures, step_figures
from models.config import ModelConfig
from models.kernels import kernel_set, linear
from models.layers import Slice, StepBatch
from node import protocol as P
from node.device import prepare
from node.executor import Hidden, SliceExecutor, make_executor
from node.heartbeat import DEAD_AFTER, HeartbeatClient
from node.security import JoinToken, fingerprint, save_node_token, secure_client

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

    def score(self) -> float:
        """What the plan divides work by."""
        return max(self.speed, 1e-3)


def measure_capacity(
    threads: int, memory_budget: int | None = None, window: int | None = None
) -> Capacity:
    """A quick (~0.1 s) measurement of how fast this device streams weights through a matmul."""
    w = torch.randn(4096, 1024)  # 16 MB: bigger than most caches, small enough to be quick
    x = torch.randn(1, 1024)
    linear(x, w)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.1:
        linear(x, w)
        n += 1
    speed = n * w.numel() * 4 / (time.perf_counter() - start) / 1e9
    if memory_budget is None:
        memory_budget = device_memory_budget() or (
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )
    return Capacity(int(memory_budget), threads, round(speed, 2), window)


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
    def run(self) -> None:
        """Join, sync shards, then serve steps until the master says BYE."""
        self.sock.connect(self.endpoint)
        try:
            welcome = self._handshake()
            try:
                executor = self._load(welcome)
            except Exception as exc:  # tell the master, which is waiting for READY
                self._send({"op": P.ERROR, "message": f"{type(exc).__name__}: {exc}"})
                raise
            self._send({"op": P.READY, "fetched": self.fetched_bytes})
            log.info("node %s ready: slice %s", self.name, executor.slice)
            self._serve(executor)
        except KeyboardInterrupt:  # stopped by its owner: tell the master, which re-plans
            self._send({"op": P.LEAVE})
            log.info("node %s leaving", self.name)
        finally:
            if self.heartbeat:
                self.heartbeat.close()
            if self._handshake_events is not None:
                self.sock.disable_monitor()
                self._handshake_events.close(0)
            self.sock.close(0)
            self.context.term()

    def _handshake(self) -> dict[str, Any]:
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
        # The master plans (and may split a big model) before it says which slice is ours;
        # however long that takes, its heartbeat says it is alive.
        header, _ = P.decode(self._recv(float("inf"), "waiting for the master's plan"))
        if header["op"] == P.BYE:
            raise NodeError(
                f"the master stopped before giving this node a slice: {header['reason']}"
            )
        if header["op"] != P.WELCOME:
            raise NodeError(f"unexpected message before WELCOME: {header['op']!r}")
        return header

    def _load(self, welcome: dict[str, Any]) -> SliceExecutor:
        config = ModelConfig.from_dict(welcome["config"])
        s = Slice.from_dict(welcome["slice"])
        refs = [ShardRef(**r) for r in welcome["shards"]]
        missing = [r for r in refs if not self.store.has_valid(r)]
        self._fetch_total = sum(r.size for r in missing)
        for ref in missing:
            self._fetch(ref)
        factors = welcome.get("rope_freq_factors")
        freq = torch.tensor(factors) if factors else None
        window = welcome.get("window") or config.n_layers
        paths = [self.store.path(r) for r in refs]
        weights = LayerWindow(paths, window, self.drop_cache)
        executor = make_executor(config, s, weights, welcome["context"], welcome["slots"], freq)
        try:
            prepare(executor.matrix_shapes())  # with the threads the executor settled on
        except Exception:
            executor.close()
            raise
        return executor

    def _fetch(self, ref: ShardRef) -> None:
        """Fetch one shard in chunks into a .part file, resuming one left by an earlier run."""
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
        if sha256_file(part) != ref.sha256:
            part.unlink()
            raise NodeError(f"shard {ref.filename} arrived corrupt (sha256 mismatch); run again")
        os.replace(part, self.store.path(ref))

    def _reload(self, welcome: dict[str, Any]) -> SliceExecutor:
        before = self.fetched_bytes
        try:
            executor = self._load(welcome)
        except Exception as exc:
            self._send({"op": P.ERROR, "message": f"{type(exc).__name__}: {exc}"})
            raise
        self._send({"op": P.READY, "fetched": self.fetched_bytes - before})
        log.info("node %s re-planned: slice %s", self.name, executor.slice)
        return executor

    def _serve(self, executor: SliceExecutor) -> None:
        reported = StreamFigures()  # the loader's totals at the last report
        while True:
            frames = self._recv(float("inf"), "waiting for work")
            header, tensors = P.decode(frames)
            op = header["op"]
            if op == P.BYE:
                log.info("master said bye: %s", header.get("reason", ""))
                return
            if op == P.WELCOME:  # a re-plan: a new slice, maybe new shards to fetch
                executor.close()
                executor = self._reload(welcome=header)
                reported = StreamFigures()
                continue
            if op != P.STEP:
                raise NodeError(f"unexpected message from the master: {op!r}")
            try:
                if "batch" in header:
                    executor.begin_step(StepBatch.from_dict(header["batch"]))
                (h,) = tensors
                layer = header["layer"]
                started = time.perf_counter()
                partial = self._partial(executor, header["block"], layer, h)
            except Exception as exc:  # report, then stop: the master fails the request
                self._send({"op": P.ERROR, "message": f"{type(exc).__name__}: {exc}"})
                raise
            reply = {
                "op": P.PARTIAL,
                "step": header["step"],
                "layer": layer,
                "block": header["block"],
                "compute": time.perf_counter() - started,
            }
            if header["block"] == P.FFN and layer == executor.config.n_layers - 1:
                reply["figures"] = step_figures(executor.weights, reported)
                reply["figures"]["kernels"] = kernel_set()
                reported = replace(executor.weights.figures)
            self._send(reply, (partial,))

    @staticmethod
    def _partial(executor: SliceExecutor, block: str, layer: int, h: np.ndarray) -> Hidden:
        """This node's partial of one block: a decode step's rows (B, D) stay arrays
        (`StepBatch.rows`); any other step goes to torch."""
        compute = executor.attention if block == P.ATTENTION else executor.ffn
        if executor.rows:
            return compute(layer, h)
        with torch.inference_mode():
            return compute(layer, torch.from_numpy(h.copy()))  # the message's memory is read-only
