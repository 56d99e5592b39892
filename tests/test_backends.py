"""Which backend computes each block (models/backends.py): the first of a device's order that
says it does, the C blocks for a decode batch they hold, NumPy rows for the rest of a decode
step, torch for any other step and for what the others lack."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from edgetp.memory.window import ResidentLayers
from edgetp.models.backends import BLOCKS, BlockBackend, RowBlocks, TorchBlocks, first_capable
from edgetp.models.config import ModelConfig
from edgetp.models.kvformat import ROUNDING
from edgetp.models.layers import Slice, StepBatch, full_layer_shapes, slice_layer
from edgetp.models.rows_native import FLOAT_ROWS, NativeBlocks
from edgetp.node.executor import make_executor
from edgetp.node.kvcache import KVCache

BASE = ModelConfig(
    architecture="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16,
    ffn_hidden=96, vocab_size=100, context_length=64, norm_eps=1e-5, rope_theta=10000.0,
)  # fmt: skip
WHOLE = Slice((0, 4), (0, 2), (0, 96))


def _slice(config: ModelConfig, s: Slice, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = full_layer_shapes(config)
    full = [{n: torch.randn(shape, generator=gen) * 0.3 for n, shape in shapes.items()}
            for _ in range(config.n_layers)]  # fmt: skip
    return [slice_layer(config, layer, s) for layer in full]


def _decode(rows: int) -> StepBatch:
    return StepBatch(tuple(range(rows)), (3,) * rows, (1,) * rows)


def _chosen(backends: list[BlockBackend], batch: StepBatch) -> dict[str, str]:
    return {block: first_capable(backends, block, batch).name for block in BLOCKS}


def test_each_block_runs_on_the_first_backend_that_computes_it() -> None:
    cache = KVCache(BASE, WHOLE, FLOAT_ROWS + 1, 16)
    layers = _slice(BASE, WHOLE, seed=0)
    views = [(BASE, WHOLE)] * BASE.n_layers
    device = [
        NativeBlocks(BASE, WHOLE, layers, cache.key_arrays, cache.value_arrays),
        RowBlocks(BASE, WHOLE, cache.key_arrays, cache.value_arrays),
        TorchBlocks(BASE, WHOLE, views, cache.keys, cache.values, None),
    ]
    # float32 weights: an sgemv a row in the C blocks, up to FLOAT_ROWS rows
    assert _chosen(device, _decode(FLOAT_ROWS)) == {
        "attention": "c", "ffn": "c", "experts": "numpy", "linear": "torch",
    }  # fmt: skip
    assert _chosen(device, _decode(FLOAT_ROWS + 1)) == {
        "attention": "numpy", "ffn": "numpy", "experts": "numpy", "linear": "torch",
    }  # fmt: skip
    prompt = StepBatch((0,), (0,), (5,))
    assert set(_chosen(device, prompt).values()) == {"torch"}
    # Gemma 4's attention (a value norm, KV shared across layers): torch's, in a decode step too
    gemma4_like = replace(BASE, value_norm=True)
    rows = RowBlocks(gemma4_like, WHOLE, cache.key_arrays, cache.value_arrays)
    assert _chosen([rows, device[2]], _decode(1))["attention"] == "torch"


def test_a_decode_step_computes_as_its_backends_do() -> None:
    """The executor's partials for a decode step are those of the backend it chose: the same
    numbers as calling that backend's math on the same state."""
    layers = _slice(BASE, WHOLE, seed=1)
    ours = make_executor(BASE, WHOLE, ResidentLayers(layers), 16, 2)
    theirs = make_executor(BASE, WHOLE, ResidentLayers(layers), 16, 2)
    rng = np.random.default_rng(0)
    for pos in range(3):
        batch = StepBatch((0, 1), (pos, pos), (1, 1))
        ours.begin_step(batch)
        theirs.begin_step(batch)
        rows = theirs.backends[0]
        assert isinstance(rows, RowBlocks)  # no C blocks admitted: NumPy's rows
        for i in range(BASE.n_layers):
            h = rng.standard_normal((2, BASE.hidden), dtype=np.float32)
            w = layers[i]
            assert np.array_equal(ours.attention(i, h), rows.attention(i, h, w))
            assert np.array_equal(ours.ffn(i, h), rows.ffn(i, h, w))


