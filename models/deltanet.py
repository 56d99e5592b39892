"""A slice's partial of a gated DeltaNet layer (Qwen3.5, Qwen3-Next), the linear attention that
stands in for attention in most of their layers, in torch.

A slice holds some value heads and the key heads they read (`models.layers.linear_parts`):

    x = rmsnorm(h); qkv, z, b, a = x @ Wqkv[slice rows]        (column-parallel)
    qkv = silu(causal depthwise conv of qkv, `linear_conv` taps)
    q, k = l2norm per head (q also / sqrt(dk)); beta = sigmoid(b)
    g = decay * softplus(a + dt)                                (decay = -exp(A_log) < 0)
    per value head, per token:  S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q
    partial = (rmsnorm(o) * weight * silu(z)) @ Wout[:, slice cols]  (row-parallel)

S, a head's (dk, dv) recurrent state, and the convolution's last `linear_conv - 1` inputs are
what a sequence keeps instead of a KV cache: fixed in size, one per sequence slot on the node
that holds the heads (node.kvcache.LinearStates). The recurrence runs token by token, a prompt's
too: its state after each token is exactly transformers' (whose prompt path is a chunked form
of the same sums), and a decode step is one token anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgetp.models.block_math import project, rms_norm
from edgetp.models.config import ModelConfig
from edgetp.models.layers import Slice, StepBatch

L2_EPS = 1e-6  # transformers' (and the FLA library's) l2norm epsilon


def channels(config: ModelConfig, s: Slice) -> tuple[int, int, int]:
    """A slice's convolution channels of queries, keys and values."""
    keys = s.n_linear_keys * config.linear_k_dim
    return keys, keys, s.n_linear * config.linear_v_dim


def key_of_value(config: ModelConfig, s: Slice) -> torch.Tensor:
    """For each of a slice's value heads, the index among its key heads of the one it reads."""
    heads = torch.arange(*s.linear_heads) // config.linear_group
    return heads - s.linear_key_heads[0]


def inputs(
    h: torch.Tensor, w: dict[str, torch.Tensor], s: Slice, config: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's per-token inputs to its recurrence for h (B, T, D): the convolution's
    channels x (B, T, C) before it, z (B, T, nv, dv), beta and the log decay g (B, T, nv)."""
    B, T, _ = h.shape
    nv, dv = s.n_linear, config.linear_v_dim
    c = sum(channels(config, s))
    x = rms_norm(h, w["attn_norm"], config.norm_eps)
    x, z, b, a = project(x, w, "wqkv").split([c, nv * dv, nv, nv], dim=-1)
    beta = torch.sigmoid(b)
    g = w["decay"] * F.softplus(a + w["dt"])
    return x, z.reshape(B, T, nv, dv), beta, g


def recur(
    x: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    taps: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    s: Slice,
    config: ModelConfig,
) -> torch.Tensor:
    """One sequence's T tokens through the convolution and the recurrence: x (T, C), beta and
    g (T, nv), the taps (C, K); `conv_state` (C, K - 1), its last inputs, and `state` (nv, dk,
    dv) are carried on in place. Returns each value head's output (T, nv, dv)."""
    T = x.shape[0]
    K = taps.shape[1]
    nq, nk, _ = channels(config, s)
    dk, dv = config.linear_k_dim, config.linear_v_dim
    full = torch.cat((conv_state.T, x))  # (K - 1 + T, C): the past inputs, then these
    if K > 1:
        conv_state.copy_(full[-(K - 1) :].T)
    mixed = F.silu((full.unfold(0, K, 1) * taps).sum(-1))  # (T, C), a causal depthwise conv
    q, k, v = mixed.split([nq, nk, s.n_linear * dv], dim=-1)
    heads = key_of_value(config, s)
    q = _l2norm(q.reshape(T, -1, dk))[:, heads] * dk**-0.5  # (T, nv, dk)
    k = _l2norm(k.reshape(T, -1, dk))[:, heads]
    v = v.reshape(T, -1, dv)
    out = x.new_empty(T, s.n_linear, dv)
    decay = g.exp()
    for t in range(T):
        state.mul_(decay[t].view(-1, 1, 1))
        remembered = torch.einsum("hkv,hk->hv", state, k[t])  # what S recalls for k
        delta = (v[t] - remembered) * beta[t].unsqueeze(-1)  # (nv, dv)
        state.add_(k[t].unsqueeze(-1) * delta.unsqueeze(-2))
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def deltanet_partial(
    h: torch.Tensor,
    w: dict[str, torch.Tensor],
    s: Slice,
    config: ModelConfig,
    conv_states: torch.Tensor,
    states: torch.Tensor,
    batch: StepBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This slice's share of a gated DeltaNet block's output for h (B, T, D), from each
    sequence's states in its slot (conv_states (slots, C, K - 1), states (slots, nv, dk, dv)),
    carried on past its new tokens. Also the recurrence's inputs x, beta, g (B, T, ...), for a
    cache that keeps them to step a state forward again (node.kvcache.LinearStates)."""
    B, T, _ = h.shape
    if s.n_linear == 0:
        empty = h.new_zeros(B, T, 0)
        return h.new_zeros(h.shape), empty, empty, empty
    x, z, beta, g = inputs(h, w, s, config)
    out = h.new_zeros(B, T, s.n_linear, config.linear_v_dim)
    for b, (slot, n) in enumerate(zip(batch.slots, batch.lengths, strict=True)):
        out[b, :n] = recur(
            x[b, :n], beta[b, :n], g[b, :n], w["conv"], conv_states[slot], states[slot], s, config
        )
    # the gated norm, per value head: its weight as stored (not 1 + weight)
    normed = rms_norm(out, w["ssm_norm"], config.norm_eps) * F.silu(z)
    # row-parallel: sum over slices
    return project(normed.reshape(B, T, -1), w, "wo"), x, beta, g
