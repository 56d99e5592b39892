"""Float weights quantized to llama.cpp's K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (blocks of
256), for a float source split at one of them (an HF folder, `edgetp synth`): the `gguf` package
expands these formats but cannot make them.

The algorithm is llama.cpp's reference quantizer (`quantize_row_q{2,3,4,5,6}_K_ref` in
ggml-quants.c, no importance matrix), computed over every block of a matrix at once in float32:
- Q2_K, Q4_K, Q5_K: per sub-block (16 weights for Q2_K, else 32), a scale and a minimum fitted
  by a search over candidate scales that minimises the weighted error (Q2_K: absolute, weights
  |x|; the others squared, weights |x| plus the sub-block's RMS); both quantized against the
  block's largest (4 bits for Q2_K, else 6), in f16; then each weight rounded again against its
  sub-block's quantized scale and minimum (2, 4 or 5 bits).
- Q3_K, Q6_K: per sub-block of 16, a signed scale fitted for weights x^2 (Q3_K by moving one
  weight's level at a time while the fit improves, Q6_K by a search); the scales quantized
  against the largest (6 bits, 8 bits); each weight to 3 or 6 bits.
The fits' sums add a sub-block's weights in the C loops' order; the C's other sums, and a C
compiler that fuses a multiply and an add, round otherwise, so a choice between two candidates
that tie to the last bit may fall the other way: the blocks are the reference's up to that.
"""

from __future__ import annotations

import numpy as np

QK = 256  # weights a block
_F32 = np.float32


def nearest(v: np.ndarray) -> np.ndarray:
    """Round half to even, as llama.cpp's nearest_int does (it adds 1.5 * 2^23 in float32)."""
    return np.rint(v).astype(np.int32)


