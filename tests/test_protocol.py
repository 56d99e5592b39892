"""The wire format: what goes in comes out, a malformed message is a ProtocolError, and the
native loop writes and reads exactly the bytes the Python encoder does."""

from __future__ import annotations

import dataclasses
import os

import msgpack
import numpy as np
import pytest
import torch

from edgetp.memory.shards import ShardRef
from edgetp.models.config import ModelConfig
from edgetp.models.layers import Slice, StepBatch
from edgetp.node import hop
from edgetp.node import messages as M
from edgetp.node import protocol as P
from edgetp.node.messages import Capacity

CONFIG = ModelConfig("llama", 2, 64, 4, 2, 16, 128, 100, 256, 1e-5, 10000.0)
SHARD = ShardRef("ab" * 32, 10)


def test_rows_and_tensors_round_trip_without_a_copy():
    rows = np.arange(2 * 576, dtype=np.float32).reshape(2, 576)
    prefill = torch.randn(2, 3, 576)
    step = M.Step(step=1, layer=4, block=P.ATTENTION)
    frames = [bytes(f) for f in M.encode(step, (rows, prefill))]
    message, (got_rows, got_prefill) = M.decode_from_master(frames)
    assert isinstance(message, M.Step) and message.layer == 4 and message.batch is None
    np.testing.assert_array_equal(got_rows, rows)
    np.testing.assert_array_equal(got_prefill, prefill.numpy())
    assert not got_rows.flags.writeable  # a view of the message, not a copy


EVERY_MESSAGE = [
    M.Hello(P.PROTOCOL_VERSION, "n1", Capacity(1 << 30, 2, 9.5, 3, 1.5, 4e-5), "smollm2"),
    M.Fetch("ab" * 32, 0, 1 << 20),
    M.Ready(12345),
    M.Leave(),
    M.Partial(7, 3, P.FFN, 0.0123, {"rss": 10, "kernels": ["c-f32"]}),
    M.Measured(11.5),
    M.Echoed(),
    M.Error("RuntimeError: out of memory"),
    M.Welcome(
        1,
        CONFIG,
        Slice((0, 2), (0, 1), (0, 64)),
        [SHARD, SHARD],
        256,
        2,
        7470,
        1,
        [1.0, 2.0],
        M.HeadRows((0, 50), SHARD),
    ),
    M.Refuse("protocol version 5 does not match"),
    M.Accepted(7471),
    M.Chunk("ab" * 32, 1 << 20),
    M.Step(8, 0, P.ATTENTION, StepBatch((0, 1), (5, 9), (1, 1))),
    M.Bye("dropped from the plan (it left)", True),
    M.Standby("its link would slow every token"),
    M.Measure(),
    M.Echo(),
    M.Split(
        2,
        M.RemoteModel(
            {"m.safetensors": M.RemoteFile("http://hub/o/r/resolve/c/m", 1 << 30, "ab" * 32)},
            {"config.json": b"{}"},
        ),
        [Slice((0, 2), (0, 1), (0, 64)), Slice((2, 4), (1, 2), (64, 128))],
        "auto",
        [(0, 10), (10, 20)],
    ),
    M.SplitDone([SHARD, SHARD], SHARD, 1234, 5),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_reads_back_as_it_was_built(message):
    frames = M.encode(message)
    decode = M.decode_from_node if isinstance(message, M.FromNode) else M.decode_from_master
    assert decode(frames) == (message, [])


def test_a_node_cannot_send_what_only_the_master_sends_nor_the_other_way():
    with pytest.raises(M.ProtocolError, match="welcome"):
        M.decode_from_node(M.encode(EVERY_MESSAGE[8]))
    with pytest.raises(M.ProtocolError):
        M.decode_from_master(M.encode(M.Ready(1)))


def _step(tensors: object, *frames: bytes) -> list[bytes]:
    header = {"op": "step", "step": 1, "layer": 0, "block": "attn", "tensors": tensors}
    return [msgpack.packb(header), *frames]


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"\xc1"],  # not msgpack
        [msgpack.packb([1, 2])],  # not a dict with an op
        [msgpack.packb({"op": "step", "layer": 0, "block": "attn"})],  # no step number
        [msgpack.packb({"op": "step", "step": 1, "layer": -1, "block": "attn"})],
        [msgpack.packb({"op": "step", "step": 1, "layer": 0, "block": "mlp"})],
        [msgpack.packb({"op": "step", "step": 1, "layer": 0, "block": "attn", "x": 1})],
        _step([["float32", [2]]]),  # a tensor listed, no frame
        _step([["float64", [1]]], bytes(8)),  # a dtype the wire does not carry
        _step([["float32", [3]]], bytes(8)),  # fewer values than the shape
        _step([["float32", [2]]], bytes(7)),  # a ragged frame
        _step([["float32", ["a"]]], bytes(4)),  # a shape that is not numbers
        _step([["float32", [-1, -1]]], bytes(4)),  # negative sizes
        _step(["float32"], bytes(4)),  # a spec that is not [dtype, shape]
        _step(7, bytes(4)),  # a tensor list that is not a list
    ],
    ids=lambda f: repr(f)[:40],
)
def test_a_malformed_message_is_a_protocol_error(frames):
    with pytest.raises(M.ProtocolError):
        M.decode_from_master(frames)


