"""Every message master and nodes send each other, one typed definition each.

A message is a msgpack header frame followed by zero or more raw tensor frames. The header is
one of the Structs below, tagged by its "op"; the tensors' dtype and shape travel in it under
"tensors". Both sides build a message as its Struct and read it back as its Struct: decoding
checks every field's type and bounds, so a reader gets a message it can use or a ProtocolError
saying what was wrong, never a dict to pick apart. Nothing is pickled. On the master's ROUTER
socket the first frame is the peer's identity.

The decode steps' steady run of STEP and PARTIAL goes through node/csrc/hop.c, which writes and
reads exactly the bytes `encode` gives those two (tests/test_protocol.py holds it to that).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
import numpy as np
import zmq

from edgetp.memory.shards import ShardRef
from edgetp.models.config import ModelConfig
from edgetp.models.layers import Slice, StepBatch
from edgetp.node.protocol import PROTOCOL_VERSION, Block

if TYPE_CHECKING:  # the CLI imports this module: no torch at start-up
    import torch

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
# A shard's name: its content's sha256, so that no name a peer sends can point outside the store
Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class ProtocolError(Exception):
    """A message that does not follow this protocol."""


class Capacity(msgspec.Struct, frozen=True):
    """What a device can do, as it measured itself (node/probes.py) and tells the master."""

    memory_budget: NonNegative  # bytes
    cores: Positive
    speed: Annotated[float, msgspec.Meta(gt=0.0)]  # matrix-vector throughput, GB/s of weights
    window: Positive | None = None  # layers to keep in memory, when forced with --window
    disk: Annotated[float, msgspec.Meta(gt=0.0)] | None = None  # GB/s read from its disk
    # its time to send or to receive one message (node.probes.measure_message_cost)
    message_s: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.speed):  # an infinite speed would take every share
            raise ValueError(f"a speed of {self.speed!r}")

    def score(self) -> float:
        """What the plan divides work by."""
        return max(self.speed, 1e-3)


class Tensor(msgspec.Struct, array_like=True, frozen=True):
    """A tensor frame's dtype and shape, as a header lists it: ["float32", [B, D]]."""

    dtype: Literal["float32", "float16"]
    shape: list[NonNegative]


class HeadRows(msgspec.Struct, frozen=True):
    """A node's rows [start, end) of the lm_head, and the shard that holds them."""

    rows: tuple[NonNegative, NonNegative]
    shard: ShardRef

    def __post_init__(self) -> None:
        if self.rows[0] > self.rows[1]:
            raise ValueError(f"lm_head rows {list(self.rows)}")


class _Message(msgspec.Struct, tag_field="op", omit_defaults=True, forbid_unknown_fields=True):
    pass


# -- node -> master ------------------------------------------------------------------------------
class Hello(_Message, tag="hello"):
    version: int
    name: str
    capacity: Capacity
    model: str | None = None  # the model it asks for (edgetp join --model)
    # Where the master saw it come from (for the cluster view): set by the master on receipt,
    # whatever the node wrote.
    peer_address: str = ""


class Fetch(_Message, tag="fetch"):
    """A chunk of a shard file."""

    sha256: Sha256
    offset: NonNegative
    size: Positive


class Ready(_Message, tag="ready"):
    """Its shards verified and loaded; `fetched` bytes came over the link for them."""

    fetched: NonNegative = 0


class Leave(_Message, tag="leave"):
    """The node is shutting down: re-plan without it."""


class Partial(_Message, tag="partial"):
    """Its partial of a block (one tensor), or its logits for a HEAD."""

    step: NonNegative
    layer: NonNegative
    block: Block
    compute: Seconds  # its seconds computing it
    figures: dict[str, Any] | None = None  # after a step's last block: its loader's figures
    tensors: list[Tensor] = []


class Measured(_Message, tag="measured"):
    """The answer to MEASURE: its speed now, GB/s of weights."""

    speed: Annotated[float, msgspec.Meta(gt=0.0)]

    def __post_init__(self) -> None:
        if not math.isfinite(self.speed):  # an infinite speed would take every share
            raise ValueError(f"a measured speed of {self.speed!r}")


class Echoed(_Message, tag="echoed"):
    """The answer to ECHO, at once: its tensor back."""

    tensors: list[Tensor] = []


class SplitDone(_Message, tag="split-done"):
    """The answer to SPLIT: its share written and hashed (each layer's shard, and its rows of
    the lm_head where the head is split); `fetched` bytes came from the model's file for it, in
    `requests` requests. Or, with `unreachable` (why), none: the hub cannot be reached from the
    node, and the master splits its share and ships it as for a file it has."""

    layers: list[ShardRef]
    head: ShardRef | None = None
    fetched: NonNegative = 0
    requests: NonNegative = 0
    unreachable: str = ""


class Error(_Message, tag="error"):
    """The node failed, or the master cannot serve a FETCH: why, in words for a person."""

    message: str


