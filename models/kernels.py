"""The matmul every projection goes through, on the fastest kernel measured on these CPUs.

Decode is a row (or a few) times a weight matrix: memory-bound matrix-vector products. On the
AMD CPUs measured, PyTorch's MKL build runs them 2-4x slower than NumPy's OpenBLAS (SmolLM2's
lm_head: 6.9 ms vs 1.6 ms per row), so float32 projections go through NumPy on the same memory
(no copies). For a few rows, one matrix-vector product per row beats OpenBLAS's matrix-matrix
path; past `GEMV_MAX_ROWS` the matrix-matrix path wins. See docs/decisions.md.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

GEMV_MAX_ROWS = 4


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) @ w (out, in)^T + bias, as F.linear."""
    if w.dtype != torch.float32 or x.dtype != torch.float32:
        return F.linear(x, w, bias)
    lead = x.shape[:-1]
    xn = x.reshape(-1, x.shape[-1]).numpy()
    wn = w.numpy()
    rows = xn.shape[0]
    if rows <= GEMV_MAX_ROWS:
        out = np.empty((rows, wn.shape[0]), dtype=np.float32)
        for r in range(rows):
            np.dot(wn, xn[r], out=out[r])
    else:
        out = xn @ wn.T
    result = torch.from_numpy(out)
    if bias is not None:
        result += bias
    return result.view(*lead, wn.shape[0])
