"""Exact or int8 activations: how a block-format product treats its input rows.

"exact" multiplies the stored weights' values by the float32 rows. "int8" rounds each row to
int8 a block first and sums integer products a block (models/csrc/blocks.c):
- for the blocks of 32, as llama.cpp's quantize_row_q8_0: d = max|x| / 127, q = x * (1/d) to
  the nearest integer (ties to even; the kernels' vroundps and nearbyintf give the same bytes),
  and s = d * sum(q) for the formats with a minimum (llama.cpp's Q8_1);
- for the K-quants' blocks of 256, as quantize_row_q8_K: m the value of largest |x| (the first
  of several), iscale = -127 / m, q = iscale * x to the nearest, at most 127, d = 1 / iscale.
The functions here are that arithmetic in NumPy: the reference the kernels are checked against
(node/kernel_probe.py, the tests).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import numpy as np

Activations = Literal["exact", "int8"]
ACTIVATIONS: tuple[Activations, ...] = ("exact", "int8")
# `--activations auto`: int8 for a model whose matrices include these 4- to 6-bit formats, exact
# otherwise. Measured the field's way (docs/bench/README.md): on a Q4_1 and a Q4_K_M file,
# int8's mean KL-divergence from exact was 1.05x and 0.96x llama.cpp's own int8 cost on the same
# file and text, for 0.70-0.75x of exact's decode time; on 8-bit and float weights, whose own
# error is far smaller, no such measurement stands behind it. Not the commands' default: int8
# rounding turns the float noise of a batch's shape (attention over a batch, 1e-7) into other
# integers now and then, so a text's answer or embedding depends on what it is batched with
# (an embedding alone and beside two others: cosine 0.9998; exact's agree to 3e-7).
AUTO_INT8_FORMATS = frozenset({"q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "q4_k", "q6_k"})


def check_activations(mode: str) -> Activations:
    """`mode` as one of ACTIVATIONS, else ValueError."""
    for known in ACTIVATIONS:
        if mode == known:
            return known
    raise ValueError(f"activations {mode!r}: choose {' or '.join(ACTIVATIONS)}")


def default_activations(dtypes: Iterable[str]) -> Activations:
    """`auto`'s choice for a model whose matrices are stored in `dtypes`."""
    return "int8" if AUTO_INT8_FORMATS.intersection(dtypes) else "exact"


BLOCK = 32  # values a scale covers
K_BLOCK = 256  # the same for the K-quants


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows x (R, K), K a multiple of 32, as (q int8 (R, K), d (R, K/32), s (R, K/32)), float32
    as the C kernels compute them."""
    rows, inp = x.shape
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(rows, inp // BLOCK, BLOCK)
    d = np.abs(blocks).max(axis=2) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse[:, :, None]).astype(np.int8)
    s = d * q.sum(axis=2, dtype=np.int32).astype(np.float32)
    return q.reshape(rows, inp), d, s


def quantize_rows_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows x (R, K), K a multiple of 256, as a K-quant's int8 kernels round them: (q int8 (R, K),
    d float32 (R, K/256))."""
    rows, inp = x.shape
    blocks = np.ascontiguousarray(x, dtype=np.float32).reshape(rows, inp // K_BLOCK, K_BLOCK)
    first = np.abs(blocks).argmax(axis=2)[:, :, None]  # argmax: the first of equal ones
    top = np.take_along_axis(blocks, first, axis=2)[:, :, 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(top != 0, np.float32(-127) / top, np.float32(0)).astype(np.float32)
        d = np.where(top != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    q = np.minimum(np.rint(iscale[:, :, None] * blocks), 127).astype(np.int8)
    return q.reshape(rows, inp), d


def rounded_rows(x: np.ndarray, per_block: int = BLOCK) -> np.ndarray:
    """The values the int8 kernels multiply instead of x: d * q, float64. `per_block`: the
    weights' block (256 for the K-quants)."""
    rows, inp = x.shape
    if per_block == K_BLOCK:
        q, d = quantize_rows_k(x)
    else:
        q, d, _ = quantize_rows(x)
    blocks = q.reshape(rows, inp // per_block, per_block).astype(np.float64) * d[:, :, None]
    return blocks.reshape(rows, inp)
