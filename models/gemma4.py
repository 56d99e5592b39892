"""What Gemma 4 (text) adds to Gemma 3's layer, as transformers' Gemma4TextModel computes it.

- Layers of their own shapes: global layers' heads of `global_head_dim` and `global_kv_heads`,
  KV-sharing layers' FFNs twice as wide; each layer is cut by its own (`layer_view`).
- KV shared across layers: the last `kv_shared` layers compute queries only and attend to the
  keys and values of the last earlier layer of their kind (local or global), which the node
  already holds: a sharing layer keeps no cache of its own (`kv_source`). A local layer that
  others read keeps its whole context rather than a ring of its window: a prompt's later keys
  would overwrite in the ring what the sharing layer's earlier queries still see.
- Per-layer input embeddings (PLE): each layer ends with a small gated block fed by a vector a
  token from a second embedding and a projection of the first. The master holds all of it and
  computes it between the layers' sums (`per_layer_inputs`, `end_of_layer`), so nothing more
  crosses the wire than for Gemma 3 (docs/decisions.md says why).
- Each layer's output scaled by its `layer_scalar`, and the logits soft-capped.
- A mixture (`dense_ffn`): the experts split as every mixture's, routed by Gemma 4's router
  (`route`), beside a dense MLP the master computes (`mixture_out`: the two are normed apart
  before they add, which one sum of partials cannot carry).

The master's tensors are globals of their own, each layer's stacked by rows like POST_NORMS.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from edgetp.models.config import ModelConfig
from edgetp.models.dtypes import embedding_dtype
from edgetp.models.kernels import SCALE_SUFFIX, embed
from edgetp.models.layers import Slice, StepBatch, kv_heads_for


class _Source(Protocol):
    """What `global_dtypes` reads of a model source (models.source_base.ModelSource)."""

    config: ModelConfig

    def stored_type(self, layer: int | None, name: str) -> str: ...


# The master's PLE tensors: the token embedding (ple_vocab, L P), the projection of the main
# embedding (L P, D) and its norm (1, P); per layer, stacked: the gate (L P, D), the projection
# back (L D, P), its norm (L, D); and every layer's output scale (L, 1).
PLE_EMBEDDING = "ple_embedding"
PLE_PROJECTION = "ple_projection"
PLE_PROJECTION_NORM = "ple_projection_norm"
PLE_GATES = "ple_gates"
PLE_OUTPUTS = "ple_outputs"
PLE_NORMS = "ple_norms"
LAYER_SCALARS = "layer_scalars"
# A mixture's (`dense_ffn`), stacked likewise: its dense MLP's gate and up (L Fd, D), down
# (L D, Fd), norm before and after it (L, D), the experts' sum's norm (L, D), and the router's
# scale (L, D) and each expert's (L, E).
DENSE_GATES = "dense_gates"
DENSE_UPS = "dense_ups"
DENSE_DOWNS = "dense_downs"
DENSE_NORMS = "dense_norms"
DENSE_POST_NORMS = "dense_post_norms"
EXPERTS_POST_NORMS = "experts_post_norms"
ROUTER_SCALES = "router_scales"
EXPERT_SCALES = "expert_scales"
# The per-layer tensors the stacked globals gather, by their canonical layer names.
STACKED = {PLE_GATES: "ple_gate", PLE_OUTPUTS: "ple_output", PLE_NORMS: "ple_norm",
           LAYER_SCALARS: "layer_scalar", DENSE_GATES: "gate", DENSE_UPS: "up",
           DENSE_DOWNS: "down", DENSE_NORMS: "dense_norm", DENSE_POST_NORMS: "dense_post_norm",
           EXPERTS_POST_NORMS: "experts_post_norm", ROUTER_SCALES: "router_scale",
           EXPERT_SCALES: "expert_scale"}  # fmt: skip
MIXTURE = (DENSE_GATES, DENSE_UPS, DENSE_DOWNS, DENSE_NORMS, DENSE_POST_NORMS, EXPERTS_POST_NORMS,
           ROUTER_SCALES, EXPERT_SCALES)  # fmt: skip
# A sharing layer's tensors that its file does not hold: zeros stand in (multiplied, never read)
SHARED_ABSENT = ("k", "v", "k_norm")


def global_names(config: ModelConfig) -> list[str]:
    """The Gemma 4 tensors the master holds beside Gemma 3's."""
    if not config.value_norm:
        return []
    ple = [PLE_EMBEDDING, PLE_PROJECTION, PLE_PROJECTION_NORM, PLE_GATES, PLE_OUTPUTS, PLE_NORMS]
    mixture = list(MIXTURE) if config.dense_ffn else []
    return (ple if config.ple_dim else []) + [LAYER_SCALARS] + mixture


