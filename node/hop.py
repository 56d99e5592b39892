"""The per-sum path of a decode step in native code (node/csrc/hop.c), on pyzmq's own sockets.

A worker's `WorkerHop.serve` receives STEPs, computes their blocks (models/rows_native.py) and
sends the partials; the master's `HubHop.run` sends each block's STEP, computes its own partial,
gathers the workers' and sums them into the residual stream, block after block. Both take only the
messages of a decode step's steady run, in the msgpack node/protocol.py writes, and hand anything
else back as frames for the Python path to handle as it always has (`FOREIGN`); a receive that
times out comes back too (`TIMEOUT`), so heartbeats and deadlines are checked where they were.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from pathlib import Path

import numpy as np
import zmq

from edgetp.models.cbuild import built
from edgetp.models.rows_native import MAX_ROWS, NativeBlocks

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "hop.c"
FLAGS = ("-O2", "-shared", "-fPIC")
DONE, TIMEOUT, FOREIGN, SEND_FAILED, ERROR = range(5)
HELD = 8
ZMQ_FUNCTIONS = (
    "zmq_msg_init",
    "zmq_msg_recv",
    "zmq_msg_data",
    "zmq_msg_size",
    "zmq_msg_more",
    "zmq_msg_close",
    "zmq_send",
    "zmq_poll",
    "zmq_msg_gets",
)


class Held(ctypes.Structure):
    _fields_ = [
        ("frames", (ctypes.c_uint8 * 64) * HELD),  # zmq_msg_t: 64 bytes, pointer-aligned
        ("n", ctypes.c_int64),
        ("dropped", ctypes.c_int64),
    ]


class Worker(ctypes.Structure):
    _fields_ = [
        ("sock", ctypes.c_void_p),
        ("block", ctypes.c_void_p),
        ("args", ctypes.c_void_p),
        ("step", ctypes.c_void_p),
        ("L", ctypes.c_int64),
        ("B", ctypes.c_int64),
        ("D", ctypes.c_int64),
        ("inp", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("wire", ctypes.c_void_p),
        ("to_half", ctypes.c_void_p),
        ("from_half", ctypes.c_void_p),
        ("compute_s", ctypes.c_double),
        ("blocks", ctypes.c_int64),
        ("msg", Held),
    ]


class Hub(ctypes.Structure):
    _fields_ = [
        ("sock", ctypes.c_void_p),
        ("block", ctypes.c_void_p),
        ("args", ctypes.c_void_p),
        ("step", ctypes.c_void_p),
        ("L", ctypes.c_int64),
        ("B", ctypes.c_int64),
        ("D", ctypes.c_int64),
        ("step_no", ctypes.c_int64),
        ("n_workers", ctypes.c_int64),
        ("ids", ctypes.c_void_p),
        ("id_lens", ctypes.c_void_p),
        ("first", ctypes.c_void_p),
        ("first_len", ctypes.c_int64),
        ("h", ctypes.c_void_p),
        ("own", ctypes.c_void_p),
        ("partials", ctypes.c_void_p),
        ("received", ctypes.c_void_p),
        ("allreduce", ctypes.c_void_p),
        ("hops", ctypes.c_void_p),
        ("layer", ctypes.c_int64),
        ("ffn", ctypes.c_int64),
        ("gathering", ctypes.c_int64),
        ("sent_at", ctypes.c_double),
        ("slowest", ctypes.c_double),
        ("own_compute_s", ctypes.c_double),
        ("failed", ctypes.c_int64),
        ("one_core", ctypes.c_int64),
        ("attention_alone", ctypes.c_int64),
        ("post_norm", ctypes.c_void_p),
        ("post_norms", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("half", ctypes.c_int64),
        ("wire", ctypes.c_void_p),
        ("to_half", ctypes.c_void_p),
        ("from_half", ctypes.c_void_p),
        ("msg", Held),
    ]


_lib: ctypes.CDLL | None = None
_unavailable: str | None = None  # why the library cannot be had here, once found out


def available() -> bool:
    """Whether this device runs the native loops (a C compiler, and a libzmq to call); the
    reason is logged once when it does not, and the Python path serves instead."""
    global _unavailable
    if _lib is None and _unavailable is None:
        try:
            load()
        except (RuntimeError, OSError, AttributeError) as exc:
            _unavailable = str(exc)
            log.info("decode steps' messages go through Python: %s", exc)
    return _lib is not None


def load() -> ctypes.CDLL:
    """The built library, given the libzmq functions of the libzmq pyzmq runs on."""
    global _lib
    if _lib is None:
        zmq_lib = ctypes.CDLL(_libzmq_path())
        lib = ctypes.CDLL(str(built(SOURCE, FLAGS, ".so")))
        lib.hop_init.argtypes = [ctypes.c_void_p] * len(ZMQ_FUNCTIONS)
        lib.hop_init(*(ctypes.cast(getattr(zmq_lib, f), ctypes.c_void_p) for f in ZMQ_FUNCTIONS))
        for name in ("hop_serve", "hop_run"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_long]
            getattr(lib, name).restype = ctypes.c_int
        for name in ("hop_frames", "hop_frame_size"):
            getattr(lib, name).restype = ctypes.c_int64
        lib.hop_frames.argtypes = [ctypes.c_void_p]
        lib.hop_frame_size.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.hop_frame_copy.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.hop_release.argtypes = [ctypes.c_void_p]
        lib.hop_frame_peer.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p]
        lib.hop_frame_peer.argtypes += [ctypes.c_int64]
        lib.hop_header.restype = ctypes.c_size_t
        lib.hop_header.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p]
        lib.hop_header.argtypes += [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        lib.hop_header.argtypes += [ctypes.POINTER(ctypes.c_double), ctypes.c_int64, ctypes.c_int64]
        lib.hop_header.argtypes += [ctypes.c_int]
        lib.hop_parse.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_int]
        lib.hop_parse.argtypes += [ctypes.c_void_p]
        _lib = lib
    return _lib


class Parsed(ctypes.Structure):
    _fields_ = [
        ("step", ctypes.c_int64),
        ("layer", ctypes.c_int64),
        ("B", ctypes.c_int64),
        ("D", ctypes.c_int64),
        ("ffn", ctypes.c_int),
        ("half", ctypes.c_int),
        ("compute", ctypes.c_double),
    ]


def header(
    op: str,
    step: int,
    layer: int,
    ffn: bool,
    compute: float | None,
    rows: int,
    hidden: int,
    half: bool = False,
) -> bytes:
    """The header frame the native loop writes for a STEP (`compute` None) or a PARTIAL, its
    tensor float16 where `half`."""
    buf = ctypes.create_string_buffer(256)
    given = None if compute is None else ctypes.byref(ctypes.c_double(compute))
    n = load().hop_header(
        buf, len(buf), op.encode(), step, layer, int(ffn), given, rows, hidden, int(half)
    )
    return buf.raw[:n]


def parse(frame: bytes, op: str) -> Parsed | None:
    """What the native loop reads from a STEP's or a PARTIAL's header frame; None for a header
    it hands to Python instead."""
    parsed = Parsed()
    taken = load().hop_parse(frame, len(frame), op.encode(), int(op == "partial"),
                             ctypes.byref(parsed))  # fmt: skip
    return parsed if taken else None


def _libzmq_path() -> str:
    """The libzmq this process loaded with pyzmq (bundled in its wheel, or the system's)."""
    zmq.zmq_version()  # loaded by now
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if "libzmq" in Path(path).name:
            return path
    raise RuntimeError("cannot find the libzmq pyzmq loaded")


def _held(lib: ctypes.CDLL, msg: Held) -> tuple[list[bytes], str]:
    """The message C would not take, as the frames Python's path reads (its memory released),
    and the address of the peer it came from ("" if unknown)."""
    address = ctypes.addressof(msg)
    count = lib.hop_frames(address)
    if count < 0:
        lib.hop_release(address)
        return [], ""  # more frames than any message of the protocol: read as malformed
    peer = ctypes.create_string_buffer(256)
    if count > 1:  # after a ROUTER's identity frame: the first the peer sent
        lib.hop_frame_peer(address, 1, peer, len(peer))
    frames = []
    for i in range(count):
        buf = ctypes.create_string_buffer(lib.hop_frame_size(address, i))
        lib.hop_frame_copy(address, i, buf)
        frames.append(buf.raw)
    lib.hop_release(address)
    return frames, peer.value.decode(errors="replace")


def _half_functions(blocks: NativeBlocks) -> dict[str, int | None]:
    """rows.c's conversions to and from float16, for a sum's messages (`MemoryOptions.wire`)."""
    return {
        name: ctypes.cast(getattr(blocks.lib, f"rows_{name}"), ctypes.c_void_p).value
        for name in ("to_half", "from_half")
    }


class WorkerHop:
    """A worker's native loop over its DEALER socket and its slice's native blocks."""

    def __init__(self, sock: zmq.Socket, blocks: NativeBlocks) -> None:
        self.lib = load()
        self.blocks = blocks
        self.table = blocks.table
        config = blocks.config
        self.inp = np.zeros((MAX_ROWS, config.hidden), np.float32)
        self.out = np.zeros_like(self.inp)
        self.wire = np.zeros((MAX_ROWS, config.hidden), np.uint16)
        self.state = Worker(
            sock=sock.underlying,
            block=ctypes.cast(blocks.lib.rows_block, ctypes.c_void_p).value,
            args=ctypes.addressof(self.table),
            step=ctypes.addressof(blocks.step),
            L=config.n_layers,
            B=0,
            D=config.hidden,
            inp=self.inp.ctypes.data,
            out=self.out.ctypes.data,
            wire=self.wire.ctypes.data,
            **_half_functions(blocks),
        )

    def begin_step(self, rows: int) -> None:
        """A decode step of `rows` sequences is begun (the blocks know its positions); 0: none."""
        self.state.B = rows

    def serve(self, timeout_ms: int) -> int:
        return self.lib.hop_serve(ctypes.byref(self.state), timeout_ms)

    def take_compute(self) -> float:
        """Seconds of compute in blocks served since the last call."""
        seconds, self.state.compute_s = self.state.compute_s, 0.0
        return seconds

    def frames(self) -> list[bytes]:
        return _held(self.lib, self.state.msg)[0]

    def close(self) -> None:
        self.lib.hop_release(ctypes.addressof(self.state.msg))


class HubHop:
    """The master's native loop: a decode step's blocks over its ROUTER socket, its own slice's
    native blocks, and the workers `identities` (in the plan's order); `one_core`: it yields
    the core after each block's sends (node/protocol.py's `on_one_core`); `post_norms` (2 L,
    D): each block's sum normed by its row before the residual (Gemma 3), as the Python path
    norms it (`rows_native.post_norm_rows`)."""

    def __init__(
        self,
        sock: zmq.Socket,
        blocks: NativeBlocks,
        identities: list[bytes],
        one_core: bool,
        post_norms: np.ndarray | None = None,
        eps: float = 0.0,
    ) -> None:
        self.lib = load()
        # Not a reference: a re-planned engine's blocks (and the weights they point into) go
        # with it, while the transport keeps this loop until its next native step.
        self._blocks = weakref.ref(blocks)
        self.table = blocks.table
        config = blocks.config
        n = len(identities)
        self.identities = identities
        self._ids = [ctypes.create_string_buffer(i, len(i)) for i in identities]
        self._id_ptrs = (ctypes.c_void_p * max(n, 1))(*(ctypes.addressof(b) for b in self._ids))
        self._id_lens = np.array([len(i) for i in identities] or [0], np.int64)
        self.own = np.zeros((MAX_ROWS, config.hidden), np.float32)
        self.partials = np.zeros((max(n, 1), MAX_ROWS, config.hidden), np.float32)
        self.received = np.zeros(max(n, 1), np.uint8)
        self.allreduce = np.zeros(2 * config.n_layers, np.float64)
        self.hops = np.zeros((2 * config.n_layers, max(n, 1)), np.float64)
        self.h = np.zeros((1, config.hidden), np.float32)
        self.wire = np.zeros((MAX_ROWS, config.hidden), np.uint16)
        self._first = ctypes.create_string_buffer(0)
        self.state = Hub(
            sock=sock.underlying,
            block=ctypes.cast(blocks.lib.rows_block, ctypes.c_void_p).value,
            args=ctypes.addressof(self.table),
            step=ctypes.addressof(blocks.step),
            L=config.n_layers,
            D=config.hidden,
            n_workers=n,
            ids=ctypes.addressof(self._id_ptrs),
            id_lens=self._id_lens.ctypes.data,
            own=self.own.ctypes.data,
            received=self.received.ctypes.data,
            allreduce=self.allreduce.ctypes.data,
            hops=self.hops.ctypes.data,
            one_core=int(one_core),
            wire=self.wire.ctypes.data,
            **_half_functions(blocks),
        )
        if post_norms is not None:
            self._post_norms = np.ascontiguousarray(post_norms, np.float32)
            self.state.post_norm = ctypes.cast(blocks.lib.rows_post_norm, ctypes.c_void_p).value
            self.state.post_norms = self._post_norms.ctypes.data
            self.state.eps = eps

    @property
    def blocks(self) -> NativeBlocks | None:
        """The blocks this loop was made for, or None once they are gone (never run it then)."""
        return self._blocks()

    def begin(
        self,
        step_no: int,
        h: np.ndarray,
        first_header: bytes | None,
        attention_alone: bool = False,
        half: bool = False,
    ) -> None:
        """A decode step: its number, its hidden state (B, D) (summed into in place: `self.h`),
        and the header of its first STEP (with the batch), or None if the batch went already.
        `attention_alone`: the workers hold no attention, so its blocks are this process's
        alone, with no messages, and the first STEP is layer 0's FFN. `half`: each STEP's
        hidden state goes as float16 where it fits (`messages.for_the_wire`, the rule the first
        header was written by), and the workers answer in kind."""
        B = h.shape[0]
        self.h = np.ascontiguousarray(h, np.float32).copy()
        self.partials = np.zeros((max(len(self.identities), 1), B, h.shape[1]), np.float32)
        s = self.state
        s.B, s.step_no, s.h = B, step_no, self.h.ctypes.data
        s.partials = self.partials.ctypes.data
        self._first = ctypes.create_string_buffer(first_header or b"", len(first_header or b""))
        s.first = ctypes.addressof(self._first) if first_header else None
        s.first_len = len(first_header or b"")
        s.layer = s.ffn = s.gathering = 0
        s.attention_alone = int(attention_alone)
        s.half = int(half)
        s.own_compute_s = 0.0
        self.received[:] = 0

    def run(self, timeout_ms: int) -> int:
        return self.lib.hop_run(ctypes.byref(self.state), timeout_ms)

    def message(self) -> tuple[list[bytes], str]:
        """The held message's frames (identity first) and the peer address it came from."""
        return _held(self.lib, self.state.msg)

    def close(self) -> None:
        self.lib.hop_release(ctypes.addressof(self.state.msg))