# -- master -> node ------------------------------------------------------------------------------
class Welcome(_Message, tag="welcome"):
    """A node's slice of the model and how to hold it; sent again on every re-plan."""

    node: Positive  # its index in the plan (the master is 0)
    config: ModelConfig
    slice: Slice
    shards: list[ShardRef]  # its shard of every layer
    context: Positive
    slots: Positive
    heartbeat_port: NonNegative
    window: Positive | None = None  # layers of its slice in memory; None: all
    rope_freq_factors: list[float] | None = None
    head: HeadRows | None = None  # where the plan splits the lm_head
    # the master's choice of activations (models/activations.py): every node's products round
    # the same way, so a token does not depend on the node count
    activations: Literal["exact", "int8"] = "exact"
    kv_format: str = "f32"  # how its KV cache stores keys and values (models/kvformat.py)

    def __post_init__(self) -> None:
        if len(self.shards) != self.config.n_layers:
            raise ValueError(f"{len(self.shards)} shards for {self.config.n_layers} layers")


class Refuse(_Message, tag="refuse"):
    reason: str


class Accepted(_Message, tag="accepted"):
    """Joined: WELCOME follows once the master has planned; its heartbeat is on this port."""

    heartbeat_port: NonNegative


class Chunk(_Message, tag="chunk"):
    """A chunk of a shard file at `offset`; its one frame is the raw bytes, not a tensor."""

    sha256: Sha256
    offset: NonNegative


class Step(_Message, tag="step"):
    """One block of one layer to compute, with the hidden state: decode (B, D), else (B, T, D).
    Block HEAD (layer n_layers): the final-normed rows (R, D), answered with the node's logits
    (R, its rows of the lm_head) as the PARTIAL."""

    step: NonNegative
    layer: NonNegative
    block: Block
    batch: StepBatch | None = None  # the step's sequences, with its first block
    # A mixture of experts' FFN block: each token's experts and their weights, as the master's
    # router chose them (models/moe.py), a row a token: (B, k) in a decode step, else (B T, k).
    experts: list[list[NonNegative]] | None = None
    expert_weights: list[list[float]] | None = None
    tensors: list[Tensor] = []


class Bye(_Message, tag="bye"):
    """The master is shutting down (`rejoin` None) or drops this node (True: join again)."""

    reason: str = ""
    rejoin: bool | None = None


class Standby(_Message, tag="standby"):
    """This plan leaves the node out (it would slow every token): it frees its slice and waits,
    joined, for a WELCOME from a later plan."""

    reason: str = ""


class Measure(_Message, tag="measure"):
    """Before a plan: measure your speed now, as every node does at this moment (MEASURED)."""


class RemoteFile(msgspec.Struct, frozen=True):
    """A file on the hub, read by byte ranges (models/ranges.py): its URL, size, the version's
    ETag, and the headers a request carries (credentials: the link is encrypted)."""

    url: str
    size: Positive
    etag: str
    headers: dict[str, str] = {}


class RemoteModel(msgspec.Struct, frozen=True):
    """A model on the hub: its weight files by name (read by ranges) and its other files'
    bytes (an HF folder's config and tokenizer)."""

    files: dict[str, RemoteFile]
    small: dict[str, bytes] = {}


class Split(_Message, tag="split"):
    """Before a plan's WELCOME: split your share of the model yourself, from its file on the
    hub (SPLIT-DONE, also when the hub cannot be reached from you; or ERROR): the plan's every
    slice and `node`, which is yours."""

    node: Positive
    model: RemoteModel
    slices: list[Slice]
    dtype: str
    head_rows: list[tuple[NonNegative, NonNegative]] = []


class Echo(_Message, tag="echo"):
    """Send its one tensor back at once (ECHOED): the master times its link to you."""

    tensors: list[Tensor] = []


class Heartbeat(_Message, tag="heartbeat"):
    """Both ways, on the heartbeat sockets; a node's carries its name."""

    name: str = ""


FromNode = Hello | Fetch | Ready | Leave | Partial | Measured | Echoed | SplitDone | Error
# ERROR both ways: from the master, a FETCH it cannot serve
FromMaster = (
    Welcome | Refuse | Accepted | Chunk | Step | Bye | Standby | Measure | Echo | Split | Error
)
Message = FromNode | FromMaster | Heartbeat

# What tensors cross the wire as (hidden states, partials), by NumPy's one-letter code: reading
# `dtype.name` costs more than the rest of encoding a message.
_DTYPES: dict[str, Literal["float32", "float16"]] = {"f": "float32", "e": "float16"}
_encoder = msgspec.msgpack.Encoder()
_from_node = msgspec.msgpack.Decoder(FromNode)
_from_master = msgspec.msgpack.Decoder(FromMaster)
_heartbeat = msgspec.msgpack.Decoder(Heartbeat)


