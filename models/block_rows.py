"""A decode step's partials of the attention and FFN blocks, as NumPy rows (B, D).

The same math as `models.block_math`, for one new token a sequence. A decode step is bound by
fixed costs, not arithmetic: `attention_rows` says why NumPy. `models.rows_native` runs these
blocks in one C call each where a device admitted it, and is checked against these.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from edgetp.models.config import ModelConfig
from edgetp.models.kernels import SCALE_SUFFIX, linear_rows
from edgetp.models.kvformat import KVArrays
from edgetp.models.layers import Slice, StepBatch
from edgetp.models.quant import matrix_size
from edgetp.models.rope import rope_rows


def project_rows(
    x: np.ndarray, w: dict[str, torch.Tensor], name: str, bias: torch.Tensor | None = None
) -> np.ndarray:
    """`project` for float32 rows (B, in)."""
    return linear_rows(x, w[name], bias, w.get(name + SCALE_SUFFIX))


def rms_norm_rows(x: np.ndarray, weight: torch.Tensor, eps: float) -> np.ndarray:
    """`rms_norm` for float32 rows (B, D)."""
    # einsum: one pass, without np.mean's Python-level bookkeeping (~60 calls a token)
    mean_square = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[-1])
    return x / np.sqrt(mean_square + np.float32(eps)) * weight.numpy()


def _head_norm_rows(x: np.ndarray, weight: torch.Tensor, eps: float) -> np.ndarray:
    """`rms_norm` of each head of x (B, H, hd)."""
    B, H, hd = x.shape
    return rms_norm_rows(x.reshape(B * H, hd), weight, eps).reshape(B, H, hd)


def attention_rows(
    h: np.ndarray,
    w: dict[str, torch.Tensor],
    s: Slice,
    config: ModelConfig,
    cos_sin: tuple[np.ndarray, np.ndarray],
    cache_k: KVArrays,
    cache_v: KVArrays,
    batch: StepBatch,
    window: int | None = None,
) -> np.ndarray:
    """`attention_partial` for a decode step: h (B, D), one new token per sequence at
    `batch.starts`; cos_sin from `Rope.rows`; the cache as arrays (slots, n_kv, max_ctx, hd),
    or a local layer's ring (`window`), in any of models/kvformat.py's formats.

    Why NumPy: a decode step's slice of a layer is a few MB of weights, and between messages
    every torch call runs cold. Measured on SmolLM2 (a third of a layer, one thread): attention
    in torch 412 us, here 274; a message decoded into torch 55 us, into NumPy 8.
    """
    B = h.shape[0]
    hd, nq, nkv = config.head_dim, s.n_q, s.n_kv
    if nq == 0:
        return np.zeros_like(h)
    x = rms_norm_rows(h, w["attn_norm"], config.norm_eps)
    qkv = project_rows(x, w, "wqkv", w.get("bqkv"))  # (B, (nq + 2 nkv) hd)
    gate = None
    if config.attention_gate:  # each head's query, then its output gate
        heads = qkv[:, : 2 * nq * hd].reshape(B, nq, 2, hd)
        gate = heads[:, :, 1].reshape(B, nq * hd)
        qkv = np.concatenate((heads[:, :, 0].reshape(B, nq * hd), qkv[:, 2 * nq * hd :]), 1)
    qk = qkv[:, : (nq + nkv) * hd].reshape(B, nq + nkv, hd)
    if config.qk_norm:
        qk = np.concatenate(
            (
                _head_norm_rows(qk[:, :nq], w["q_norm"], config.norm_eps),
                _head_norm_rows(qk[:, nq:], w["k_norm"], config.norm_eps),
            ),
            axis=1,
        )
    roped = rope_rows(qk, *cos_sin)
    q, k = roped[:, :nq], roped[:, nq:]
    v = qkv[:, (nq + nkv) * hd :].reshape(B, nkv, hd)
    group = config.group_size
    grouped = nq == nkv * group and s.q_heads[0] % group == 0
    kv_of_q = None if grouped else np.arange(*s.q_heads) // group - s.kv_heads[0]
    scale = np.float32(config.query_scale or 1.0 / math.sqrt(hd))
    sinks = w["sinks"].numpy() if "sinks" in w else None  # (nq,), gpt-oss
    W = cache_k.shape[2]  # a local layer's ring: position p at p % W, the last W positions
    out = np.empty((B, nq, hd), dtype=np.float32)
    for b, (slot, pos) in enumerate(zip(batch.slots, batch.starts, strict=True)):
        at = pos % W if window is not None else pos
        cache_k[slot, :, at] = k[b]
        cache_v[slot, :, at] = v[b]
        seen = min(pos + 1, W)
        keys = cache_k[slot, :, :seen].astype(np.float32, copy=False)  # (nkv, L, hd)
        values = cache_v[slot, :, :seen].astype(np.float32, copy=False)
        if grouped:  # each KV head serves `group` query heads
            queries = q[b].reshape(nkv, group, hd)
        else:  # query heads split within a group: each reads its own KV head
            keys, values = keys[kv_of_q], values[kv_of_q]
            queries = q[b][:, None, :]
        scores = queries @ keys.transpose(0, 2, 1) * scale  # (heads, queries per head, L)
        top = scores.max(axis=-1, keepdims=True)
        if sinks is not None:  # each query head's sink: one more logit in the denominator
            sink = sinks.reshape(*queries.shape[:2], 1)
            top = np.maximum(top, sink)
        scores -= top
        np.exp(scores, out=scores)
        total = scores.sum(axis=-1, keepdims=True)
        scores /= total if sinks is None else total + np.exp(sink - top)
        out[b] = (scores @ values).reshape(nq, hd)
    heads_out = out.reshape(B, nq * hd)
    if gate is not None:  # sigmoid, as 0.5 (1 + tanh(g / 2)): no overflow for any g
        half = np.float32(0.5)
        heads_out = heads_out * (half + half * np.tanh(half * gate))
    # (B, D), row-parallel (each slice adds its share of an O bias)
    return project_rows(heads_out, w, "wo", w.get("bo"))


def ffn_rows(h: np.ndarray, w: dict[str, torch.Tensor], config: ModelConfig) -> np.ndarray:
    """`ffn_partial` for a decode step's rows h (B, D)."""
    n = matrix_size(w["w_down"])[1]
    if n == 0:
        return np.zeros_like(h)
    x = rms_norm_rows(h, w["ffn_norm"], config.norm_eps)
    gate_up = project_rows(x, w, "w_gate_up")
    gate, up = gate_up[:, :n], gate_up[:, n:]
    if config.activation == "gelu_tanh":
        inner = np.float32(math.sqrt(2 / math.pi)) * (gate + np.float32(0.044715) * gate**3)
        act = np.float32(0.5) * gate * (1 + np.tanh(inner)) * up
    else:
        # silu(g) = g * sigmoid(g), with sigmoid as 0.5 (1 + tanh(g / 2)): no overflow for any g
        act = gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * up
    return project_rows(act, w, "w_down")