@pytest.mark.parametrize(
    "capacity",
    [
        {"memory_budget": -1, "cores": 1, "speed": 1.0},
        {"memory_budget": 1, "cores": 0, "speed": 1.0},
        {"memory_budget": 1, "cores": 1, "speed": 0.0},
        {"memory_budget": 1, "cores": 1, "speed": float("nan")},
        {"memory_budget": 1, "cores": 1, "speed": float("inf")},
        {"memory_budget": 1, "cores": 1, "speed": 1.0, "message_s": -0.5},
        {"memory_budget": 1, "cores": 1, "speed": 1.0, "message_s": 2.0},
        {"memory_budget": 1, "cores": 1, "speed": 1.0, "disk": 0.0},
    ],
    ids=str,
)
def test_a_capacity_that_would_skew_every_share_is_refused_as_it_decodes(capacity):
    hello = {"op": "hello", "version": P.PROTOCOL_VERSION, "name": "n", "capacity": capacity}
    with pytest.raises(M.ProtocolError, match="capacity"):
        M.decode_from_node([msgpack.packb(hello)])


@pytest.mark.parametrize("name", ["../../etc/" + "a" * 54, "AB" * 32, "ab" * 31, "ab" * 33])
def test_a_fetch_names_a_shard_by_its_sha256_only(name):
    """The master opens the file a FETCH names: a name that is not a sha256 never gets there."""
    fetch = {"op": "fetch", "sha256": name, "offset": 0, "size": 1}
    with pytest.raises(M.ProtocolError, match="sha256"):
        M.decode_from_node([msgpack.packb(fetch)])


def test_a_hello_of_another_version_says_so_whatever_its_fields():
    hello = {"op": "hello", "version": P.PROTOCOL_VERSION + 1, "name": "n", "new": {"x": 1}}
    with pytest.raises(M.ProtocolError, match="does not match the master's"):
        M.decode_from_node([msgpack.packb(hello)])


def test_a_welcome_with_a_shard_missing_for_a_layer_is_refused():
    with pytest.raises(ValueError, match="1 shards for 2 layers"):  # the master cannot build one
        M.Welcome(1, CONFIG, Slice((0, 2), (0, 1), (0, 64)), [SHARD], 256, 1, 7470)
    welcome = msgpack.unpackb(M.encode(EVERY_MESSAGE[8])[0])
    welcome["shards"].pop()
    with pytest.raises(M.ProtocolError, match="1 shards for 2 layers"):  # nor a node read one
        M.decode_from_master([msgpack.packb(welcome)])


# Numbers on each side of every msgpack integer width: the native loop writes the shortest.
WIDTHS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**40]


