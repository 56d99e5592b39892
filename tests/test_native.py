"""The native decode path: C blocks that equal the NumPy ones, and a worker's native loop that
answers STEPs over real ZeroMQ sockets as the Python path would, handing back what it does not
take."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import numpy as np
import pytest
import torch
import zmq

from edgetp.models import kernels
from edgetp.models.block_rows import attention_rows, ffn_rows
from edgetp.models.config import ModelConfig
from edgetp.models.dtypes import BLOCK_DTYPES
from edgetp.models.kvformat import ROUNDING
from edgetp.models.layers import MATRICES, Slice, StepBatch, full_layer_shapes
from edgetp.models.layers import slice_layer as cut_layer
from edgetp.models.quant import FORMATS, matrix_size
from edgetp.models.rope import Rope
from edgetp.models.rows_native import FLOAT_ROWS, MAX_ROWS, NativeBlocks, admit
from edgetp.node import messages as M
from edgetp.node import protocol as P
from edgetp.node.hop import FOREIGN, TIMEOUT, WorkerHop
from edgetp.node.kvcache import KVCache

BASE = ModelConfig(
    architecture="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16,
    ffn_hidden=96, vocab_size=100, context_length=64, norm_eps=1e-5, rope_theta=10000.0,
)  # fmt: skip
FAMILIES = {
    "llama": BASE,
    "qwen2-bias": replace(BASE, qkv_bias=True),
    "qwen3-qk-norm": replace(BASE, qk_norm=True),
    "phi-partial-rotary": replace(BASE, rotary_dim=8),
    "gemma-gelu-ring": replace(
        BASE, qk_norm=True, activation="gelu_tanh", query_scale=0.3, sliding_window=4,
        local_layers=(0,), local_rope_theta=1000.0,
    ),
}  # fmt: skip
SLICES = {
    "whole": Slice((0, 4), (0, 2), (0, 96)),
    "a group": Slice((2, 4), (1, 2), (40, 96)),
    "heads split in a group": Slice((1, 2), (0, 1), (0, 8)),
    "no attention": Slice((0, 0), (0, 0), (0, 96)),
}


def _slice(
    config: ModelConfig, s: Slice, seed: int, size: float = 0.3
) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(config.n_layers):
        full = {
            n: torch.randn(shape, generator=gen) * size
            for n, shape in full_layer_shapes(config).items()
        }
        layers.append(cut_layer(config, full, s))
    return layers


def _assert_decodes_as_numpy(
    config: ModelConfig,
    s: Slice,
    layers: list[dict[str, torch.Tensor]],
    steps: int,
    seed: int,
    kv_format: str = "f32",
    sequences: int = 3,
) -> None:
    """`sequences` decoding side by side for `steps` steps (past a local layer's window if
    there is one), each slot at a position of its own: every partial of both blocks as NumPy
    computes it, and the same keys and values in the cache (stored as `kv_format`: two paths a
    float32 rounding apart may store a key a step of its rounding apart, and attend as far
    apart)."""
    context = max(16, steps + sequences)
    ours, theirs = (KVCache(config, s, sequences, context, kv_format) for _ in range(2))
    step = ROUNDING[kv_format]
    blocks = admit(config, s, layers, ours.key_arrays, ours.value_arrays)
    assert blocks is not None
    slots = (0, 2, 1) if sequences == 3 else tuple(reversed(range(sequences)))
    rope = Rope(config, context)
    local = Rope(replace(config, rope_theta=config.local_rope_theta or 0.0), context)
    rng = np.random.default_rng(seed)
    for pos in range(steps):
        batch = StepBatch(slots, tuple(pos + slot for slot in slots), (1,) * sequences)
        assert blocks.supports("attention", batch)
        cos_sin = rope.rows(batch.starts)
        local_cos_sin = local.rows(batch.starts) if config.local_rope_theta else None
        blocks.begin_step(batch, cos_sin, local_cos_sin)
        h = rng.standard_normal((sequences, config.hidden), dtype=np.float32)
        for i in range(config.n_layers):
            own = local_cos_sin if config.is_local(i) and local_cos_sin else cos_sin
            window = config.sliding_window if config.is_local(i) else None
            want = attention_rows(
                h, layers[i], s, config, own, theirs.key_arrays[i], theirs.value_arrays[i],
                batch, window,
            )  # fmt: skip
            np.testing.assert_allclose(
                blocks.attention(i, h),
                want,
                rtol=1e-4,
                atol=1e-5 + step * np.abs(want).max(initial=0),
            )
            want = ffn_rows(h, layers[i], config)
            np.testing.assert_allclose(blocks.ffn(i, h), want, rtol=1e-4, atol=1e-5)
    for i in range(config.n_layers):
        for a, b in ((ours.key_arrays[i], theirs.key_arrays[i]),
                     (ours.value_arrays[i], theirs.value_arrays[i])):  # fmt: skip
            np.testing.assert_allclose(
                a[:], b[:], rtol=1e-5, atol=1e-6 + step * np.abs(b[:]).max(initial=0)
            )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("part", SLICES)
def test_native_blocks_equal_the_numpy_blocks(family, part):
    config, s = FAMILIES[family], SLICES[part]
    _assert_decodes_as_numpy(config, s, _slice(config, s, 1), steps=7, seed=2)


@pytest.mark.parametrize("kv_format", ["f16", "q8_0"])
@pytest.mark.parametrize("part", ["whole", "heads split in a group"])
def test_native_blocks_equal_the_numpy_blocks_over_a_reduced_precision_cache(kv_format, part):
    """f16 and q8_0 caches (models/kvformat.py): C writes and reads them as NumPy does, a local
    layer's ring included; q8_0's blocks of 32 need a head_dim of 32. The cache takes the bytes
    its format says."""
    config = replace(FAMILIES["gemma-gelu-ring"], head_dim=32)
    s = SLICES[part]
    _assert_decodes_as_numpy(config, s, _slice(config, s, 1), steps=7, seed=2, kv_format=kv_format)
    cache = KVCache(config, s, 3, 16, kv_format)
    per_token = KVCache.bytes_per_token(config, s, kv_format)
    assert cache.nbytes == 3 * (16 * per_token + KVCache.window_bytes(config, s, kv_format))
    assert per_token / KVCache.bytes_per_token(config, s) == (
        0.5 if kv_format == "f16" else 34 / 128
    )


@pytest.mark.parametrize("family", ["llama", "gemma-gelu-ring"])
def test_one_call_over_every_layer_equals_the_blocks_one_by_one(family):
    """`run_layers` (a node holding the whole model: one native call a decode step) gives the
    numbers of summing each block's output into h in Python, exactly, and the same caches."""
    config, s = FAMILIES[family], SLICES["whole"]
    config = replace(config, n_layers=3, local_layers=(1,) if config.local_layers else ())
    layers = _slice(config, s, 3)
    caches = KVCache(config, s, 3, 16), KVCache(config, s, 3, 16)
    one_call, by_block = (admit(config, s, layers, c.key_arrays, c.value_arrays) for c in caches)
    assert one_call is not None and by_block is not None
    rope = Rope(config, 16)
    local = Rope(replace(config, rope_theta=config.local_rope_theta or 0.0), 16)
    rng = np.random.default_rng(4)
    for pos in range(7):  # past the local layer's window of 4
        batch = StepBatch((0, 2, 1), (pos, pos + 2, pos + 1), (1, 1, 1))
        local_cos_sin = local.rows(batch.starts) if config.local_rope_theta else None
        for blocks in (one_call, by_block):
            blocks.begin_step(batch, rope.rows(batch.starts), local_cos_sin)
        h = rng.standard_normal((3, config.hidden), dtype=np.float32)
        want = h
        for i in range(config.n_layers):
            want = want + by_block.attention(i, want)
            want = want + by_block.ffn(i, want)
        given = h.copy()
        got = one_call.run_layers(h)
        assert np.array_equal(got, want)
        assert np.array_equal(h, given)  # a copy was summed into, not the caller's array
    for ours, theirs in zip(*(c.key_arrays + c.value_arrays for c in caches), strict=True):
        assert np.array_equal(ours, theirs)


