"""The wire protocol master and nodes speak: constants in one place, framing in one place.

A message is a msgpack header frame (a dict with an "op") followed by zero or more raw tensor
frames, whose dtype and shape travel in the header under "tensors". Nothing is pickled. On the
master's ROUTER socket the first frame is the peer's identity.

    node -> master: HELLO, FETCH, READY, PARTIAL, LEAVE, HEARTBEAT, ERROR
    master -> node: WELCOME, REFUSE, CHUNK, STEP, HEARTBEAT, BYE
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import zmq

if TYPE_CHECKING:  # the CLI imports this module: no torch at start-up
    import torch

PROTOCOL_VERSION = 5  # 2: a decode step's hidden state travels as rows (B, D); 3: HEAD;
# 4: MEASURE, ECHO; 5: STANDBY
DEFAULT_PORT = 7470

# node -> master
HELLO = "hello"  # {version, name, capacity, model?}
FETCH = "fetch"  # {sha256, offset, size}: a chunk of a shard file
READY = "ready"  # shards verified and loaded
LEAVE = "leave"  # the node is shutting down; re-plan without it
PARTIAL = "partial"  # {step, layer, block} + one tensor
MEASURED = "measured"  # {speed}: the answer to MEASURE, GB/s of weights
ECHOED = "echoed"  # the answer to ECHO, at once: its tensor back
ERROR = "error"  # {message}
# master -> node
WELCOME = "welcome"  # {node, config, slice, shards, rope, context, slots}; again on re-plan
REFUSE = "refuse"  # {reason}
ACCEPTED = "accepted"  # {heartbeat_port}: joined; WELCOME follows once the master has planned
CHUNK = "chunk"  # {sha256, offset, eof} + one bytes frame
STEP = "step"  # {step, layer, block, batch?} + hidden state: decode (B, D), else (B, T, D);
# block HEAD (layer n_layers): the final-normed rows (R, D), answered with the node's logits
# (R, its rows of the lm_head) as the PARTIAL
BYE = "bye"  # the master is shutting down or dropping this node
# {reason}: this plan leaves the node out (it would slow every token); it frees its slice and
# waits, joined, for a WELCOME from a later plan
STANDBY = "standby"
# before a plan: measure your speed now, as every node does at this moment (answer MEASURED)
MEASURE = "measure"
ECHO = "echo"  # + one tensor: send it back (ECHOED) at once; the master times its link to you
# both ways
HEARTBEAT = "heartbeat"

ATTENTION, FFN = "attn", "ffn"  # the two blocks (two sums) of a layer
HEAD = "head"  # the lm_head's rows, after the last layer

HEARTBEAT_INTERVAL = 0.25  # seconds between heartbeats, each way
HEARTBEAT_LIVENESS = 8  # missed heartbeats before a peer is taken for dead (2 s)
CHUNK_SIZE = 1 << 20  # shard transfer chunk
# Mid-step, an answer is usually a fraction of a millisecond away: checking for it in a loop
# this long before sleeping in poll() saves the wake-up, which costs more than the hop itself
# (measured on loopback: 157 us -> 85 us per round trip beyond compute).
SPIN_SECONDS = 0.001

# What tensors cross the wire as (hidden states, partials), by NumPy's one-letter code: reading
# `dtype.name` costs more than the rest of encoding a message.
_DTYPES = {"f": "float32", "e": "float16"}


class ProtocolError(Exception):
    """A message that does not follow this protocol."""


def encode(
    header: dict[str, Any], tensors: tuple[np.ndarray | torch.Tensor, ...] = ()
) -> list[Any]:
    """Frames for a header and tensors (arrays, or torch tensors, which travel as arrays)."""
    arrays = [np.asarray(t) for t in tensors]  # a CPU tensor's array shares its memory
    if arrays:
        header = dict(header)
        header["tensors"] = [[_DTYPES[a.dtype.char], list(a.shape)] for a in arrays]
    frames: list[Any] = [msgpack.packb(header, use_bin_type=True)]
    frames.extend(np.ascontiguousarray(a) for a in arrays)
    return frames


def decode(frames: list[Any]) -> tuple[dict[str, Any], list[np.ndarray]]:
    """Header and tensors from received frames (zmq.Frame or bytes). The tensors are read-only
    arrays over the frames' memory: nothing is copied."""
    if not frames:
        raise ProtocolError("empty message")
    header = decode_header(frames[0])
    if header["op"] == CHUNK:  # a chunk's one frame is raw file bytes, not a tensor
        return header, []
    specs = header.get("tensors") or []
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise ProtocolError(f"header lists tensors {specs!r} but {len(frames) - 1} frames came")
    try:
        return header, [_tensor(spec, frame) for spec, frame in zip(specs, frames[1:], strict=True)]
    except (TypeError, ValueError) as exc:  # a spec that is not [dtype, shape], a ragged frame
        raise ProtocolError(f"malformed tensor in a {header['op']!r} message ({exc})") from exc


def _tensor(spec: Any, frame: Any) -> np.ndarray:
    dtype_name, shape = spec
    if dtype_name not in _DTYPES.values():
        raise ProtocolError(f"unknown tensor dtype {dtype_name!r}")
    buf = frame.buffer if isinstance(frame, zmq.Frame) else frame
    array = np.frombuffer(buf, dtype=dtype_name)
    if array.size != math.prod(shape):
        raise ProtocolError(f"tensor frame of {array.size} values for shape {shape}")
    return array.reshape(shape)


def spin_seconds() -> float:
    """How long this process checks for an answer in a loop before sleeping: SPIN_SECONDS, or
    none under a CPU quota (a container, an emulated device), where the loop would spend the
    quota the compute needs and the throttling it brings costs more than a wake-up. Read when a
    socket's owner starts: the master of a local cluster enters its device's cgroup first."""
    from models.kernels import cgroup_cpu_quota  # torch-free callers of this module never ask

    return SPIN_SECONDS if cgroup_cpu_quota() == "none" else 0.0


def on_one_core() -> bool:
    """Whether this process may run on one core only (an emulated device's cpuset, a one-core
    machine), where ZeroMQ's I/O thread takes turns with the thread that hands it messages. Such
    a sender yields the core after a block's sends, or the STEPs could wait out its own compute.
    Read when a socket's owner starts, as `spin_seconds` is."""
    return len(os.sched_getaffinity(0)) == 1


def wait_readable(sock: zmq.Socket, timeout_ms: int, spin: float) -> bool:
    """True when `sock` has a message within `timeout_ms`; check in a loop for `spin` seconds
    first (`spin_seconds()`, or 0 for none)."""
    end = time.perf_counter() + spin
    readable = [(sock, zmq.POLLIN)]  # zmq_poll itself: sock.poll builds a Poller each call
    while time.perf_counter() < end:
        if zmq.zmq_poll(readable, 0):
            return True
        os.sched_yield()  # a process with work to do on this core goes first
    return bool(zmq.zmq_poll(readable, timeout_ms))


def decode_header(frame: Any) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(_bytes(frame), raw=False)
    except Exception as exc:
        raise ProtocolError(f"header is not msgpack ({exc})") from exc
    if not isinstance(header, dict) or "op" not in header:
        raise ProtocolError("header is not a dict with an 'op'")
    return header


def _bytes(frame: Any) -> bytes:
    return frame.bytes if isinstance(frame, zmq.Frame) else bytes(frame)