def global_dtypes(source: _Source, dtype: str) -> dict[str, str]:
    """How the split stores these globals when it asks for `dtype`: float32, but the table of
    per-layer inputs, a vocabulary's rows like the embedding (E2B's is 2.3 B values), kept as
    the embedding would be, by its own stored type."""
    names = global_names(source.config)
    out = dict.fromkeys(names, "f32")
    if PLE_EMBEDDING in names:
        out[PLE_EMBEDDING] = embedding_dtype(dtype, source.stored_type(None, PLE_EMBEDDING))
    return out


def global_shape(config: ModelConfig, name: str) -> tuple[int, int]:
    L, D, P, F = config.n_layers, config.hidden, config.ple_dim, config.dense_ffn
    return {
        DENSE_GATES: (L * F, D),
        DENSE_UPS: (L * F, D),
        DENSE_DOWNS: (L * D, F),
        DENSE_NORMS: (L, D),
        DENSE_POST_NORMS: (L, D),
        EXPERTS_POST_NORMS: (L, D),
        ROUTER_SCALES: (L, D),
        EXPERT_SCALES: (L, config.n_experts),
        PLE_EMBEDDING: (config.ple_vocab, L * P),
        PLE_PROJECTION: (L * P, D),
        PLE_PROJECTION_NORM: (1, P),
        PLE_GATES: (L * P, D),
        PLE_OUTPUTS: (L * D, P),
        PLE_NORMS: (L, D),
        LAYER_SCALARS: (L, 1),
    }[name]


def layer_rows(config: ModelConfig, name: str) -> int:
    """What a stacked global's per-layer tensor holds in the file: the rows of a matrix, the
    length of a vector (a norm, the scalar)."""
    rows = global_shape(config, name)[0] // config.n_layers
    vector = name in (PLE_NORMS, LAYER_SCALARS, DENSE_NORMS, DENSE_POST_NORMS,
                      EXPERTS_POST_NORMS, ROUTER_SCALES, EXPERT_SCALES)  # fmt: skip
    return global_shape(config, name)[1] if vector else rows


def layer_config(config: ModelConfig, layer: int) -> ModelConfig:
    """Layer `layer`'s shape: a global layer's heads of their own size and count, a sharing
    layer's FFN twice as wide where the model says so; `config` itself for any other."""
    wide = config.wide_ffn and shares_kv(config, layer)
    own_heads = not config.is_local(layer) and (config.global_head_dim or config.global_kv_heads)
    if not wide and not own_heads:
        return config
    return replace(
        config,
        head_dim=(own_heads and config.global_head_dim) or config.head_dim,
        n_kv_heads=(own_heads and config.global_kv_heads) or config.n_kv_heads,
        ffn_hidden=config.ffn_hidden * (2 if wide else 1),
        global_head_dim=None,
        global_kv_heads=None,
        wide_ffn=False,
    )


def layer_view(config: ModelConfig, s: Slice, layer: int) -> tuple[ModelConfig, Slice]:
    """Layer `layer`'s shape (`layer_config`) and slice `s`'s share of it: the same query
    heads with the KV heads they read there, the same fraction of its FFN."""
    view = layer_config(config, layer)
    if view is config:
        return config, s
    wider = view.ffn_hidden // config.ffn_hidden
    ffn = (s.ffn[0] * wider, s.ffn[1] * wider)
    return view, Slice(s.q_heads, kv_heads_for(s.q_heads, view.group_size), ffn)


def global_config(config: ModelConfig) -> ModelConfig:
    """The global layers' shape, which their RoPE table is built for."""
    globals_ = [i for i in range(config.n_layers) if not config.is_local(i)]
    return layer_config(config, globals_[0]) if globals_ else config


def kv_source(config: ModelConfig, layer: int) -> int:
    """The layer whose keys and values `layer` attends to: itself, or for one of the last
    `kv_shared` layers the last earlier layer of its kind."""
    first_shared = config.n_layers - config.kv_shared
    if layer < first_shared:
        return layer
    local = config.is_local(layer)
    return max(i for i in range(first_shared) if config.is_local(i) == local)


def shares_kv(config: ModelConfig, layer: int) -> bool:
    """Whether `layer` reads another layer's keys and values (and holds none)."""
    return kv_source(config, layer) != layer


def keeps_whole_context(config: ModelConfig, layer: int) -> bool:
    """Whether a local `layer` keeps every position, not a ring: other layers read its KV."""
    return config.kv_shared > 0 and any(
        kv_source(config, i) == layer for i in range(layer + 1, config.n_layers)
    )


def stored_name(config: ModelConfig, layer: int, name: str) -> str:
    """The canonical tensor a file holds `name` of `layer` as: a global layer's values are its
    keys' projection where the model says so (`k_eq_v`)."""
    if name == "v" and config.k_eq_v and not config.is_local(layer):
        return "k"
    return name