def _in_blocks(layers: list[dict[str, torch.Tensor]], dtype: str, kernel: str, monkeypatch):
    """The slice's matrices stored in block format `dtype`, and `kernel` installed for them at
    every decode row count (for this test only), as `node.device.prepare` would."""
    stored = [{k: kernels.quantize(v, dtype)[""] if k in MATRICES else v for k, v in w.items()}
              for w in layers]  # fmt: skip
    candidate = next(c for c in kernels.CANDIDATES[dtype] if c.name == kernel)
    for name in MATRICES:
        out, inp = matrix_size(stored[0][name])
        for rows in range(1, MAX_ROWS + 1):
            key = (dtype, kernels.row_bucket(rows), out, inp)
            monkeypatch.setitem(kernels._chosen, key, (candidate.name, candidate.load()))
    return stored


BLOCKS_OF_32 = [d for d in BLOCK_DTYPES if FORMATS[d].block_values == 32]


def c_build(dtype: str) -> str:
    """The C product this CPU's check times for a block format."""
    if kernels.has_avx512() and dtype in kernels.HAND_TUNED:
        return "c-f32-avx512"
    if kernels.has_avx2():
        return "c-f32" if dtype in kernels.HAND_TUNED else "c-expand"
    return "c-portable" if dtype in kernels.PORTABLE else "c-expand"


