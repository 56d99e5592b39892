"""How a KV cache stores its keys and values: float32, f16, or q8_0 (GGUF's blocks of 32 int8
along head_dim, each with an f16 scale). Only storage changes: every path reads a cache back as
float32 and attends in float32.

A q8_0 cache is two arrays, the codes (..., hd) and the scales (..., hd / 32), behind `Q8Tensor`
(torch, the prefill path) and `Q8Arrays` (NumPy, the decode rows, sharing the same memory). Both
index like the float cache they stand for, on any axis but head_dim: reading dequantizes,
writing quantizes. Quantizing is GGUF's (d = amax / 127, q = round(x / d)), rounding half to
even as models/csrc/rows.c does, so the three paths hold the same codes for the same keys.

A q8_0 row is stored turned: each block of 32 by the orthonormal 32-point Walsh-Hadamard
transform (its own inverse), rounded, and turned back as it is read. A key's few large channels
set its block's scale and round the rest to a few steps; turned, every value of the block shares
them, and the error is spread evenly. Over 4,096 tokens of SmolLM2 against float32 KV: top-1
agreement 0.9851 -> 0.9912, KL-divergence 3.5e-4 -> 1.6e-4 (docs/bench/README.md, KV cache
formats). Read back, the transform is taken of the int8 codes, in integers, then scaled: exact,
so every path reads the same floats.
"""

from __future__ import annotations

import math
import mmap
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from edgetp.models.errors import ModelError

KV_FORMATS = ("f32", "f16", "q8_0")
DEFAULT_KV_FORMAT = "f32"
Q8_BLOCK = 32  # values a q8_0 scale covers
# One step of a format's rounding, relative to what it stores (q8_0: to its block's largest
# value): two paths that compute a key a float32 rounding apart may store it a step apart, and
# their attention differ by about as much (models/rows_native.py's check allows for it).
ROUNDING = {"f32": 0.0, "f16": 2.0**-10, "q8_0": 1 / 127}
# The transform's normalization, 1 / sqrt(32) as float32: rows.c's HADAMARD_SCALE
HADAMARD_SCALE = np.float32(1 / math.sqrt(Q8_BLOCK))


def hadamard_blocks(blocks: Any, cat: Any) -> Any:
    """The unnormalized Walsh-Hadamard transform of each block (..., 32) of an array or tensor
    (`cat`: np.concatenate or torch.cat): five rounds of pairwise sums and differences in
    rows.c's order, so that float inputs give every path the same bits, and int codes exact
    sums."""
    n, h = blocks.shape[-1], 1
    while h < n:
        pairs = blocks.reshape(*blocks.shape[:-1], n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        blocks = cat([a + b, a - b], -1).reshape(*blocks.shape[:-1], n)
        h *= 2
    return blocks


def untouched_zeros(shape: tuple[int, ...], dtype: npt.DTypeLike) -> torch.Tensor:
    """Zeros in pages of their own that the kernel maps only as they are written (an anonymous
    mapping): torch.zeros writes every byte, committing a whole cache at start (1.5 GB in 1 s)
    that a device may fill only in part, and calloc may hand back used heap it must clear."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return torch.from_numpy(np.zeros(shape, dtype))
    return torch.from_numpy(np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape))


def row_bytes(kv_format: str, head_dim: int) -> int:
    """The bytes of one head's key (or value) at one position."""
    if kv_format == "f32":
        return 4 * head_dim
    if kv_format == "f16":
        return 2 * head_dim
    if kv_format == "q8_0":
        _check_q8(head_dim)
        return head_dim + 2 * (head_dim // Q8_BLOCK)
    raise ModelError(f"KV cache format {kv_format!r}: give one of {', '.join(KV_FORMATS)}")


def _check_q8(head_dim: int) -> None:
    if head_dim % Q8_BLOCK:
        raise ModelError(
            f"a q8_0 KV cache needs a head_dim that is a multiple of {Q8_BLOCK}, not {head_dim}: "
            "give --kv-cache f16"
        )


class Q8Tensor:
    """A q8_0 cache of `shape` (..., hd) in torch: reads give float32, writes quantize."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        _check_q8(shape[-1])
        self.codes = untouched_zeros(shape, np.int8)
        self.scales = untouched_zeros((*shape[:-1], shape[-1] // Q8_BLOCK), np.float16)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def __getitem__(self, index: Any) -> torch.Tensor:
        codes, scales = self.codes[index], self.scales[index].float() * float(HADAMARD_SCALE)
        turned = hadamard_blocks(codes.reshape(*scales.shape, Q8_BLOCK).int(), torch.cat)
        return (turned.float() * scales.unsqueeze(-1)).reshape(codes.shape)

    def __setitem__(self, index: Any, x: torch.Tensor) -> None:
        x = x.float()
        blocks = hadamard_blocks(x.reshape(*x.shape[:-1], -1, Q8_BLOCK), torch.cat)
        blocks = blocks * float(HADAMARD_SCALE)
        d = blocks.abs().amax(-1) / 127
        inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        codes = torch.round(blocks * inverse.unsqueeze(-1)).to(torch.int8)
        self.codes[index] = codes.reshape(x.shape)
        self.scales[index] = d.to(torch.float16)


class Q8Arrays:
    """`Q8Tensor`'s memory as NumPy arrays, for the decode rows: the same reads and writes."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray) -> None:
        self.codes, self.scales = codes, scales

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    def __getitem__(self, index: Any) -> np.ndarray:
        codes, scales = self.codes[index], self.scales[index].astype(np.float32) * HADAMARD_SCALE
        turned = hadamard_blocks(
            codes.reshape(*scales.shape, Q8_BLOCK).astype(np.int32), np.concatenate
        )
        return (turned.astype(np.float32) * scales[..., None]).reshape(codes.shape)

    def __setitem__(self, index: Any, x: np.ndarray) -> None:
        x = np.asarray(x, np.float32)
        blocks = hadamard_blocks(x.reshape(*x.shape[:-1], -1, Q8_BLOCK), np.concatenate)
        blocks = blocks * HADAMARD_SCALE
        d = np.abs(blocks).max(-1) / np.float32(127)
        inverse = np.divide(1, d, out=np.zeros_like(d), where=d > 0)
        self.codes[index] = np.rint(blocks * inverse[..., None]).astype(np.int8).reshape(x.shape)
        self.scales[index] = d.astype(np.float16)


KVTensor: TypeAlias = torch.Tensor | Q8Tensor
KVArrays: TypeAlias = np.ndarray | Q8Arrays


def kv_tensor(kv_format: str, shape: tuple[int, ...]) -> KVTensor:
    """A zero-filled cache of `shape` (..., hd) stored as `kv_format`."""
    row_bytes(kv_format, shape[-1])  # a format it knows, a head_dim it can hold
    if kv_format == "q8_0":
        return Q8Tensor(shape)
    return untouched_zeros(shape, np.float16 if kv_format == "f16" else np.float32)


def kv_arrays(t: KVTensor) -> KVArrays:
    """The same memory as NumPy, for the decode path."""
    if isinstance(t, Q8Tensor):
        return Q8Arrays(t.codes.numpy(), t.scales.numpy())
    return t.numpy()


def format_of(a: KVArrays) -> str:
    """The format a cache's arrays store."""
    if isinstance(a, Q8Arrays):
        return "q8_0"
    return "f16" if a.dtype == np.float16 else "f32"


def kv_parts(a: KVArrays) -> tuple[np.ndarray, ...]:
    """The arrays a cache is stored in: itself, or a q8_0 cache's codes and scales."""
    return (a.codes, a.scales) if isinstance(a, Q8Arrays) else (a,)
