"""Block-quantized matrices, kept as GGUF stores them: blocks of 32 or 256 weights, each with its
scales.

A matrix (out, in) in one of these formats is a tensor of bytes (out, in / block, block bytes):
each row its blocks, byte for byte as in a GGUF file, so a GGUF tensor of the same type is
carried into the shards without a round trip through float, and a row range is a slice of rows.

- blocks of 32: q4_0, q4_1, q5_0, q5_1, q8_0 (an f16 scale, for _1 an f16 minimum, and 4, 5
  or 8 bits a weight), mxfp4 (a power-of-two scale and 4-bit floats: gpt-oss's experts);
- blocks of 256 (llama.cpp's K-quants): q2_k, q3_k, q4_k, q5_k, q6_k (a scale, for some a
  minimum, per 16 or 32 weights, themselves quantized against the block's f16 scales), iq4_xs
  (4-bit indices into a fixed non-linear table, a 6-bit scale per 32);
- iq4_nl: iq4_xs's table in blocks of 32 with an f16 scale, laid out as q4_0.

A stored tensor says its format by its element dtype and its block size in bytes
(`stored_format`): every format's blocks are uint8 but iq4_nl's, whose 18 bytes are q4_0's, so
its tensors are int8 (a plain int8 matrix has two dimensions, blocks three). The tag is the
tensor's own dtype, so it goes wherever the tensor goes: a slice, a shard file's header, a
window's buffer.
The arithmetic (dequantize, and quantize where the package has it) is the `gguf` package's,
the reference llama.cpp's files are written with (models/kquants.py and models/iquants.py
quantize what it cannot); the C products (models/csrc) expand blocks as it does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from edgetp.models.dtypes import BLOCK_DTYPES, EXACT_WIDENING
from edgetp.models.iquants import IQ4NL_VALUES, quantize_iq4_nl, quantize_iq4_xs
from edgetp.models.kquants import K_QUANTIZERS

BLOCK = 32  # the smallest block, along a matrix's input dimension
# The formats quantized here; the `gguf` package quantizes the other blocks of 32.
QUANTIZERS = {**K_QUANTIZERS, "iq4_nl": quantize_iq4_nl, "iq4_xs": quantize_iq4_xs}
# The element dtype of a format's stored tensors where it is not uint8 (the module's docstring)
TAGGED_ELEMENTS = {"iq4_nl": torch.int8}
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

    @property
    def block_values(self) -> int:
        """Weights a block holds: 32, or 256 for the K-quants and IQ4_XS."""
        return GGML_QUANT_SIZES[self.ggml_type][0]

    @property
    def block_bytes(self) -> int:
        return GGML_QUANT_SIZES[self.ggml_type][1]

    @property
    def element(self) -> torch.dtype:
        """The dtype of this format's stored tensors: its tag beside its block size."""
        return TAGGED_ELEMENTS.get(self.name, torch.uint8)

    def from_bytes(self, raw: np.ndarray) -> torch.Tensor:
        """Rows of blocks as a file stores them (rows, bytes a row: uint8) as a stored matrix
        (rows, blocks a row, block bytes) of this format, without a copy."""
        return torch.from_numpy(raw).view(self.element).view(len(raw), -1, self.block_bytes)

    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        """A float matrix (out, in), in a multiple of the block, as blocks (out, in / block,
        bytes)."""
        out, inp = w.shape
        v = self.block_values
        if inp % v:
            raise ValueError(
                f"{self.name} needs rows of a multiple of {v}, got {inp}: "
                "this model (or this split of it) needs another --dtype"
            )
        if w.numel() == 0 or w.is_meta:  # a node's empty share; a shape only
            shape = (out, inp // v, self.block_bytes)
            return torch.empty(shape, dtype=self.element, device=w.device)
        values = w.float().numpy()
        if self.name in QUANTIZERS:
            blocks = QUANTIZERS[self.name](values.reshape(-1, v))
        else:
            blocks = quants.quantize(values, self.ggml_type)
        return self.from_bytes(np.ascontiguousarray(blocks).reshape(out, -1))

    def dequantize(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks (rows, in / block, bytes) as a float32 matrix (rows, in)."""
        rows, n, _ = blocks.shape
        if blocks.numel() == 0:
            return torch.zeros((rows, n * self.block_values))
        flat = blocks.view(torch.uint8).numpy().reshape(rows, n * self.block_bytes)
        values = dequantize_rows(flat, self.ggml_type)
        return torch.from_numpy(values).view(rows, n * self.block_values)


FORMATS = {name: BlockFormat(name, GGMLQuantizationType[name.upper()]) for name in BLOCK_DTYPES}
_BY_LAYOUT = {(f.element, f.block_bytes): f for f in FORMATS.values()}
assert len(_BY_LAYOUT) == len(FORMATS), "an element dtype and a block size name one format"
_ELEMENTS = {f.element for f in FORMATS.values()}


def block_format(w: torch.Tensor) -> BlockFormat | None:
    """The format of a block-quantized matrix, None for a plain one."""
    return stored_format(w.dtype, tuple(w.shape))


def stored_format(dtype: torch.dtype, shape: tuple[int, ...]) -> BlockFormat | None:
    """The format a stored tensor of this dtype and shape is in, None for a plain one (a plain
    matrix has two dimensions, blocks three)."""
    if dtype not in _ELEMENTS or len(shape) != 3:
        return None
    found = _BY_LAYOUT.get((dtype, shape[2]))
    if found is None:
        raise ValueError(
            f"{dtype} blocks of {shape[2]} bytes are none of {', '.join(FORMATS)}: the shard "
            "was not written by this version of edgetp; split the model again"
        )
    return found


def matrix_size(w: torch.Tensor) -> tuple[int, int]:
    """(out, in) of a stored matrix, plain or in blocks."""
    return stored_size(w.dtype, tuple(w.shape))


def stored_size(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
    found = stored_format(dtype, shape)
    if found is not None:
        return shape[0], shape[1] * found.block_values
    return shape[0], shape[1]


def columns_fit(dtype: str, start: int, stop: int) -> bool:
    """Whether columns [start, stop) of a matrix in shard dtype `dtype` are whole blocks."""
    found = FORMATS.get(dtype)
    return found is None or (start % found.block_values == 0 and stop % found.block_values == 0)


def take_columns(w: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Columns [start, stop) of a stored matrix (a view), plain or in blocks: blocks are cut
    between blocks only."""
    found = block_format(w)
    if found is None:
        return w[:, start:stop]
    v = found.block_values
    if start % v or stop % v:
        raise ValueError(
            f"columns {start}:{stop} cut through {found.name}'s blocks of {v}: "
            "this split of the model needs a plain --dtype (f32, f16, bf16, int8)"
        )
    return w[:, start // v : stop // v]


def widen(blocks: torch.Tensor, to: str) -> torch.Tensor:
    """Blocks of q4_0, q5_0 or iq4_nl as q8_0 blocks of the same values, exactly
    (EXACT_WIDENING)."""
    found = block_format(blocks)
    assert found is not None and (found.name, to) in EXACT_WIDENING, (found, to)
    rows, n, size = blocks.shape
    b = blocks.view(torch.uint8).numpy().reshape(-1, size)
    qs = b[:, size - 16 :]  # all end in 16 bytes of nibbles: elements j (low) and j + 16 (high)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int16)
    if found.name == "q5_0":  # bit j of qh (bytes 2-5, little-endian) is element j's fifth bit
        qh = b[:, 2:6].copy().view("<u4")
        q |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
        q -= 16
    elif found.name == "iq4_nl":
        q = IQ4NL_VALUES[q].astype(np.int16)
    else:
        q -= 8
    out = np.empty((len(b), 34), np.uint8)
    out[:, :2] = b[:, :2]  # the f16 scale d
    out[:, 2:] = q.astype(np.int8).view(np.uint8)
    return torch.from_numpy(out).view(rows, n, 34)


# Where each format keeps its f16 scales (and minimums) in a block, as ggml-common.h lays them
# out, and the largest integer a scale multiplies (a quantized weight times its sub-block's
# scale). MXFP4's scale is its first byte, a power of two (E8M0).
_F16_FIELDS = {
    "q4_0": ((0,), 8), "q4_1": ((0, 2), 15), "q5_0": ((0,), 16), "q5_1": ((0, 2), 31),
    "q8_0": ((0,), 127), "q2_k": ((80, 82), 45), "q3_k": ((108,), 128),
    "q4_k": ((0, 2), 945), "q5_k": ((0, 2), 1953), "q6_k": ((208,), 4064),
    "iq4_xs": ((0,), 4064), "iq4_nl": ((0,), 127), "mxfp4": ((), 12),
}  # fmt: skip


def random_blocks(fmt: BlockFormat, out: int, inp: int, gen: np.random.Generator) -> torch.Tensor:
    """A matrix (out, inp) of random blocks of `fmt`: random integers and sub-block scales,
    and block scales that keep the weights under about 1 / sqrt(inp), as a layer's are (random
    bytes there could be inf or nan). Every integer and scale a block can hold, where a
    quantizer's blocks hold only those it picks: the checks of another architecture's builds
    multiply these (tests/test_arm.py)."""
    n = inp // fmt.block_values
    raw = gen.integers(0, 256, size=(out, n, fmt.block_bytes), dtype=np.uint8)
    fields, largest = _F16_FIELDS[fmt.name]
    size = 1 / (largest * max(inp, 1) ** 0.5)
    for at in fields:
        scales = gen.uniform(0.5, 1.5, size=(out, n)) * size
        raw[:, :, at : at + 2] = scales.astype(np.float16).view(np.uint8).reshape(out, n, 2)
    if fmt.name == "mxfp4":  # 2^(e - 128) near `size`
        e = 128 + int(np.floor(np.log2(size)))
        raw[:, :, 0] = gen.integers(e - 1, e + 2, size=(out, n))
    return fmt.from_bytes(raw.reshape(out, -1))