@pytest.mark.parametrize("dtype", BLOCKS_OF_32)
@pytest.mark.parametrize("family", ["llama", "qwen2-bias", "gemma-gelu-ring"])
def test_native_blocks_on_block_formats_equal_the_numpy_blocks(family, dtype, monkeypatch):
    """Weights in GGUF's block formats (the bundled model's own): the C blocks call the block
    product the device admitted, and give the NumPy path's partials through it."""
    config, s = FAMILIES[family], Slice((2, 4), (1, 2), (32, 96))  # 32-column blocks
    layers = _in_blocks(_slice(config, s, 6), dtype, c_build(dtype), monkeypatch)
    _assert_decodes_as_numpy(config, s, layers, steps=6, seed=7)


@pytest.mark.parametrize("dtype", [d for d in BLOCK_DTYPES if FORMATS[d].block_values == 256])
def test_native_blocks_on_k_quants_equal_the_numpy_blocks(dtype, monkeypatch):
    """The 256-weight formats on a layer of 256-wide matrices, its FFN cut at a block
    boundary."""
    config = replace(FAMILIES["gemma-gelu-ring"], hidden=256, head_dim=64, ffn_hidden=768)
    s = Slice((0, 4), (0, 2), (256, 768))
    # weights half the others' size: rows four times as wide give values of the others' size
    layers = _in_blocks(_slice(config, s, 6, size=0.15), dtype, c_build(dtype), monkeypatch)
    _assert_decodes_as_numpy(config, s, layers, steps=6, seed=7)


def test_c_builds_that_differ_by_row_count_still_run_natively(monkeypatch):
    """A table that chose the hand-tuned product (or its portable build) for one row and
    expand.c's for the others (a timing can fall either way): the C blocks run, on the one-row
    choice, and give the NumPy path's partials."""
    config, s = FAMILIES["llama"], Slice((2, 4), (1, 2), (32, 96))
    layers = _in_blocks(_slice(config, s, 6), "q4_1", c_build("q4_1"), monkeypatch)
    expand = next(c for c in kernels.CANDIDATES["q4_1"] if c.name == "c-expand")
    for name in MATRICES:
        out, inp = matrix_size(layers[0][name])
        for rows in range(2, MAX_ROWS + 1):
            key = ("q4_1", kernels.row_bucket(rows), out, inp)
            monkeypatch.setitem(kernels._chosen, key, (expand.name, expand.load()))
    _assert_decodes_as_numpy(config, s, layers, steps=3, seed=7)


