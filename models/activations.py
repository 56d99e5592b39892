"""Exact or int8 activations: how a block-format product treats its input rows.

"exact" multiplies the stored weights' values by the float32 rows. "int8" rounds each row to
int8 a block of 32 first, as llama.cpp's quantize_row_q8_0 does, and sums integer products a
block (models/csrc/blocks.c): d = max|x| / 127, q = x * (1/d) to the nearest integer (ties to
even; the kernels' vroundps and nearbyintf give the same bytes), and s = d * sum(q) for the
formats with a minimum (llama.cpp's Q8_1). The functions here are that arithmetic in NumPy:
the reference the kernels are checked against (node/kernel_probe.py, the tests).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Activations = Literal["exact", "int8"]
ACTIVATIONS: tuple[Activations, ...] = ("exact", "int8")
BLOCK = 32  # values a scale covers


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


def rounded_rows(x: np.ndarray) -> np.ndarray:
    """The values the int8 kernels multiply instead of x: d * q, float64."""
    q, d, _ = quantize_rows(x)
    rows, inp = x.shape
    blocks = q.reshape(rows, inp // BLOCK, BLOCK).astype(np.float64) * d[:, :, None]
    return blocks.reshape(rows, inp)