def clipped(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """`nearest(v)` held within [lo, hi], clipped before the integers (v may be huge)."""
    return np.clip(np.rint(v), lo, hi).astype(np.int32)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _fit_scale_min(
    x: np.ndarray,
    w: np.ndarray,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    absolute: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of x (sub-blocks, n): (scale, minimum as a positive offset, integers 0..nmax)
    with x ~ scale * L - minimum, by llama.cpp's make_qkx2_quants (squared error, or absolute
    where `absolute`)."""
    # As (n, sub-blocks) (`_by_column`): each pass runs along the sub-blocks, and each sum
    # adds a sub-block's n in the C loop's order.
    x, w = _by_column(x), _by_column(w)

    def error(diff: np.ndarray) -> np.ndarray:
        return (w * (np.abs(diff) if absolute else diff * diff)).sum(axis=0)

    lo = first_lo = np.minimum(x.min(axis=0), _F32(0))
    hi = x.max(axis=0)
    span = hi - lo
    flat = span == 0
    span = np.where(flat, _F32(1), span)
    sum_w = w.sum(axis=0)
    sum_x = (w * x).sum(axis=0)
    iscale = _F32(nmax) / span
    scale = _F32(1) / iscale
    levels = np.clip(nearest(iscale * (x - lo)), 0, nmax)
    best = error(scale * levels + lo - x)
    for step in range(nstep + 1):
        iscale = (_F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)) / span
        trial = np.clip(nearest(iscale * (x - lo)), 0, nmax).astype(_F32)
        w_trial = w * trial
        sum_l = w_trial.sum(axis=0)
        sum_l2 = (w_trial * trial).sum(axis=0)
        sum_xl = (w_trial * x).sum(axis=0)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = np.where(ok, det, _F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_min = np.where(positive, _F32(0), this_min)
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 > 0, sum_l2, _F32(1)), this_scale)
        this_error = error(this_scale * trial + this_min - x)
        better = ok & (this_error < best)
        levels = np.where(better, trial.astype(np.int32), levels)
        best = np.where(better, this_error, best)
        scale = np.where(better, this_scale, scale)
        lo = np.where(better, this_min, lo)
    levels = np.where(flat, 0, levels)
    scale = np.where(flat, _F32(0), scale)
    lo = np.where(flat, first_lo, lo)
    return scale.astype(_F32), (-lo).astype(_F32), np.ascontiguousarray(levels.T)


def _by_column(x: np.ndarray) -> np.ndarray:
    """Rows (sub-blocks, n) as (n, sub-blocks): an operation on a row of 16 or 32 is mostly
    NumPy's overhead (the fits took several times longer row by row), and a sum over the
    first axis adds in order, as the C loops do."""
    return np.ascontiguousarray(x.T)


def _fit_signed_scale(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x (sub-blocks, n): (scale, integers -nmax..nmax-1 stored plus nmax) with x ~
    scale * L, by llama.cpp's make_qx_quants (weights x^2)."""
    rows = np.arange(len(x))
    peak = x[rows, np.abs(x).argmax(axis=1)]  # the signed value of largest magnitude
    zero = np.abs(peak) < _F32(1e-15)
    peak = np.where(zero, _F32(1), peak)
    x = _by_column(x)
    w = x * x
    wx = w * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        levels = np.clip(nearest(iscale * x), -nmax, nmax - 1)
        lf = levels.astype(_F32)
        return levels, (wx * lf).sum(axis=0), (w * lf * lf).sum(axis=0)

    levels, sumlx, suml2 = fit(_F32(-nmax) / peak)
    scale = sumlx / np.where(suml2 > 0, suml2, _F32(1))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        trial, t_lx, t_l2 = fit(-(_F32(nmax) + _F32(0.1) * _F32(step)) / peak)
        better = (t_l2 > 0) & (t_lx * t_lx > best * t_l2)
        levels = np.where(better, trial, levels)
        scale = np.where(better, t_lx / np.where(t_l2 > 0, t_l2, _F32(1)), scale)
        best = np.where(better, scale * t_lx, best)
    levels = np.where(zero, -nmax, levels) + nmax  # stored as 0, as the reference leaves it
    return np.where(zero, _F32(0), scale).astype(_F32), np.ascontiguousarray(levels.T, np.int32)


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and minimums (blocks, 8) in Q4_K's and Q5_K's 12 bytes."""
    out = np.zeros((len(ls), 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4]
    out[:, 4:8] = lm[:, 0:4]
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    out[:, 0:4] |= (ls[:, 4:8] >> 4) << 6
    out[:, 4:8] |= (lm[:, 4:8] >> 4) << 6
    return out


def _k4_blocks(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple:
    """Q4_K's and Q5_K's shared part over blocks x (blocks, 256): d, dmin (f16), the packed
    scales, and the weights' integers (blocks, 256) against the quantized scales."""
    b = len(x)
    sub = x.reshape(b * 8, 32)
    av = np.sqrt((sub * sub).sum(axis=1) / _F32(32))
    scales, mins, levels = _fit_scale_min(sub, av[:, None] + np.abs(sub), nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(b, 8), mins.reshape(b, 8)
    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    inv_scale = np.where(max_scale > 0, _F32(63) / np.where(max_scale > 0, max_scale, 1), _F32(0))
    inv_min = np.where(max_min > 0, _F32(63) / np.where(max_min > 0, max_min, 1), _F32(0))
    ls = np.minimum(63, nearest(inv_scale[:, None] * scales)).astype(np.uint8)
    lm = np.minimum(63, nearest(inv_min[:, None] * mins)).astype(np.uint8)
    d, dmin = _f16(max_scale / _F32(63)), _f16(max_min / _F32(63))
    sub_d = d.astype(_F32)[:, None] * ls.astype(_F32)  # (blocks, 8)
    sub_m = dmin.astype(_F32)[:, None] * lm.astype(_F32)
    safe = np.where(sub_d == 0, _F32(1), sub_d)
    again = np.clip(nearest((x.reshape(b, 8, 32) + sub_m[:, :, None]) / safe[:, :, None]), 0, nmax)
    levels = np.where((sub_d == 0)[:, :, None], levels.reshape(b, 8, 32), again).reshape(b, QK)
    return d, dmin, _pack_scales_k4(ls, lm), levels.astype(np.uint8)


def _fit_q3(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x (sub-blocks, n): (scale, integers -nmax..nmax-1 stored plus nmax) with x ~
    scale * L for weights x^2, by llama.cpp's make_q3_quants: levels from the largest weight,
    then up to five passes that move one weight's level at a time where the fit improves."""
    rows = np.arange(len(x))
    peak = x[rows, np.abs(x).argmax(axis=1)]
    zero = np.abs(peak) < _F32(1e-15)
    levels = clipped((_F32(-nmax) / np.where(zero, _F32(1), peak))[:, None] * x, -nmax, nmax - 1)
    w = x * x
    lf = levels.astype(_F32)
    sum_lx, sum_l2 = (w * x * lf).sum(axis=1), (w * lf * lf).sum(axis=1)
    for _ in range(5):  # a pass that moves nothing leaves the next one nothing to move
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], levels[:, i].astype(_F32)
            slx = sum_lx - wi * xi * li
            sl2 = sum_l2 - wi * li * li
            ok = slx > 0
            new = clipped(xi * sl2 / np.where(ok, slx, _F32(1)), -nmax, nmax - 1)
            nf = new.astype(_F32)
            slx, sl2 = slx + wi * xi * nf, sl2 + wi * nf * nf
            take = ok & (new != levels[:, i]) & (sl2 > 0)
            take &= slx * slx * sum_l2 > sum_lx * sum_lx * sl2
            levels[:, i] = np.where(take, new, levels[:, i])
            sum_lx, sum_l2 = np.where(take, slx, sum_lx), np.where(take, sl2, sum_l2)
    scale = np.where(sum_l2 > 0, sum_lx / np.where(sum_l2 > 0, sum_l2, _F32(1)), _F32(0))
    # a sub-block of zeros keeps integers 0, not nmax, as the reference leaves it
    return np.where(zero, _F32(0), scale), np.where(zero[:, None], 0, levels + nmax)


def _pack_2bit(levels: np.ndarray) -> np.ndarray:
    """Integers 0..3 (blocks, 256) as Q2_K's and Q3_K's qs (blocks, 64): byte l of each half
    holds weights l, l + 32, l + 64 and l + 96 of that half, two bits each."""
    q = levels.reshape(len(levels), 2, 4, 32).astype(np.uint8)
    packed = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return packed.reshape(len(levels), 64)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """Blocks (n, 256) float32 as Q2_K blocks (n, 84): scales[16], qs[64], d, dmin."""
    b = len(x)
    sub = x.reshape(b * 16, 16)
    scales, mins, levels = _fit_scale_min(sub, np.abs(sub), 3, -0.5, 0.1, 15, absolute=True)
    scales, mins = scales.reshape(b, 16), mins.reshape(b, 16)
    max_scale = np.maximum(scales.max(axis=1), _F32(0))
    max_min = np.maximum(mins.max(axis=1), _F32(0))
    inv_scale = _F32(15) / np.where(max_scale > 0, max_scale, _F32(1))
    inv_min = _F32(15) / np.where(max_min > 0, max_min, _F32(1))
    ls = np.where(max_scale[:, None] > 0, nearest(inv_scale[:, None] * scales), 0)
    lm = np.where(max_min[:, None] > 0, nearest(inv_min[:, None] * mins), 0)
    packed = ((ls & 0xFF) | (lm << 4) & 0xFF).astype(np.uint8)  # (a byte, as the C stores it)
    d = _f16(np.where(max_scale > 0, max_scale / _F32(15), _F32(0)))
    dmin = _f16(np.where(max_min > 0, max_min / _F32(15), _F32(0)))
    sub_d = d.astype(_F32)[:, None] * (packed & 0xF).astype(_F32)  # (blocks, 16)
    sub_m = dmin.astype(_F32)[:, None] * (packed >> 4).astype(_F32)
    safe = np.where(sub_d == 0, _F32(1), sub_d)
    again = clipped((x.reshape(b, 16, 16) + sub_m[:, :, None]) / safe[:, :, None], 0, 3)
    levels = np.where((sub_d == 0)[:, :, None], levels.reshape(b, 16, 16), again)
    return np.concatenate(
        [packed, _pack_2bit(levels.reshape(b, QK)), half_bytes(d), half_bytes(dmin)], axis=1
    )


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """Blocks (n, 256) float32 as Q3_K blocks (n, 110): hmask[32], qs[64], scales[12], d."""
    b = len(x)
    scales, levels = _fit_q3(x.reshape(b * 16, 16), 4)
    scales, levels = scales.reshape(b, 16), levels.reshape(b, 16, 16)
    max_scale = scales[np.arange(b), np.abs(scales).argmax(axis=1)]
    some = max_scale != 0
    iscale = _F32(-32) / np.where(some, max_scale, _F32(1))
    ls = np.where(some[:, None], clipped(iscale[:, None] * scales, -32, 31) + 32, 0)
    ls = ls.astype(np.uint8)  # (blocks, 16) 6 bits each: low nibbles, then 2 high bits
    packed = np.zeros((b, 12), np.uint8)
    packed[:, :8] = (ls[:, :8] & 0xF) | ((ls[:, 8:] & 0xF) << 4)
    high = (ls >> 4).reshape(b, 4, 4)  # [j // 4, j % 4]
    packed[:, 8:] = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    d = _f16(np.where(some, _F32(1) / iscale, _F32(0)))
    sub_d = d.astype(_F32)[:, None] * (ls.astype(_F32) - 32)
    safe = np.where(sub_d == 0, _F32(1), sub_d)
    again = clipped(x.reshape(b, 16, 16) / safe[:, :, None], -4, 3) + 4
    levels = np.where((sub_d == 0)[:, :, None], levels, again).reshape(b, QK)
    top = levels > 3  # the third bit: hmask byte m, bit k for weight 32 k + m
    hmask = top.reshape(b, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]
    hmask = hmask.sum(axis=1, dtype=np.uint8)
    qs = _pack_2bit(np.where(top, levels - 4, levels))
    return np.concatenate([hmask, qs, packed, half_bytes(d)], axis=1)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Blocks (n, 256) float32 as Q4_K blocks (n, 144): d, dmin, scales[12], qs[128]."""
    d, dmin, scales, levels = _k4_blocks(x, 15, -1.0, 0.1, 20)
    q = levels.reshape(len(x), 4, 2, 32)  # 64 weights a group: low nibbles, then high
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(x), 128)
    return np.concatenate([half_bytes(d), half_bytes(dmin), scales, qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """Blocks (n, 256) float32 as Q5_K blocks (n, 176): d, dmin, scales[12], qh[32], qs[128]."""
    d, dmin, scales, levels = _k4_blocks(x, 31, -0.5, 0.1, 15)
    q = levels.reshape(len(x), 4, 2, 32)
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(len(x), 128)
    high = (q >> 4).astype(np.uint8)  # (blocks, group, half, 32): the fifth bits
    # group g's fifth bits: bit 2g (its first 32 weights) and 2g + 1 (its last 32)
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)
    qh = (high << shifts[None, :, :, None]).sum(axis=(1, 2)).astype(np.uint8)
    return np.concatenate([half_bytes(d), half_bytes(dmin), scales, qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Blocks (n, 256) float32 as Q6_K blocks (n, 210): ql[128], qh[64], scales[16], d."""
    b = len(x)
    scales, levels = _fit_signed_scale(x.reshape(b * 16, 16), 32)
    scales, levels = scales.reshape(b, 16), levels.reshape(b, 16, 16)
    rows = np.arange(b)
    max_scale = scales[rows, np.abs(scales).argmax(axis=1)]
    empty = max_scale == 0
    iscale = _F32(-128) / np.where(empty, _F32(1), max_scale)
    d = _f16(np.where(empty, _F32(0), _F32(1) / iscale))
    sc = np.minimum(127, nearest(iscale[:, None] * scales))
    sc = np.where(empty[:, None], 0, sc).astype(np.int8)
    sub_d = d.astype(_F32)[:, None] * sc.astype(_F32)
    safe = np.where(sub_d == 0, _F32(1), sub_d)
    again = np.clip(nearest(x.reshape(b, 16, 16) / safe[:, :, None]), -32, 31) + 32
    levels = np.where((sub_d == 0)[:, :, None], levels, again).reshape(b, 2, 4, 32).astype(np.uint8)
    low, high = levels & 0xF, levels >> 4  # (blocks, half, quarter, 32)
    first, second = low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)
    ql = np.concatenate([first, second], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    ql = np.where(empty[:, None, None], 0, ql).reshape(b, 128)
    qh = np.where(empty[:, None, None], 0, qh).reshape(b, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), half_bytes(d)], axis=1).astype(np.uint8)


def half_bytes(half: np.ndarray) -> np.ndarray:
    """f16 values (n,) as their little-endian bytes (n, 2)."""
    return half.astype("<f2").view(np.uint8).reshape(len(half), 2)


K_QUANTIZERS = {
    "q2_k": quantize_q2_k, "q3_k": quantize_q3_k, "q4_k": quantize_q4_k, "q5_k": quantize_q5_k,
    "q6_k": quantize_q6_k,
}  # fmt: skip