@pytest.mark.parametrize("dtype", ["q4_1", "q4_k"])
def test_a_batch_of_max_rows_runs_on_block_products_as_numpy_does(dtype, monkeypatch):
    """MAX_ROWS sequences in one decode step (a bridge's `--max-batch 16`): one block product
    takes them all, with the partials and cache NumPy gives."""
    config, s = FAMILIES["llama"], Slice((2, 4), (1, 2), (32, 96))
    if FORMATS[dtype].block_values == 256:
        config = replace(FAMILIES["gemma-gelu-ring"], hidden=256, head_dim=64, ffn_hidden=768)
        s = Slice((0, 4), (0, 2), (256, 768))
    layers = _in_blocks(_slice(config, s, 6), dtype, c_build(dtype), monkeypatch)
    _assert_decodes_as_numpy(config, s, layers, steps=3, seed=7, sequences=MAX_ROWS)


def test_rows_past_the_c_builds_choice_run_on_numpy(monkeypatch):
    """A table that chose a C build up to FLOAT_ROWS rows and expanded blocks for BLAS past
    them: the C blocks take batches up to FLOAT_ROWS, the NumPy path the larger ones."""
    config, s = FAMILIES["llama"], Slice((2, 4), (1, 2), (32, 96))
    layers = _in_blocks(_slice(config, s, 6), "q4_1", c_build("q4_1"), monkeypatch)
    blas = next(c for c in kernels.CANDIDATES["q4_1"] if c.name == "c-expand-blas")
    for name in MATRICES:
        out, inp = matrix_size(layers[0][name])
        for rows in range(FLOAT_ROWS + 1, MAX_ROWS + 1):
            key = ("q4_1", kernels.row_bucket(rows), out, inp)
            monkeypatch.setitem(kernels._chosen, key, (blas.name, blas.load()))
    cache = KVCache(config, s, MAX_ROWS, 8)
    blocks = admit(config, s, layers, cache.key_arrays, cache.value_arrays)
    assert blocks is not None and blocks.max_rows == FLOAT_ROWS
    decode = [StepBatch(tuple(range(n)), (0,) * n, (1,) * n) for n in (FLOAT_ROWS, FLOAT_ROWS + 1)]
    assert [blocks.supports("ffn", batch) for batch in decode] == [True, False]
    _assert_decodes_as_numpy(config, s, layers, steps=2, seed=7, sequences=FLOAT_ROWS)


def test_block_formats_on_another_kernel_run_on_numpy(monkeypatch):
    """A block format the device multiplies by expanding it to float32 (its C builds rejected
    here): the C blocks have no product to call, and the NumPy path runs it."""
    s = Slice((0, 4), (0, 2), (0, 96))
    layers = _in_blocks(_slice(BASE, s, 8), "q4_1", "dequant-f32", monkeypatch)
    cache = KVCache(BASE, s, 1, 8)
    assert admit(BASE, s, layers, cache.key_arrays, cache.value_arrays) is None


def test_a_slice_in_another_dtype_runs_on_numpy():
    layers = [{k: v.half() if k.startswith("w") else v for k, v in w.items()}
              for w in _slice(BASE, SLICES["whole"], 3)]  # fmt: skip
    cache = KVCache(BASE, SLICES["whole"], 1, 8)
    assert admit(BASE, SLICES["whole"], layers, cache.key_arrays, cache.value_arrays) is None


