"""Block-quantized matrices, kept as GGUF stores them: 32 weights a block, each with its scale.

A matrix (out, in) in one of these formats is a uint8 tensor (out, in / 32, block bytes): each
row its blocks, byte for byte as in a GGUF file, so a GGUF tensor of the same format is carried
into the shards without a round trip through float, and a row range is a slice of rows.

- q4_0: an f16 scale d and 32 4-bit values q: w = d * (q - 8)            (18 bytes, 4.5 bits)
- q4_1: an f16 scale d, an f16 minimum m, 32 4-bit values: w = d * q + m  (20 bytes, 5 bits)
- q8_0: an f16 scale d and 32 int8 values: w = d * q                      (34 bytes, 8.5 bits)

The block size in bytes tells the formats apart, so a tensor's shape says what it holds. The
arithmetic (quantize, dequantize) is the `gguf` package's, the reference llama.cpp's files are
written with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from models.dtypes import BLOCK_DTYPES

BLOCK = 32  # weights per block, along a matrix's input dimension
# Stored bytes the gguf package expands in a call: its temporaries are a few times what it returns.
DEQUANT_BYTES = 1 << 20


def dequantize_rows(rows: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """`rows` as GGUF stores them in `ggml_type` (a row each: its blocks' bytes as uint8, or its
    numbers) as float32 values (rows, values a row), by the gguf package's arithmetic.

    The package loops in Python over every 16 rows it is given: expanding SmolLM2's q4_1 file
    to float32 so took 1.8 s of an engine's 3.6 s of loading. A block's values do not depend on
    its row, so it is given bands of about DEQUANT_BYTES as one row each."""
    rows = np.ascontiguousarray(rows)
    n, width = rows.shape
    if rows.dtype == np.uint8:  # blocks
        block_values, block_bytes = GGML_QUANT_SIZES[ggml_type]
        width = width // block_bytes * block_values
    out = np.empty((n, width), np.float32)
    band = max(1, DEQUANT_BYTES // max(1, rows[:1].nbytes))
    for a in range(0, n, band):
        part = rows[a : a + band]
        out[a : a + len(part)] = quants.dequantize(part.reshape(1, -1), ggml_type).reshape(
            len(part), width
        )
    return out


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: GGMLQuantizationType
    block_bytes: int

    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        """A float matrix (out, in), in a multiple of 32, as blocks (out, in / 32, bytes)."""
        out, inp = w.shape
        if inp % BLOCK:
            raise ValueError(
                f"{self.name} needs rows of a multiple of {BLOCK}, got {inp}: "
                "this model (or this split of it) needs another --dtype"
            )
        if w.numel() == 0 or w.is_meta:  # a node's empty share; a shape only
            shape = (out, inp // BLOCK, self.block_bytes)
            return torch.empty(shape, dtype=torch.uint8, device=w.device)
        blocks = quants.quantize(w.float().numpy(), self.ggml_type)
        return torch.from_numpy(np.ascontiguousarray(blocks)).view(out, inp // BLOCK, -1)

    def dequantize(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks (rows, in / 32, bytes) as a float32 matrix (rows, in)."""
        rows, n, _ = blocks.shape
        if blocks.numel() == 0:
            return torch.zeros((rows, n * BLOCK))
        flat = blocks.numpy().reshape(rows, n * self.block_bytes)
        return torch.from_numpy(dequantize_rows(flat, self.ggml_type)).view(rows, n * BLOCK)


FORMATS = {
    f.name: f
    for f in (
        BlockFormat("q8_0", GGMLQuantizationType.Q8_0, 34),
        BlockFormat("q4_1", GGMLQuantizationType.Q4_1, 20),
        BlockFormat("q4_0", GGMLQuantizationType.Q4_0, 18),
    )
}
assert tuple(FORMATS) == BLOCK_DTYPES, "models/dtypes.py names the same formats"
_BY_BLOCK_BYTES = {f.block_bytes: f for f in FORMATS.values()}


def block_format(w: torch.Tensor) -> BlockFormat | None:
    """The format of a block-quantized matrix, None for a plain one."""
    return stored_format(w.dtype, tuple(w.shape))


def stored_format(dtype: torch.dtype, shape: tuple[int, ...]) -> BlockFormat | None:
    """The format a stored tensor of this dtype and shape is in, None for a plain one."""
    if dtype != torch.uint8 or len(shape) != 3:
        return None
    found = _BY_BLOCK_BYTES.get(shape[2])
    if found is None:
        raise ValueError(f"blocks of {shape[2]} bytes are none of {', '.join(FORMATS)}")
    return found


def matrix_size(w: torch.Tensor) -> tuple[int, int]:
    """(out, in) of a stored matrix, plain or in blocks."""
    return stored_size(w.dtype, tuple(w.shape))


def stored_size(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
    if stored_format(dtype, shape) is not None:
        return shape[0], shape[1] * BLOCK
    return shape[0], shape[1]


def take_columns(w: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) of a stored matrix (a view), plain or in blocks: blocks are cut
    between blocks only."""
    if block_format(w) is None:
        return w[:, start:stop]
    if start % BLOCK or stop % BLOCK:
        raise ValueError(
            f"columns {start}:{stop} cut through blocks of {BLOCK}: "
            "this split of the model needs a plain --dtype (f32, f16, bf16, int8)"
        )
    return w[:, start // BLOCK : stop // BLOCK]
