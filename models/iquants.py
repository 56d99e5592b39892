"""Float weights quantized to llama.cpp's 4-bit non-linear formats: IQ4_NL (blocks of 32: an f16
scale and 4-bit indices into a fixed table of 16 int8 values) and IQ4_XS (the same table in
blocks of 256: an f16 scale and a 6-bit scale per 32 weights). The `gguf` package expands them but
cannot make them.

The algorithm is llama.cpp's `quantize_row_iq4_nl_impl` (ggml-quants.c) as `quantize_iq4_nl` and
`quantize_row_iq4_xs_ref` call it without an importance matrix (what a file of these types
holds), computed over every block of a matrix at once in float32: per 32 weights, the scale that
best fits weights x^2 among 16 candidates (the largest weight on the table's end, and 15 steps
around it), each weight taking the table's nearest entry; IQ4_XS then quantizes the 32-weight
scales to 6 bits against the block's largest and picks each weight's entry again.
(llama.cpp's `quantize_row_iq4_nl_ref` tries only the first candidate.) A candidate's sums add
a group's 32 products one after another, as the C loop does (a C compiler that fuses a multiply
and an add would round otherwise: two candidates that tie to the last bit may then fall the
other way).
"""

from __future__ import annotations

import numpy as np

from edgetp.models.kquants import clipped, half_bytes

IQ4NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8
)  # llama.cpp's kvalues_iq4nl
# llama.cpp's best_index_int8 takes entry i for 2 v at or past the sum of entries i - 1 and i,
# an integer: so the entry depends on floor(2 v) only, and a table over those integers gives it
# (a search per weight was most of the quantizer's time).
_SUMS = IQ4NL_VALUES[:-1].astype(np.int32) + IQ4NL_VALUES[1:]
_LOWEST = int(_SUMS[0]) - 1
_ENTRY_AT = np.searchsorted(_SUMS, np.arange(_LOWEST, int(_SUMS[-1]) + 1), side="right")
_TRIES = 7  # candidate scales on either side of the first
_F32 = np.float32
_VALUE_AT = IQ4NL_VALUES[_ENTRY_AT].astype(_F32)  # the entry's value, by floor(2 v) - _LOWEST
_HIGHEST = _LOWEST + len(_ENTRY_AT) - 1


def _nearest_entry(v: np.ndarray) -> np.ndarray:
    """The index of the table's entry nearest each of v, the upper one at a midpoint."""
    at = np.clip(np.floor(v + v), _LOWEST, _HIGHEST).astype(np.intp)
    return _ENTRY_AT[at - _LOWEST]


def _fit(x: np.ndarray) -> np.ndarray:
    """Per row of x (groups of 32 weights): the scale d with x ~ d * table[L] for weights x^2."""
    peak = x[np.arange(len(x)), np.abs(x).argmax(axis=1)]  # the signed weight of largest size
    zero = np.abs(peak) < _F32(1e-15)
    peak = np.where(zero, _F32(1), peak)
    # The weights as (32, groups): each pass below runs along the groups, not 32 at a time
    # (about three times faster), and a sum over the first axis adds the 32 in the C loop's order.
    xt = np.ascontiguousarray(x.T)
    w = xt * xt
    twice = xt + xt  # (2 x) times a scale is 2 (x times it) exactly: what `_nearest_entry` floors
    v, wq, product = np.empty_like(xt), np.empty_like(xt), np.empty_like(xt)

    def sums(inverse_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        np.multiply(twice, inverse_scale, out=v)
        np.floor(v, out=v)
        np.clip(v, _LOWEST, _HIGHEST, out=v)
        q = _VALUE_AT[(v - _F32(_LOWEST)).astype(np.intp)]  # each weight's nearest entry
        np.multiply(w, q, out=wq)
        sum_qx = np.multiply(wq, xt, out=product).sum(axis=0)
        return sum_qx, np.multiply(wq, q, out=product).sum(axis=0)

    sum_qx, sum_q2 = sums(_F32(1) / (peak / _F32(127)))  # the largest weight on -127's end
    d = np.where(sum_q2 > 0, sum_qx / np.where(sum_q2 > 0, sum_q2, _F32(1)), _F32(0))
    best = d * sum_qx
    for step in range(-_TRIES, _TRIES + 1):
        t_qx, t_q2 = sums((_F32(step) + _F32(IQ4NL_VALUES[0])) / peak)
        better = (t_q2 > 0) & (t_qx * t_qx > best * t_q2)
        d = np.where(better, t_qx / np.where(t_q2 > 0, t_q2, _F32(1)), d)
        best = np.where(better, d * t_qx, best)
    return np.where(zero, _F32(0), d).astype(_F32)


def _inverse(d: np.ndarray) -> np.ndarray:
    return np.where(d != 0, _F32(1) / np.where(d != 0, d, _F32(1)), _F32(0)).astype(_F32)


def _pack_nibbles(entries: np.ndarray) -> np.ndarray:
    """Indices (n, 32 k) as 16 k bytes a row: byte j of each 32 holds weights j (low) and j + 16."""
    q = entries.reshape(len(entries), -1, 2, 16).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(entries), -1)


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """Blocks (n, 32) float32 as IQ4_NL blocks (n, 18): d, qs[16]."""
    d = _fit(x)
    entries = _nearest_entry(_inverse(d)[:, None] * x)
    return np.concatenate([half_bytes(d.astype(np.float16)), _pack_nibbles(entries)], axis=1)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """Blocks (n, 256) float32 as IQ4_XS blocks (n, 136): d, scales_h, scales_l[4], qs[128]."""
    b = len(x)
    groups = x.reshape(b * 8, 32)
    scales = _fit(groups).reshape(b, 8)
    max_scale = scales[np.arange(b), np.abs(scales).argmax(axis=1)]
    d = -max_scale / _F32(32)
    levels = clipped(_inverse(d)[:, None] * scales, -32, 31)  # (blocks, 8)
    group_d = (d[:, None] * levels.astype(_F32)).reshape(b * 8)  # the unrounded d, as the C
    entries = _nearest_entry(_inverse(group_d)[:, None] * groups).reshape(b, 256)
    stored = (levels + 32).astype(np.uint16)
    scales_h = (((stored >> 4) & 3) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1)
    scales_l = (stored[:, 0::2] & 0xF) | ((stored[:, 1::2] & 0xF) << 4)
    return np.concatenate(
        [
            half_bytes(d.astype(np.float16)),
            scales_h.astype("<u2").view(np.uint8).reshape(b, 2),
            scales_l.astype(np.uint8),
            _pack_nibbles(entries),
        ],
        axis=1,
    )
