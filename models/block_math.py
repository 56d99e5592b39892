"""A slice's partial of a decoder layer's two residual blocks, attention and FFN, in torch.

This is the path for any step (a prompt, a batch of several new tokens); a decode step, one new
token a sequence, runs the same math as NumPy rows (`models.block_rows`), or in C
(`models.rows_native`). The slices are cut by `models.layers`; the caller sums the partials of
every slice (the allreduce) into the residual stream.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
import torch.nn.functional as F

from edgetp.models import gemma4
from edgetp.models.config import ModelConfig
from edgetp.models.kernels import SCALE_SUFFIX, blas_threads, linear, torch_threads
from edgetp.models.kvformat import KVTensor
from edgetp.models.layers import Slice, StepBatch
from edgetp.models.quant import matrix_size
from edgetp.models.rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., D) over its root mean square, times `weight` (D,)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def project(
    x: torch.Tensor, w: dict[str, torch.Tensor], name: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x times the layer's matrix `name`, whatever dtype it is stored in."""
    return linear(x, w[name], bias, w.get(name + SCALE_SUFFIX))


def attention_partial(
    h: torch.Tensor,
    w: dict[str, torch.Tensor],
    s: Slice,
    config: ModelConfig,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    cache_k: KVTensor,
    cache_v: KVTensor,
    batch: StepBatch,
    window: int | None = None,
    shared_kv: bool = False,
) -> torch.Tensor:
    """This slice's share of the attention block's output for h (B, T, D).

    cache_k/cache_v: this layer's cache, (slots, n_kv, max_ctx, hd), in any of
    models/kvformat.py's formats, read back as float32; the step's keys and values are written
    into it before attending. A local layer (`window`: it attends to that many last
    positions) has a ring of min(window, max_ctx) positions instead (`_attend_window`).
    `shared_kv`: the cache is another layer's, which wrote the step's keys and values already
    (Gemma 4's KV-sharing layers, models/gemma4.py); they are read, and written again as they
    are.
    """
    B, T, _ = h.shape
    hd, nq, nkv = config.head_dim, s.n_q, s.n_kv
    if nq == 0:
        return h.new_zeros(h.shape)
    x = rms_norm(h, w["attn_norm"], config.norm_eps)
    qkv = project(x, w, "wqkv", w.get("bqkv"))  # (B, T, (nq + 2 nkv) hd)
    gated = 2 if config.attention_gate else 1  # each head's query, then its output gate
    q, k, v = qkv.split([gated * nq * hd, nkv * hd, nkv * hd], dim=-1)
    gate = None
    if config.attention_gate:
        q, gate = q.reshape(B, T, nq, 2 * hd).chunk(2, dim=-1)
    q, k = q.reshape(B, T, nq, hd), k.view(B, T, nkv, hd)
    if config.qk_norm:
        q = rms_norm(q, w["q_norm"], config.norm_eps)
        k = rms_norm(k, w["k_norm"], config.norm_eps)
    q = q.transpose(1, 2)  # (B, nq, T, hd)
    k = k.transpose(1, 2)  # (B, nkv, T, hd)
    v = v.view(B, T, nkv, hd).transpose(1, 2)
    if config.value_norm:
        v = gemma4.rms_norm(v, None, config.norm_eps)
    cos, sin = cos_sin
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    if shared_kv:
        k, v = gemma4.step_kv(cache_k, cache_v, batch)

    if window is not None:
        out = _attend_window(q, k, v, cache_k, cache_v, batch, window, s, config, w.get("sinks"))
    elif B == 1:
        slot, start = batch.slots[0], batch.starts[0]
        end = start + T
        cache_k[slot, :, start:end] = k[0]
        cache_v[slot, :, start:end] = v[0]
        keys = cache_k[slot : slot + 1, :, :end].float()
        values = cache_v[slot : slot + 1, :, :end].float()
        sinks = w.get("sinks")
        if T > 1 and (start > 0 or sinks is not None):  # a continued prompt, or explicit scores
            out = _attend_tiles(q, keys, values, start, 0, None, s, config, sinks)
        else:  # one token sees every key; a prompt from its start, SDPA's causal kernel
            out = _attend(q, keys, values, None, T > 1, s, config, sinks)
    else:
        sequences = list(zip(batch.slots, batch.starts, batch.lengths, strict=True))
        for b, (slot, st, n) in enumerate(sequences):
            cache_k[slot, :, st : st + n] = k[b, :, :n]
            cache_v[slot, :, st : st + n] = v[b, :, :n]
        if T > PROMPT_TILE:  # a long prompt in the batch: each sequence in tiles, its rows only
            out = q.new_zeros(q.shape)
            for b, (slot, st, n) in enumerate(sequences):
                keys = cache_k[slot : slot + 1, :, : st + n].float()
                values = cache_v[slot : slot + 1, :, : st + n].float()
                out[b : b + 1, :, :n] = _attend_tiles(
                    q[b : b + 1, :, :n], keys, values, st, 0, None, s, config, w.get("sinks")
                )
        else:
            L = max(st + n for _, st, n in sequences)
            slots = torch.tensor(batch.slots)
            keys, values = cache_k[slots, :, :L].float(), cache_v[slots, :, :L].float()
            qpos = batch.positions()  # (B, T)
            kpos = torch.arange(L)
            mask = (kpos <= qpos.unsqueeze(-1)).unsqueeze(1)  # (B, 1, T, L)
            out = _attend(q, keys, values, mask, False, s, config, w.get("sinks"))
    out = out.transpose(1, 2).reshape(B, T, nq * hd)
    if gate is not None:
        out = out * torch.sigmoid(gate.reshape(B, T, nq * hd))
    # row-parallel: sum over slices (each adds its share of an O bias, `slice_parts`)
    return project(out, w, "wo", w.get("bo"))  # (B, T, D)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    s: Slice,
    config: ModelConfig,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this slice's query heads q (B, nq, T, hd) over its KV heads' keys and
    values (B, nkv, L, hd); `sinks` (nq,): each head's logit in its softmax's denominator.

    A prompt's (T > 1) runs on the process's BLAS threads: over a long reused prefix it is a
    third of the step (SmolLM2, 138 new tokens over 1,356 kept: 0.37 s on one thread, 0.28-0.30
    on two, with OpenBLAS's threads asleep between products: models/__init__.py). A decode
    step's stays on one, as torch's other ops (`models.kernels.set_threads` says why).
    """
    with torch_threads(blas_threads() if q.shape[2] > 1 else 1):
        nq, nkv, group = s.n_q, s.n_kv, config.group_size
        scale = config.query_scale
        if sinks is not None:
            kv_of_q = torch.arange(*s.q_heads) // group - s.kv_heads[0]
            scale = scale or q.shape[-1] ** -0.5
            assert not causal, "a prompt with sinks attends in tiles (_attend_tiles)"
            return _attend_with_sinks(q, keys[:, kv_of_q], values[:, kv_of_q], mask, sinks, scale)
        one_mask = mask is not None and mask.shape[:-2].numel() == 1
        if one_mask and not causal and q.shape[0] == 1 and q.dtype == torch.float32:
            assert mask is not None
            kv_of_q = torch.arange(*s.q_heads) // group - s.kv_heads[0]
            return _attend_blas(q, keys, values, mask, scale, kv_of_q)
        if nq == nkv * group and s.q_heads[0] % group == 0:
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=nq != nkv, scale=scale
            )
        # query heads split within a group: map each local query head to its KV head
        kv_of_q = torch.arange(*s.q_heads) // group - s.kv_heads[0]
        return F.scaled_dot_product_attention(
            q, keys[:, kv_of_q], values[:, kv_of_q], attn_mask=mask, is_causal=causal, scale=scale
        )


def _attend_blas(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
    kv_of_q: torch.Tensor,
) -> torch.Tensor:
    """SDPA's attention for one sequence's tile (q (1, nq, n, hd), a (n, L) mask), its two
    products on NumPy's BLAS: torch's float32 products took twice its time on a tile's scores
    (Zen 5, 2 threads, 4 heads of 256x256 by 256x4096: 11.9 against 5.7 ms). The query heads
    of a KV head are one product."""
    hd = q.shape[-1]
    qn, kn, vn = q[0].numpy(), keys[0].numpy(), values[0].numpy()
    out = np.empty((q.shape[1], q.shape[2], values.shape[-1]), np.float32)
    hidden = ~mask.reshape(mask.shape[-2:])  # one sequence's (n, L), for every head
    h0 = 0
    for kv, run in itertools.groupby(kv_of_q.tolist()):  # kv_of_q is non-decreasing
        h1 = h0 + len(list(run))
        rows = np.ascontiguousarray(qn[h0:h1]).reshape(-1, hd)  # (heads x n, hd)
        scores = torch.from_numpy(rows @ kn[kv].T).view(h1 - h0, -1, kn.shape[1])
        scores.mul_(scale or hd**-0.5).masked_fill_(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1).numpy().reshape(-1, kn.shape[1])
        out[h0:h1] = (weights @ vn[kv]).reshape(h1 - h0, -1, vn.shape[-1])
        h0 = h1
    return torch.from_numpy(out).unsqueeze(0)


# Queries a tile in a prompt's attention with a mask (`_attend_tiles`). Measured on one thread
# (AMD EPYC): 2,048 tokens over 2,048 kept (SmolLM2's heads) take 282 ms in tiles of 256 against
# 369 with one (T, L) mask, and 128 or 512 a tile take 346 and 321; a 2,048-token prompt in
# Gemma 3's 512-position window, 99 ms against 229.
PROMPT_TILE = 256


def _attend_tiles(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_start: int,
    k_start: int,
    window: int | None,
    s: Slice,
    config: ModelConfig,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's attention: queries q (1, nq, n, hd) at positions q_start.. over keys and
    values (1, nkv, L, hd) at positions k_start..; each query sees the keys at or before its
    position, and with a `window` only the last `window` of them.

    Flash attention's shape, on SDPA: PROMPT_TILE queries at a time, each tile over only the
    keys it can see, with a mask of tile x those keys. No (n, L) mask or score matrix exists, so
    memory grows with n times the tile, and a window's layer costs n (window + tile) rather than
    n L. Each query's softmax runs over the same keys as untiled (a masked key weighs 0 either
    way), so a tile's outputs are the untiled ones to float rounding.
    """
    n = q.shape[2]
    out = q.new_empty(q.shape)
    for a in range(0, n, PROMPT_TILE):
        b = min(n, a + PROMPT_TILE)
        first = q_start + a - window + 1 if window is not None else 0  # first position seen
        lo, hi = max(0, first - k_start), q_start + b - k_start  # its keys' rows [lo, hi)
        qpos = torch.arange(q_start + a, q_start + b).unsqueeze(1)
        kpos = torch.arange(k_start + lo, k_start + hi)
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        out[:, :, a:b] = _attend(
            q[:, :, a:b], keys[:, :, lo:hi], values[:, :, lo:hi], mask, False, s, config, sinks
        )
    return out


def _attend_with_sinks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention with sinks (gpt-oss), keys and values given for every query head (B, nq, L,
    hd): each head's softmax has its sink's logit as one more entry, whose value is dropped, so
    its weights sum to less than 1. SDPA has no such entry: the scores are explicit here."""
    B, nq, T, _ = q.shape
    scores = q @ keys.transpose(-1, -2) * scale  # (B, nq, T, L): a tile's, in a prompt
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, nq, 1, 1).expand(B, nq, T, 1)
    weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return weights @ values  # (B, nq, T, hd)


def _attend_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_k: KVTensor,
    cache_v: KVTensor,
    batch: StepBatch,
    window: int,
    s: Slice,
    config: ModelConfig,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A local layer's attention: each query sees the last `window` positions, itself included.

    The cache is a ring of W = min(window, max_ctx) positions, position p at p % W: a sequence's
    past comes out of it in position order, its new keys join, and the last W go back in.
    """
    W = cache_k.shape[2]
    out = torch.zeros_like(q)
    for b, (slot, st, n) in enumerate(zip(batch.slots, batch.starts, batch.lengths, strict=True)):
        first = max(0, st - window + 1)
        past = torch.arange(first, st)
        keys = torch.cat((cache_k[slot, :, past % W].float(), k[b, :, :n]), dim=1).unsqueeze(0)
        values = torch.cat((cache_v[slot, :, past % W].float(), v[b, :, :n]), dim=1).unsqueeze(0)
        out[b : b + 1, :, :n] = _attend_tiles(
            q[b : b + 1, :, :n], keys, values, st, first, window, s, config, sinks
        )
        kept = torch.arange(max(st, st + n - W), st + n)
        cache_k[slot, :, kept % W] = k[b][:, kept - st]
        cache_v[slot, :, kept % W] = v[b][:, kept - st]
    return out


def _gate(gate: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if config.activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    return F.silu(gate)


def ffn_partial(h: torch.Tensor, w: dict[str, torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """This slice's share of the FFN block's output for h (B, T, D): SwiGLU, or GeGLU."""
    n = matrix_size(w["w_down"])[1]
    if n == 0:
        return h.new_zeros(h.shape)
    x = rms_norm(h, w["ffn_norm"], config.norm_eps)
    gate, up = project(x, w, "w_gate_up").split(n, dim=-1)  # column-parallel
    return project(_gate(gate, config) * up, w, "w_down")  # row-parallel: sum over slices