@pytest.mark.parametrize("step", WIDTHS)
@pytest.mark.parametrize("block", [P.ATTENTION, P.FFN])
@pytest.mark.parametrize("wire", P.WIRES)
def test_the_native_loop_writes_the_bytes_the_encoder_writes(step, block, wire):
    """Golden bytes: every header the C loop writes (a STEP on the master, a PARTIAL on a
    worker) equals the Python encoder's for the same message, its tensor float32 or float16,
    and each reads the other's."""
    if not hop.available():
        pytest.fail("the native loop does not build here (a C compiler and libzmq are needed)")
    half = wire == "float16"
    for layer, rows, hidden in [(0, 1, 576), (step % 200, 8, 2048), (127, 128, 65536)]:
        h = M.for_the_wire(np.zeros((rows, hidden), np.float32), wire)
        python_step = bytes(M.encode(M.Step(step, layer, block), (h,))[0])
        c_step = hop.header("step", step, layer, block == P.FFN, None, rows, hidden, half)
        assert c_step == python_step
        compute = 1e-4 * (step % 7 + 1)
        python_partial = bytes(M.encode(M.Partial(step, layer, block, compute), (h,))[0])
        c_partial = hop.header("partial", step, layer, block == P.FFN, compute, rows, hidden, half)
        assert c_partial == python_partial
        parsed = hop.parse(python_partial, "partial")
        assert parsed is not None
        got = (parsed.step, parsed.layer, parsed.ffn, parsed.B, parsed.D, parsed.compute)
        assert got == (step, layer, block == P.FFN, rows, hidden, compute) and parsed.half == half
        step_parsed = hop.parse(python_step, "step")
        assert step_parsed is not None and step_parsed.half == half


def test_a_sum_goes_as_float16_only_where_every_value_fits():
    """`--wire float16`: half the bytes, rounded as NumPy rounds; a value past float16's range
    (or a NaN) sends the whole message as float32 rather than as an infinity."""
    h = np.array([[1.0, -2.5e-3, 65504.0, -65504.0, 1 / 3]], np.float32)
    half = M.for_the_wire(h, "float16")
    assert half.dtype == np.float16 and half.nbytes == h.nbytes // 2
    assert np.array_equal(half, h.astype(np.float16))
    assert M.for_the_wire(h, "float32") is h
    for past in (65505.0, -1e6, np.inf, np.nan):
        h[0, 2] = past
        assert M.for_the_wire(h, "float16").dtype == np.float32


def test_the_native_loop_hands_python_every_step_it_does_not_take():
    """A STEP with a batch (a step's first block), with figures, or of a HEAD is Python's."""
    h = np.zeros((1, 64), np.float32)
    batch = StepBatch((0,), (3,), (1,))
    with_batch = bytes(M.encode(M.Step(1, 0, P.ATTENTION, batch), (h,))[0])
    head = bytes(M.encode(M.Step(1, 2, P.HEAD), (h,))[0])
    figures = bytes(M.encode(M.Partial(1, 1, P.FFN, 0.1, {"rss": 1}), (h,))[0])
    assert hop.parse(with_batch, "step") is None
    assert hop.parse(head, "step") is None
    assert hop.parse(figures, "partial") is None


def test_only_a_process_held_to_one_core_yields_it_after_its_sends():
    cores = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cores)})
        assert P.on_one_core()
    finally:
        os.sched_setaffinity(0, cores)
    assert P.on_one_core() == (len(cores) == 1)


# The model config's fields a node of this protocol version reads from WELCOME. A node reads
# no other (ModelConfig.from_dict): a field added without a new version would stop an older
# node at "unknown model config keys" instead of at the version check, which says what to do.
CONFIG_FIELDS_OF_THIS_VERSION = (12, {
    "activation", "architecture", "attention_gate", "attention_sinks", "context_length",
    "dense_ffn", "embedding_multiplier", "expert_bias", "ffn_hidden", "final_softcap", "fused",
    "global_head_dim", "global_kv_heads", "head_dim", "hidden", "k_eq_v", "kv_shared",
    "linear_conv", "linear_k_dim", "linear_k_heads", "linear_layers", "linear_v_dim",
    "linear_v_heads", "local_layers", "local_rope_theta", "n_experts", "n_experts_used", "n_heads",
    "n_kv_heads", "n_layers", "n_shared", "norm_eps", "norm_topk_prob", "o_bias", "ple_dim",
    "ple_vocab", "post_norms", "qk_norm", "qkv_bias", "query_scale", "rope_scaling", "rope_theta",
    "rotary_dim", "router_bias", "sliding_window", "swiglu_alpha", "swiglu_limit",
    "tied_embeddings", "unrotated_layers", "value_norm", "vocab_size", "wide_ffn",
})  # fmt: skip


def test_a_new_config_field_comes_with_a_new_protocol_version():
    """Change ModelConfig's fields, and PROTOCOL_VERSION goes up with them (and this list)."""
    version, fields = CONFIG_FIELDS_OF_THIS_VERSION
    assert {f.name for f in dataclasses.fields(ModelConfig)} == fields
    assert P.PROTOCOL_VERSION == version