def step_kv(
    cache_k: torch.Tensor, cache_v: torch.Tensor, batch: StepBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a step's tokens wrote into another layer's cache, (B, nkv, T, hd)
    right-padded as the step's queries, for a layer that shares them."""
    shape = (batch.size, cache_k.shape[1], batch.width, cache_k.shape[3])
    k, v = cache_k.new_zeros(shape), cache_v.new_zeros(shape)
    for b, (slot, st, n) in enumerate(zip(batch.slots, batch.starts, batch.lengths, strict=True)):
        k[b, :, :n] = cache_k[slot, :, st : st + n]
        v[b, :, :n] = cache_v[slot, :, st : st + n]
    return k, v


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x (..., n) over its root mean square, times `weight` (n,) where there is one (a value
    head's norm has none)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def per_layer_inputs(
    ids: torch.Tensor, embedded: torch.Tensor, t: dict[str, torch.Tensor], config: ModelConfig
) -> torch.Tensor:
    """Every layer's PLE input for tokens `ids` (B, T) whose scaled embedding is `embedded`
    (B, T, D): (B, T, L, P), the token's own vector and the projection of its embedding,
    averaged (transformers' get_per_layer_inputs and project_per_layer_inputs)."""
    L, P, D = config.n_layers, config.ple_dim, config.hidden
    table = t[PLE_EMBEDDING]  # (ple_vocab, L P) in the split's dtype for it
    own = embed(ids, table, t.get(PLE_EMBEDDING + SCALE_SUFFIX)) * torch.tensor(
        math.sqrt(P), dtype=torch.float32
    )
    projected = F.linear(embedded, t[PLE_PROJECTION]) * D**-0.5
    projected = rms_norm(projected.view(*ids.shape, L, P), t[PLE_PROJECTION_NORM][0],
                         config.norm_eps)  # fmt: skip
    return (projected + own.view(*ids.shape, L, P)) * 2**-0.5


def end_of_layer(
    h: np.ndarray,
    layer: int,
    inputs: torch.Tensor | None,
    t: dict[str, torch.Tensor],
    config: ModelConfig,
) -> np.ndarray:
    """The hidden state h (B, D) or (B, T, D) after layer `layer`'s two sums: its PLE block
    (where the model has them; `inputs` as `per_layer_inputs` gives them), then its scale."""
    x = torch.from_numpy(h)
    if inputs is not None:
        P, D = config.ple_dim, config.hidden
        own = inputs[..., layer, :].view(*x.shape[:-1], P)
        gate = F.linear(x, t[PLE_GATES][layer * P : (layer + 1) * P])  # (.., P)
        out = t[PLE_OUTPUTS][layer * D : (layer + 1) * D]  # (D, P)
        y = F.linear(F.gelu(gate, approximate="tanh") * own, out)
        x = x + rms_norm(y, t[PLE_NORMS][layer], config.norm_eps)
    return (x * t[LAYER_SCALARS][layer, 0]).numpy()


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The logits squashed into (-cap, cap) by tanh, where the model caps them."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def route(h: np.ndarray, layer: int, t: dict[str, torch.Tensor], router: torch.Tensor,
          config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """A mixture's choice for h (B, D) or (B, T, D) after layer `layer`'s attention sum, as
    transformers' Gemma4TextRouter makes it: the hidden state normed (a weight of its scale
    over sqrt(D)), a softmax over the router's logits, the top k renormalised, each times its
    expert's scale. Each token's experts and weights, a row a token."""
    d = config.hidden
    rows = torch.from_numpy(np.ascontiguousarray(h).reshape(-1, d))
    x = rms_norm(rows, t[ROUTER_SCALES][layer] * d**-0.5, config.norm_eps)
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float)
    top, experts = torch.topk(probs, config.n_experts_used, dim=-1)  # (N, k)
    top = top / top.sum(dim=-1, keepdim=True) * t[EXPERT_SCALES][layer][experts]
    return experts.numpy().astype(np.int64), top.numpy().astype(np.float32)


def mixture_out(
    h: np.ndarray, layer: int, experts: np.ndarray, t: dict[str, torch.Tensor], config: ModelConfig
) -> np.ndarray:
    """A mixture layer's FFN output before its post-FFN norm: the master's dense MLP of h (the
    hidden state after the attention sum) and the experts' sum `experts`, each normed."""
    F_, D, eps = config.dense_ffn, config.hidden, config.norm_eps
    x = rms_norm(torch.from_numpy(h), t[DENSE_NORMS][layer], eps)
    gate = F.linear(x, t[DENSE_GATES][layer * F_ : (layer + 1) * F_])
    up = F.linear(x, t[DENSE_UPS][layer * F_ : (layer + 1) * F_])
    dense = F.linear(
        F.gelu(gate, approximate="tanh") * up, t[DENSE_DOWNS][layer * D : (layer + 1) * D]
    )
    dense = rms_norm(dense, t[DENSE_POST_NORMS][layer], eps)
    return (dense + rms_norm(torch.from_numpy(experts), t[EXPERTS_POST_NORMS][layer], eps)).numpy()