@pytest.fixture
def link():
    """A master's ROUTER and a worker's DEALER on a random loopback port."""
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.setsockopt(zmq.IDENTITY, b"w1")
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    assert router.recv_multipart() == [b"w1", b"hello"]
    yield router, dealer
    router.close(0)
    dealer.close(0)
    context.term()


def test_the_worker_loop_answers_steps_and_hands_back_the_rest(link):
    router, dealer = link
    config, s = BASE, SLICES["a group"]
    cache = KVCache(config, s, 2, 16)
    blocks = NativeBlocks(config, s, _slice(config, s, 4), cache.key_arrays, cache.value_arrays)
    reference = NativeBlocks(config, s, blocks.layers, *(
        [a.copy() for a in arrays] for arrays in (cache.key_arrays, cache.value_arrays)
    ))  # fmt: skip
    batch = StepBatch((0, 1), (3, 5), (1, 1))
    rope = Rope(config, 16)
    for b in (blocks, reference):
        b.begin_step(batch, rope.rows(batch.starts), None)
    hop = WorkerHop(dealer, blocks)
    hop.begin_step(batch.size)
    h = np.random.default_rng(5).standard_normal((2, config.hidden), dtype=np.float32)

    assert hop.serve(20) == TIMEOUT  # nothing sent yet
    router.send_multipart([b"w1", *M.encode(M.Step(step=7, layer=0, block=P.FFN), (h,))])
    router.send_multipart([b"w1", *M.encode(M.Step(step=7, layer=1, block=P.ATTENTION), (h,))])
    # --wire float16: the hidden state comes as float16, and its partial goes back so
    h16 = M.for_the_wire(h, "float16")
    router.send_multipart([b"w1", *M.encode(M.Step(step=7, layer=0, block=P.ATTENTION), (h16,))])
    bye = [msgpack.packb({"op": "bye", "reason": "test"})]
    router.send_multipart([b"w1", *bye])
    assert hop.serve(2000) == FOREIGN  # three partials sent, the BYE held for Python
    assert hop.frames() == bye
    for block, want in (
        (P.FFN, reference.ffn(0, h)),
        (P.ATTENTION, reference.attention(1, h)),
        (P.ATTENTION, reference.attention(0, h16.astype(np.float32)).astype(np.float16)),
    ):
        identity, *frames = router.recv_multipart()
        message, (partial,) = M.decode_from_node(frames)
        assert identity == b"w1"
        assert isinstance(message, M.Partial) and (message.step, message.block) == (7, block)
        assert message.compute > 0
        assert partial.dtype == want.dtype
        np.testing.assert_array_equal(partial, want)
    assert hop.state.blocks == 3

    # The last layer's FFN carries the step's figures: Python's, as is a step with its batch.
    for step in (
        M.Step(step=7, layer=config.n_layers - 1, block=P.FFN),
        M.Step(step=8, layer=0, block=P.ATTENTION, batch=batch),
    ):
        frames = M.encode(step, (h,))
        router.send_multipart([b"w1", *frames])
        assert hop.serve(2000) == FOREIGN
        assert hop.frames() == [bytes(f) for f in frames]
    hop.close()


def test_a_device_without_the_native_loop_says_why_and_serves_from_python(monkeypatch, caplog):
    """No libzmq to call (pyzmq built with it inside its own module, say): the loop is not
    available, once logged, and the engine and the worker keep their Python path."""
    import edgetp.node.hop as hop

    def missing() -> str:
        raise RuntimeError("cannot find the libzmq pyzmq loaded")

    monkeypatch.setattr(hop, "_lib", None)
    monkeypatch.setattr(hop, "_unavailable", None)
    monkeypatch.setattr(hop, "_libzmq_path", missing)
    with caplog.at_level("INFO", logger="edgetp.node.hop"):
        assert not hop.available() and not hop.available()
    assert [r.getMessage() for r in caplog.records] == [
        "decode steps' messages go through Python: cannot find the libzmq pyzmq loaded"
    ]
