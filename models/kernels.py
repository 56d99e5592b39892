"""The matmul every projection goes through, on the fastest kernel measured on these CPUs.

Weights are stored in one of four dtypes, chosen when the model is split (`--dtype`); each has
its own kernel, picked by measurement on the CPUs this runs on (AVX-512 with BF16 and VNNI; see
docs/decisions.md for the figures):

- float32: NumPy's OpenBLAS on the same memory (no copies). PyTorch's MKL build runs decode's
  matrix-vector products 2-4x slower (SmolLM2's lm_head: 6.9 ms vs 1.6 ms per row). For a few
  rows one matrix-vector product per row beats OpenBLAS's matrix-matrix path; past
  `GEMV_MAX_ROWS` the matrix-matrix path wins.
- float16: torch's half GEMV (the input is rounded to half); converting the weight to float32
  first costs 20-50x more than the product.
- bfloat16: torch's bf16 matmul (oneDNN, AVX512-BF16).
- int8: per-output-channel scales, torch's int8-weight kernel (`_weight_int8pack_mm`, bf16
  input); 2-3x faster than float32 for a 70B-sized slice.

Every kernel returns float32: the residual stream and the sums across nodes stay float32.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

GEMV_MAX_ROWS = 4
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
SCALE_SUFFIX = "_scale"  # an int8 matrix `w` is stored with its scales as `w_scale`


_share: int | None = None  # this process's share of the cores, as last set


def set_threads(threads: int | None = None) -> int:
    """This process's share of the cores (all unless told otherwise) for the BLAS matmuls.

    Torch keeps one thread: the projections run on OpenBLAS and what torch still does per step
    is small; its OpenMP workers spinning between ops would steal the cores from OpenBLAS's
    threads (measured: 260 ms/token instead of 14 on SmolLM2 with both at 2).
    """
    global _share
    _share = threads or os.cpu_count() or 1
    return _limit_blas(_share)


def leave_a_core_to_the_loader(streaming: bool) -> int:
    """BLAS threads for a node whose slice streams from disk (or not, again): one fewer than
    its share, down to one. Reading a layer is CPU work too (a copy per page), and BLAS's
    threads spinning between products starved the loader: SmolLM2 streamed through a window
    of 2 from a cold disk took 576 ms/token against 327 for the reads alone with 2 threads,
    and 355 against 348 with one. Streaming is bound by its reads, so compute loses nothing.
    """
    share = _share or os.cpu_count() or 1
    return _limit_blas(max(1, share - 1) if streaming else share)


def _limit_blas(n: int) -> int:
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)
    threadpool_limits(limits=n, user_api="blas")
    return n


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (..., in) @ w (out, in)^T + bias, as F.linear, in float32; `scale` for an int8 `w`."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if w.dtype == torch.float32:
        result = torch.from_numpy(_matmul_f32(x2.float().numpy(), w.numpy()))
    elif w.dtype == torch.int8:
        if scale is None:
            raise ValueError("an int8 weight needs its per-channel scales")
        if x2.shape[1] % 8:
            # On such widths the int8 kernel reads past its rows: garbage for one row, a crash
            # for several (torch 2.13). An FFN slice of an odd-width model can be one.
            result = x2.float() @ (w.float() * scale[:, None]).t()
        else:
            result = torch._weight_int8pack_mm(x2.bfloat16(), w, scale.bfloat16()).float()
    else:
        result = torch.mm(x2.to(w.dtype), w.t()).float()
    if bias is not None:
        result += bias
    return result.view(*lead, w.shape[0])


def linear_rows(
    x: np.ndarray,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> np.ndarray:
    """`linear` for a float32 array of rows (rows, in), as an array (rows, out): the decode path,
    where each torch call costs more than the arithmetic (models/layers.py says why)."""
    if w.dtype != torch.float32:
        return linear(torch.from_numpy(x), w, bias, scale).numpy()
    out = _matmul_f32(x, w.numpy())
    if bias is not None:
        out += bias.numpy()
    return out


def _matmul_f32(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    rows = x.shape[0]
    if rows <= GEMV_MAX_ROWS:
        out = np.empty((rows, w.shape[0]), dtype=np.float32)
        for r in range(rows):
            np.dot(w, x[r], out=out[r])
        return out
    return x @ w.T


def quantize(w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A float matrix (out, in) stored as `dtype`: {"": weight} plus {"_scale": scales} for int8.

    int8 is symmetric per output channel: scale = max|row| / 127, so the row's largest weight
    keeps full precision and a row of zeros stays exactly zero.
    """
    w = w.float()
    if dtype != torch.int8:
        return {"": w.to(dtype).contiguous()}
    largest = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])  # a slice may be empty
    scale = largest.clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"": q.contiguous(), SCALE_SUFFIX: scale}


def embed(
    ids: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of an embedding table stored in any of the dtypes, as float32."""
    rows = F.embedding(ids, table).float()
    if scale is not None:
        rows *= scale[ids].unsqueeze(-1)
    return rows