def test_a_kv_cache_takes_memory_only_as_its_positions_are_written() -> None:
    """A cache of 16 slots x 8192 positions (537 MB at f32, 143 MB at q8_0) adds to the
    process's resident memory only the pages its written positions are on: a device that
    serves short answers does not hold its whole context's worth from the start."""
    config = replace(BASE, n_layers=8, context_length=8192, head_dim=32)  # q8_0's blocks
    for kv_format in ("f32", "f16", "q8_0"):
        before = _resident_bytes()
        cache = KVCache(config, WHOLE, 16, 8192, kv_format)
        grown = _resident_bytes() - before
        assert grown < 0.05 * cache.nbytes, (kv_format, grown, cache.nbytes)
        written = torch.full((2, 8, 32), 127.0)  # a prompt's 8 positions
        cache.keys[0][0, :, :8] = written
        step = ROUNDING[kv_format] * 127  # f32 and f16 hold it exactly
        torch.testing.assert_close(cache.keys[0][0, :, :8].float(), written, rtol=0, atol=step)
        assert not cache.keys[0][1:].any() and not cache.values[7][:].any()
        print(f"{kv_format}: {cache.nbytes / 1e6:.0f} MB allocated, resident {grown / 1e6:.1f} MB")
        del cache


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_q8_0_cache_turns_each_block_so_one_large_channel_does_not_round_the_rest_away():
    """q8_0 rows are stored turned by the 32-point Walsh-Hadamard transform (models/kvformat.py):
    torch's writes and NumPy's hold the same codes and read back the same floats; what a row
    reads back is within the turned block's rounding of what was written; and a key with one
    large channel keeps its small ones several times better than rounding it as it is would."""
    from edgetp.models.kvformat import Q8_BLOCK, kv_arrays, kv_tensor

    rng = np.random.default_rng(7)
    keys = rng.standard_normal((2, 3, 5, 64)).astype(np.float32)
    keys[..., 0, 3] = 40.0  # one position's large channel
    tensor = kv_tensor("q8_0", keys.shape)
    arrays = kv_arrays(kv_tensor("q8_0", keys.shape))
    tensor[:] = torch.from_numpy(keys)
    arrays[:] = keys
    assert np.array_equal(tensor.codes.numpy(), arrays.codes)
    assert np.array_equal(tensor.scales.numpy(), arrays.scales)
    read = arrays[:]
    assert np.array_equal(tensor[:].numpy(), read)
    # within the rounding: half a step a value in the turned block, and 127 steps of the f16
    # scale's own rounding (2^-11), its norm kept by the turn
    steps = arrays.scales.astype(np.float64)
    error = np.linalg.norm((read - keys).reshape(*steps.shape, Q8_BLOCK), axis=-1)
    assert np.all(error <= (0.5 + 127 * 2.0**-11) * np.sqrt(Q8_BLOCK) * steps)
    # the large channel's block, against plain q8_0 (a step of amax / 127 for every value)
    block, small = keys[0, 0, 0, :Q8_BLOCK], np.arange(Q8_BLOCK) != 3
    plain_step = np.abs(block).max() / 127
    plain = np.round(block / plain_step) * plain_step
    turned_error = np.abs(read[0, 0, 0, :Q8_BLOCK] - block)[small].mean()
    plain_error = np.abs(plain - block)[small].mean()
    print(f"\nsmall channels' mean error: turned {turned_error:.4f}, plain {plain_error:.4f}")
    assert turned_error * 3 < plain_error