def encode(message: Message, tensors: Sequence[np.ndarray | torch.Tensor] = ()) -> list[Any]:
    """Frames for a message and its tensors (arrays, or torch tensors, which travel as
    arrays)."""
    arrays = [np.asarray(t) for t in tensors]  # a CPU tensor's array shares its memory
    if arrays:
        specs = [Tensor(_DTYPES[a.dtype.char], list(a.shape)) for a in arrays]
        message = msgspec.structs.replace(message, tensors=specs)
    frames: list[Any] = [_encoder.encode(message)]
    frames.extend(np.ascontiguousarray(a) for a in arrays)
    return frames


FLOAT16_MAX = 65504.0  # the largest finite float16


def for_the_wire(values: np.ndarray | torch.Tensor, wire: str) -> np.ndarray:
    """`values` as a sum's message carries them: as float16 where `wire` says so and every
    value is within its range, else as float32, so that nothing a message carries turns into
    an infinity (node/csrc/hop.c follows the same rule). The header names which it is."""
    array = np.asarray(values)
    if wire == "float16" and bool(np.all(np.abs(array) <= FLOAT16_MAX)):  # a NaN: float32
        return array.astype(np.float16)
    return array


def decode_from_node(frames: list[Any]) -> tuple[FromNode, list[np.ndarray]]:
    """A node's message and its tensors (read-only arrays over the frames' memory)."""
    return _decode(_from_node, frames)


def decode_from_master(frames: list[Any]) -> tuple[FromMaster, list[np.ndarray]]:
    """The master's message and its tensors; a CHUNK's data is its second frame, as bytes."""
    return _decode(_from_master, frames)


def decode_heartbeat(frame: Any) -> Heartbeat:
    try:
        return _heartbeat.decode(_buffer(frame))
    except (msgspec.MsgspecError, ValueError) as exc:
        raise ProtocolError(f"a heartbeat that does not decode ({exc})") from exc


def op_of(frames: list[Any]) -> str | None:
    """The op a message's header names, as far as it can be read (for one that failed to
    decode: whether its sender waits for an answer)."""
    try:
        raw = msgspec.msgpack.decode(_buffer(frames[0]))
    except (msgspec.MsgspecError, IndexError, TypeError, ValueError):
        return None
    op = raw.get("op") if isinstance(raw, dict) else None
    return op if isinstance(op, str) else None


def version_mismatch(version: object) -> str | None:
    """Why a node speaking protocol `version` cannot join, or None when it can."""
    if version == PROTOCOL_VERSION:
        return None
    return (
        f"protocol version {version} does not match the master's {PROTOCOL_VERSION}: run the "
        "same edgetp version on every device"
    )


def _decode(decoder: msgspec.msgpack.Decoder, frames: list[Any]) -> tuple[Any, list[np.ndarray]]:
    if not frames:
        raise ProtocolError("empty message")
    try:
        message = decoder.decode(_buffer(frames[0]))
    except msgspec.ValidationError as exc:
        raise ProtocolError(_why_invalid(frames[0], exc)) from exc
    except (msgspec.DecodeError, ValueError) as exc:  # ValueError: a string not UTF-8
        raise ProtocolError(f"a header that is not msgpack ({exc})") from exc
    specs = getattr(message, "tensors", None)
    if specs is None:  # a message without tensors (a CHUNK's frame is file bytes)
        return message, []
    if len(specs) != len(frames) - 1:
        raise ProtocolError(f"a {message.__struct_config__.tag!r} listing {len(specs)} tensors "
                            f"came with {len(frames) - 1} frames")  # fmt: skip
    return message, [_tensor(spec, frame) for spec, frame in zip(specs, frames[1:], strict=True)]


def _why_invalid(frame: Any, exc: msgspec.ValidationError) -> str:
    """A failed check in words; for a HELLO from another protocol version, that version (its
    fields may differ from this one's in any way)."""
    try:
        raw = msgspec.msgpack.decode(_buffer(frame))
    except (msgspec.MsgspecError, ValueError):
        raw = None
    if isinstance(raw, dict) and raw.get("op") == "hello":
        if (mismatch := version_mismatch(raw.get("version"))) is not None:
            return mismatch
    op = raw.get("op") if isinstance(raw, dict) else None
    return f"{op!r}: {exc}" if isinstance(op, str) else f"{exc}"


def _tensor(spec: Tensor, frame: Any) -> np.ndarray:
    try:
        array = np.frombuffer(_buffer(frame), dtype=spec.dtype)
    except ValueError as exc:  # a ragged frame
        raise ProtocolError(f"a tensor frame that is not {spec.dtype} values ({exc})") from exc
    if array.size != math.prod(spec.shape):
        raise ProtocolError(f"a tensor frame of {array.size} values for shape {spec.shape}")
    return array.reshape(spec.shape)


def _buffer(frame: Any) -> Any:
    return frame.buffer if isinstance(frame, zmq.Frame) else frame
