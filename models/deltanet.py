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
that holds the heads (node.kvcache.LinearStates). A decode step's token runs the recurrence as
written (`by_token`); a step of several tokens (a prompt, drafts) runs the same sums `CHUNK`
tokens at a time in matmuls (`chunked`, the form of transformers' and llama.cpp's prompt path),
whose end state matches the token-by-token one to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from edgetp.models.block_math import project, rms_norm
from edgetp.models.errors import ModelError
from edgetp.models.family import Family
from edgetp.models.layers import Slice, StepBatch

if TYPE_CHECKING:
    from edgetp.models.config import ModelConfig

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
    # (T, C), a causal depthwise conv: K products of shifted inputs, summed in place (unfolded
    # into (T, C, K) first, a 4,096-token prompt's Qwen3.5 layer wrote 0.5 GB: 2.1x the time)
    conv = full[:T] * taps[:, 0]
    for j in range(1, K):
        conv.addcmul_(full[j : j + T], taps[:, j])
    mixed = F.silu(conv)
    q, k, v = mixed.split([nq, nk, s.n_linear * dv], dim=-1)
    heads = key_of_value(config, s)
    q = _l2norm(q.reshape(T, -1, dk))[:, heads] * dk**-0.5  # (T, nv, dk)
    k = _l2norm(k.reshape(T, -1, dk))[:, heads]
    v = v.reshape(T, -1, dv)
    # a decode step's token as written; from 2 tokens on, chunks cost less (docs/bench/README.md)
    rule = chunked if T > 1 else by_token
    return rule(q, k, v, beta, g, state)


def by_token(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule one token at a time: q, k (T, nv, dk), v (T, nv, dv), beta and the
    log decay g (T, nv); `state` (nv, dk, dv) carried on in place. Returns o (T, nv, dv)."""
    out = v.new_empty(v.shape)
    decay = g.exp()
    for t in range(v.shape[0]):
        state.mul_(decay[t].view(-1, 1, 1))
        remembered = torch.einsum("hkv,hk->hv", state, k[t])  # what S recalls for k
        delta = (v[t] - remembered) * beta[t].unsqueeze(-1)  # (nv, dv)
        state.add_(k[t].unsqueeze(-1) * delta.unsqueeze(-2))
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out


# Tokens a chunk: transformers', FLA's and llama.cpp's. Within a chunk the work is (C, C)
# matrices a head; across chunks the state is read and written once a chunk, not a token.
CHUNK = 64


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """`by_token`'s sums, `CHUNK` tokens at a time (same arguments, same result).

    Within a chunk that starts from state S0, with G_t the sum of g from its start to token t
    and u_s the delta token s writes (beta_s (v_s - S_{s-1}^T k_s), S_{s-1} decayed to s):

        S_t = e^G_t S0 + sum_{s<=t} e^(G_t - G_s) k_s u_s^T
        u_t = beta_t (v_t - e^G_t S0^T k_t - sum_{s<t} e^(G_t - G_s) (k_t . k_s) u_s)
        o_t = S_t^T q_t

    so U = (I + A)^-1 (beta V - beta e^G K S0), A_ts = beta_t e^(G_t - G_s) k_t . k_s for s < t:
    one triangular solve a chunk gives U, and each chunk reads and writes S once. Every
    exponent is <= 0, so nothing overflows however long the chunk or strong the decay."""
    T = v.shape[0]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (nv, T, d): heads are the batch
    beta, g = beta.T, g.T  # (nv, T)
    out = v.new_empty(v.shape)
    for a in range(0, T, CHUNK):
        c = slice(a, min(a + CHUNK, T))
        qc, kc, vc, bc = q[:, c], k[:, c], v[:, c], beta[:, c].unsqueeze(-1)
        G = g[:, c].cumsum(-1)  # (nv, C)
        n = G.shape[1]
        later = torch.ones(n, n, dtype=torch.bool, device=G.device).triu(1)  # s > t
        # e^(G_t - G_s) for s <= t, 0 else; -inf before exp so nothing above overflows
        decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(later, float("-inf")).exp()
        from_start = G.exp().unsqueeze(-1)  # e^G_t, (nv, C, 1)
        kb = kc * bc
        # unitriangular: the solve reads only A's strictly lower part, its diagonal is 1
        A = (kb @ kc.mT) * decay  # (nv, C, C)
        rhs = torch.cat((vc * bc, kb * from_start), dim=-1)
        solved = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        u = solved[..., : vc.shape[-1]] - solved[..., vc.shape[-1] :] @ state  # (nv, C, dv)
        scores = (qc @ kc.mT) * decay  # o_t's sum over s <= t
        out[:, c] = (qc * from_start) @ state + scores @ u
        to_end = (G[:, -1:] - G).exp().unsqueeze(-1)  # e^(G_C - G_s), (nv, C, 1)
        state.mul_(G[:, -1].exp().view(-1, 1, 1)).add_((kc * to_end).mT @ u)
    return out.transpose(0, 1)


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


def hf_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The gated DeltaNet fields of a Qwen3.5 or Qwen3-Next config.json: which layers are
    linear attention (`layer_types`, else all but every `full_attention_interval`-th, as
    transformers reads it), their heads and convolution, and the full layers' output gate."""
    n_layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if not types:
        every = int(config.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention"
                 for i in range(n_layers)]  # fmt: skip
    if len(types) != n_layers:
        raise ModelError(f"{source}: layer_types has {len(types)} entries for {n_layers} layers")
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ModelError(f"{source}: layer types {unknown} are not supported")
    fields: dict[str, Any] = {"attention_gate": True}
    names = {
        "linear_k_heads": "linear_num_key_heads",
        "linear_v_heads": "linear_num_value_heads",
        "linear_k_dim": "linear_key_head_dim",
        "linear_v_dim": "linear_value_head_dim",
        "linear_conv": "linear_conv_kernel_dim",
    }
    for field, key in names.items():
        if config.get(key) is None:
            raise ModelError(f"{source}: config.json key {key!r} is missing")
        fields[field] = int(config[key])
    if (config.get("hidden_act") or "silu") != "silu":
        raise ModelError(f"{source}: activation {config['hidden_act']!r} is not supported")
    linear = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    return fields | {"linear_layers": linear}


def gguf_fields(metadata: dict[str, Any], arch: str, source: str, n_layers: int) -> dict[str, Any]:
    """The gated DeltaNet fields of a qwen35, qwen35moe or qwen3next GGUF file, under the keys
    llama.cpp's converter writes: every `full_attention_interval`-th layer is attention."""

    def key(name: str) -> int:
        if f"{arch}.{name}" not in metadata:
            raise ModelError(f"{source}: GGUF metadata key '{arch}.{name}' is missing")
        return int(metadata[f"{arch}.{name}"])

    every = int(metadata.get(f"{arch}.full_attention_interval", 4))
    v_heads = key("ssm.time_step_rank")
    return {
        "attention_gate": True,
        "linear_layers": tuple(i for i in range(n_layers) if (i + 1) % every),
        "linear_k_heads": key("ssm.group_count"),
        "linear_v_heads": v_heads,
        "linear_k_dim": key("ssm.state_size"),
        "linear_v_dim": key("ssm.inner_size") // max(v_heads, 1),
        "linear_conv": key("ssm.conv_kernel"),
    }


@dataclass(frozen=True)
class GatedDeltaNet(Family):
    """Qwen3.5, Qwen3-Next: gated DeltaNet (linear attention) layers among full-attention ones
    whose queries carry an output gate; every norm but the DeltaNet's own scales by (1 +
    weight), as Gemma's (HF files store the weight)."""

    norm_plus_one: bool = True

    def hf_fields(self, config: dict[str, Any], source: str) -> dict[str, Any]:
        return hf_fields(config, source)

    def gguf_fields(
        self, metadata: dict[str, Any], arch: str, source: str, n_layers: int
    ) -> tuple[dict[str, Any], dict[str, int]]:
        return gguf_fields(metadata, arch, source, n_layers), {}

    def linear_channels(self, config: ModelConfig, s: Slice) -> tuple[int, int, int]:
        return channels(config, s)

    linear_recur = staticmethod(recur)
    linear_partial = staticmethod(deltanet_partial)


QWEN35 = GatedDeltaNet("Qwen3.5", "qwen35", "Qwen3_5ForCausalLM", qk_norm=True)
QWEN35_MOE = GatedDeltaNet(
    "Qwen3.5-MoE",
    "qwen35moe",
    "Qwen3_5MoeForCausalLM",
    qk_norm=True,
    moe=True,
    norm_topk=True,  # its router renormalises its top-k weights always
    shared_expert=True,
)
QWEN3_NEXT = GatedDeltaNet(
    "Qwen3-Next",
    "qwen3next",
    "Qwen3NextForCausalLM",
    qk_norm=True,
    moe=True,
    shared_expert=True,
)
