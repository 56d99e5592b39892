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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from edgetp.models.dtypes import embedding_dtype
from edgetp.models.errors import ModelError
from edgetp.models.family import Family, Source
from edgetp.models.kernels import SCALE_SUFFIX, embed
from edgetp.models.kvformat import KVTensor
from edgetp.models.layers import ROUTER, Slice, StepBatch, expert_of, kv_heads_for

if TYPE_CHECKING:
    from edgetp.models.config import ModelConfig
    from edgetp.models.gguf_file import GGUFFile

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

# How files name these tensors: llama.cpp's GGUF names, transformers' HF names. Per layer: the
# PLE block's; in a mixture the experts' norm, the dense MLP's norms (its gate, up and down are
# the dense FFN's), the experts' sum's norm and the router's scales, the experts' gate and up
# in one stack (GGUF (E 2F, D), HF (E, 2F, D)), down (E, D, F); and the PLE globals.
_GGUF_LAYER = {
    "ple_gate": "inp_gate.weight",
    "ple_output": "proj.weight",
    "ple_norm": "post_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
}
_GGUF_MIXTURE = {
    "ffn_norm": "pre_ffw_norm_2.weight",
    "dense_norm": "ffn_norm.weight",
    "dense_post_norm": "post_ffw_norm_1.weight",
    "experts_post_norm": "post_ffw_norm_2.weight",
    "router_scale": "ffn_gate_inp.scale",
    "expert_scale": "ffn_down_exps.scale",
}
_GGUF_EXPERTS = {"gate": "ffn_gate_up_exps.weight", "up": "ffn_gate_up_exps.weight"}
_GGUF_GLOBALS = {
    PLE_EMBEDDING: "per_layer_token_embd.weight",
    PLE_PROJECTION: "per_layer_model_proj.weight",
    PLE_PROJECTION_NORM: "per_layer_proj_norm.weight",
}
_HF_LAYER = {
    "ple_gate": "per_layer_input_gate.weight",
    "ple_output": "per_layer_projection.weight",
    "ple_norm": "post_per_layer_input_norm.weight",
    "layer_scalar": "layer_scalar",
}
_HF_MIXTURE = {
    "ffn_norm": "pre_feedforward_layernorm_2.weight",
    ROUTER: "router.proj.weight",
    "dense_norm": "pre_feedforward_layernorm.weight",
    "dense_post_norm": "post_feedforward_layernorm_1.weight",
    "experts_post_norm": "post_feedforward_layernorm_2.weight",
    "router_scale": "router.scale",
    "expert_scale": "router.per_expert_scale",
}
_HF_EXPERTS = {"gate": "experts.gate_up_proj", "up": "experts.gate_up_proj",
               "down": "experts.down_proj"}  # fmt: skip
_HF_GLOBALS = {
    PLE_EMBEDDING: "model.embed_tokens_per_layer.weight",
    PLE_PROJECTION: "model.per_layer_model_projection.weight",
    PLE_PROJECTION_NORM: "model.per_layer_projection_norm.weight",
}


def gguf_name(config: ModelConfig, layer: int | None, name: str) -> str | None:
    """The GGUF name of one of Gemma 4's own tensors; None for any other."""
    if layer is None:
        return _GGUF_GLOBALS.get(name)
    expert = expert_of(name)
    own = _GGUF_LAYER.get(name)
    if config.dense_ffn:
        own = _GGUF_EXPERTS.get(expert[0]) if expert is not None else _GGUF_MIXTURE.get(name, own)
    return None if own is None else f"blk.{layer}.{own}"


def hf_name(config: ModelConfig, layer: int | None, name: str) -> str | None:
    """The HF name of one of Gemma 4's own tensors; None for any other."""
    if layer is None:
        return _HF_GLOBALS.get(name)
    expert = expert_of(name)
    own = _HF_LAYER.get(name)
    if config.dense_ffn:
        own = _HF_EXPERTS[expert[0]] if expert is not None else _HF_MIXTURE.get(name, own)
    return None if own is None else f"model.layers.{layer}.{own}"


def gguf_tensor_fields(config: ModelConfig, file: GGUFFile) -> dict[str, Any]:
    """A Gemma 4 file's PLE vocabulary (its table's rows) and whether its global layers'
    values are their keys (no attn_v of their own, as llama.cpp's converter writes them)."""
    fields: dict[str, Any] = {}
    if config.ple_dim:
        fields["ple_vocab"] = file.info(_GGUF_GLOBALS[PLE_EMBEDDING]).shape[0]
    globals_ = [i for i in range(config.n_layers) if not config.is_local(i)]
    fields["k_eq_v"] = not file.has_tensor(f"blk.{globals_[0]}.attn_v.weight")
    return fields


def global_names(config: ModelConfig) -> list[str]:
    """The Gemma 4 tensors the master holds beside Gemma 3's."""
    if not config.value_norm:
        return []
    ple = [PLE_EMBEDDING, PLE_PROJECTION, PLE_PROJECTION_NORM, PLE_GATES, PLE_OUTPUTS, PLE_NORMS]
    mixture = list(MIXTURE) if config.dense_ffn else []
    return (ple if config.ple_dim else []) + [LAYER_SCALARS] + mixture


def global_dtypes(source: Source, dtype: str) -> dict[str, str]:
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


def global_rows(source: Source, name: str, start: int, stop: int) -> torch.Tensor | None:
    """Rows [start, stop) of a stacked global, layer i's rows after i's, read from each
    layer's tensor (float32); the projection's norm, a vector in the file, as one row."""
    config = source.config
    if name in STACKED:
        per_layer, read = STACKED[name], layer_rows(config, name)
        n = global_shape(config, name)[0] // config.n_layers
        rows = [source._rows(i, per_layer, 0, read, False).view(n, -1)
                for i in range(start // n, (stop - 1) // n + 1)]  # fmt: skip
        return torch.cat(rows)[start % n : start % n + stop - start]
    if name == PLE_PROJECTION_NORM:
        return source._rows(None, name, 0, config.ple_dim, False).view(1, -1)[start:stop]
    return None


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
    cache_k: KVTensor, cache_v: KVTensor, batch: StepBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a step's tokens wrote into another layer's cache, (B, nkv, T, hd)
    right-padded as the step's queries, as float32, for a layer that shares them."""
    shape = (batch.size, cache_k.shape[1], batch.width, cache_k.shape[3])
    k, v = torch.zeros(shape), torch.zeros(shape)
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


def hf_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The Gemma 4 fields of a `Gemma4ForCausalLM` config.json, as transformers' Gemma4TextConfig
    reads it: every 6th layer global (and the last) unless `layer_types` says, the global
    layers `global_head_dim` wide unless `per_layer_config` says otherwise."""
    for key, what in (
        ("use_bidirectional_attention", "bidirectional attention"),
        ("attention_bias", "attention biases"),
    ):
        if config.get(key):
            raise ModelError(f"{source}: a Gemma 4 with {what} ({key}) is not supported yet")
    activation = config.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelError(f"{source}: FFN activation {activation!r} is not supported")
    n_layers = int(config["num_hidden_layers"])
    types = list(config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)
    ])  # fmt: skip
    if len(types) != n_layers:
        raise ModelError(f"{source}: layer_types has {len(types)} entries for {n_layers} layers")
    types[-1] = "full_attention"  # as transformers forces it
    global_heads = _global_heads(config, types, source)
    shared = int(config.get("num_kv_shared_layers") or 0)
    first_shared = n_layers - shared
    if shared and set(types[:first_shared]) != set(types):
        raise ModelError(
            f"{source}: the {shared} layers that share KV need an earlier layer of each of their "
            "kinds to share it from"
        )
    rope = config.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {}
    if (local.get("rope_type") or "default") != "default":
        raise ModelError(f"{source}: local layers' RoPE {local['rope_type']!r} is not supported")
    ple = int(config.get("hidden_size_per_layer_input") or 0)
    softcap = config.get("final_logit_softcapping")
    return {
        "embedding_multiplier": math.sqrt(int(config["hidden_size"])),
        "post_norms": True,
        "activation": "gelu_tanh",
        "query_scale": 1.0,  # the query and key norms set the scores' scale
        "sliding_window": int(config.get("sliding_window") or 512),
        "local_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        "local_rope_theta": float(local.get("rope_theta") or 10000.0),
        "value_norm": True,
        "kv_shared": shared,
        "k_eq_v": bool(config.get("attention_k_eq_v")),
        "ple_dim": ple,
        "ple_vocab": int(config.get("vocab_size_per_layer_input") or 262144) if ple else 0,
        "final_softcap": None if softcap is None else float(softcap),
        "wide_ffn": bool(shared and config.get("use_double_wide_mlp")),
        **global_heads,
        **(_experts(config, source) if config.get("enable_moe_block") else {}),
    }


def _experts(config: dict[str, Any], source: str) -> dict[str, Any]:
    """A Gemma 4 mixture's fields: its experts, top-k renormalised, and its dense MLP."""
    for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if config.get(name) is None:
            raise ModelError(f"{source}: config.json key {name!r} is missing")
    if config.get("num_kv_shared_layers") and config.get("use_double_wide_mlp"):
        raise ModelError(
            f"{source}: a Gemma 4 mixture with double-wide dense MLPs is not supported yet"
        )
    return {
        "ffn_hidden": int(config["moe_intermediate_size"]),
        "n_experts": int(config["num_experts"]),
        "n_experts_used": int(config["top_k_experts"]),
        "norm_topk_prob": True,
        "dense_ffn": int(config["intermediate_size"]),
    }


def _global_heads(config: dict[str, Any], types: list[str], source: str) -> dict[str, Any]:
    """The global layers' head size and KV heads where they differ from the local ones', as
    transformers' Gemma4TextConfig gives them to each layer (`per_layer_config`)."""
    head_dim = int(config.get("head_dim") or 256)
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    overrides = config.get("per_layer_config")
    if overrides is None:  # transformers' defaults for a config.json without it
        kv = config.get("num_global_key_value_heads") if config.get("attention_k_eq_v") else None
        glob = {"head_dim": config.get("global_head_dim") or 512}
        overrides = {i: glob | ({"num_key_value_heads": kv} if kv else {})
                     for i, t in enumerate(types) if t == "full_attention"}  # fmt: skip
    shapes: dict[str, set[tuple[int, int]]] = {"sliding_attention": set(), "full_attention": set()}
    for i, kind in enumerate(types):
        values = overrides.get(i, overrides.get(str(i), {}))
        shapes[kind].add((int(values.get("head_dim", head_dim)),
                          int(values.get("num_key_value_heads", kv_heads))))  # fmt: skip
    if shapes["sliding_attention"] - {(head_dim, kv_heads)} or len(shapes["full_attention"]) > 1:
        raise ModelError(
            f"{source}: per_layer_config gives layers of one kind different heads "
            f"({sorted(shapes['sliding_attention'] | shapes['full_attention'])}): not supported"
        )
    ((dim, kv),) = shapes["full_attention"]  # the last layer is always global
    return {"global_head_dim": dim if dim != head_dim else None,
            "global_kv_heads": kv if kv != kv_heads else None}  # fmt: skip


def _per_layer(value: int | list[int], layers: list[int], key: str, source: str) -> int:
    """The one value GGUF key `key` gives `layers` (it may give one a layer)."""
    values = {int(value)} if not isinstance(value, list) else {int(value[i]) for i in layers}
    if len(values) != 1:
        raise ModelError(f"{source}: {key} differs between layers of one kind ({sorted(values)})")
    return values.pop()


def gguf_fields(
    metadata: dict[str, Any], arch: str, source: str, n_layers: int
) -> tuple[dict[str, Any], dict[str, int]]:
    """The Gemma 4 fields of a GGUF file, and its local layers' head size, KV heads and FFN
    width, as llama.cpp's converter writes them: the global layers' head size as key_length,
    the local ones' as key_length_swa, KV heads and FFN widths one a layer where they differ, a
    flag a layer for the local ones; proportional RoPE as its `rope_freqs` tensor
    (models.source reads it). What only the file's tensors say (the PLE vocabulary, K = V) the
    source adds."""

    def key(name: str) -> Any:
        if f"{arch}.{name}" not in metadata:
            raise ModelError(f"{source}: GGUF metadata key {arch}.{name} is missing")
        return metadata[f"{arch}.{name}"]

    pattern = key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n_layers:
        raise ModelError(f"{source}: {arch}.attention.sliding_window_pattern is not a flag a layer")
    local = [i for i in range(n_layers) if pattern[i]]
    global_ = [i for i in range(n_layers) if not pattern[i]]
    shared = int(metadata.get(f"{arch}.attention.shared_kv_layers", 0))
    owners = list(range(n_layers - shared))
    sharing = list(range(n_layers - shared, n_layers))
    global_dim = int(key("attention.key_length"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length_swa", global_dim))
    kv = key("attention.head_count_kv")
    kv_heads = _per_layer(kv, local, "head_count_kv", source) if local else None
    global_kv = _per_layer(kv, global_, "head_count_kv", source)
    ffn = key("feed_forward_length")
    width = _per_layer(ffn, owners, "feed_forward_length", source)
    wide = bool(sharing) and _per_layer(ffn, sharing, "feed_forward_length", source) != width
    if wide and _per_layer(ffn, sharing, "feed_forward_length", source) != 2 * width:
        raise ModelError(f"{source}: the KV-sharing layers' FFN is neither as wide nor twice")
    softcap = metadata.get(f"{arch}.final_logit_softcapping")
    fields = {
        "embedding_multiplier": math.sqrt(int(key("embedding_length"))),
        "post_norms": True,
        "activation": "gelu_tanh",
        "query_scale": 1.0,
        "sliding_window": int(key("attention.sliding_window")),
        "local_layers": tuple(local),
        "local_rope_theta": float(metadata.get(f"{arch}.rope.freq_base_swa", 10000.0)),
        "value_norm": True,
        "kv_shared": shared,
        "ple_dim": int(metadata.get(f"{arch}.embedding_length_per_layer_input", 0)),
        "final_softcap": None if softcap is None else float(softcap),
        "global_head_dim": global_dim if global_dim != head_dim else None,
        "global_kv_heads": global_kv if kv_heads not in (None, global_kv) else None,
        "wide_ffn": wide,
        # a mixture's dense MLP beside its experts (whose fields config_from_gguf reads)
        "dense_ffn": width if metadata.get(f"{arch}.expert_count") else 0,
    }
    shape = {"head_dim": head_dim, "n_kv_heads": kv_heads or global_kv, "ffn_hidden": width}
    return fields, shape


@dataclass(frozen=True)
class Gemma4(Family):
    """Gemma 4 (text): Gemma 3's layer with plain norms, unscaled values' norm, scores unscaled,
    per-layer input embeddings, KV shared by the last layers, proportional RoPE on the global
    layers, a soft-capped final logit, and a mixture of its own; all of it this module's."""

    norms_by_place: bool = True
    windowed_layers: bool = True

    def hf_fields(self, config: dict[str, Any], source: str) -> dict[str, Any]:
        return hf_fields(config, source)

    def gguf_fields(
        self, metadata: dict[str, Any], arch: str, source: str, n_layers: int
    ) -> tuple[dict[str, Any], dict[str, int]]:
        return gguf_fields(metadata, arch, source, n_layers)

    def layer_config(self, config: ModelConfig, layer: int) -> ModelConfig:
        return layer_config(config, layer)

    def layer_view(self, config: ModelConfig, s: Slice, layer: int) -> tuple[ModelConfig, Slice]:
        return layer_view(config, s, layer)

    def rope_config(self, config: ModelConfig) -> ModelConfig:
        return global_config(config)

    def kv_source(self, config: ModelConfig, layer: int) -> int:
        return kv_source(config, layer)

    def keeps_whole_context(self, config: ModelConfig, layer: int) -> bool:
        return keeps_whole_context(config, layer)

    def gguf_name(self, config: ModelConfig, layer: int | None, name: str) -> str | None:
        return gguf_name(config, layer, name)

    def hf_name(self, config: ModelConfig, layer: int | None, name: str) -> str | None:
        return hf_name(config, layer, name)

    def gguf_tensor_fields(self, config: ModelConfig, file: GGUFFile) -> dict[str, Any]:
        return gguf_tensor_fields(config, file)

    def stored_name(self, config: ModelConfig, layer: int, name: str) -> str:
        return stored_name(config, layer, name)

    def absent(self, config: ModelConfig, layer: int, name: str) -> bool:
        return name in SHARED_ABSENT and shares_kv(config, layer)

    def global_names(self, config: ModelConfig) -> list[str]:
        return global_names(config)

    def global_dtypes(self, source: Source, dtype: str) -> dict[str, str]:
        return global_dtypes(source, dtype)

    def global_shape(self, config: ModelConfig, name: str) -> tuple[int, int]:
        return global_shape(config, name)

    def gathered(self, name: str) -> bool:
        return name in STACKED

    def global_rows(self, source: Source, name: str, start: int, stop: int) -> torch.Tensor | None:
        return global_rows(source, name, start, stop)

    def layer_inputs(
        self,
        ids: torch.Tensor,
        embedded: torch.Tensor,
        t: dict[str, torch.Tensor],
        config: ModelConfig,
    ) -> torch.Tensor | None:
        return per_layer_inputs(ids, embedded, t, config) if config.ple_dim else None

    def route(
        self,
        h: np.ndarray,
        layer: int,
        t: dict[str, torch.Tensor],
        router: torch.Tensor,
        config: ModelConfig,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        return route(h, layer, t, router, config) if config.dense_ffn else None

    def ffn_out(
        self,
        h: np.ndarray,
        layer: int,
        out: np.ndarray,
        t: dict[str, torch.Tensor],
        config: ModelConfig,
    ) -> np.ndarray:
        return mixture_out(h, layer, out, t, config) if config.dense_ffn else out

    def end_of_layer(
        self,
        h: np.ndarray,
        layer: int,
        inputs: torch.Tensor | None,
        t: dict[str, torch.Tensor],
        config: ModelConfig,
    ) -> np.ndarray:
        return end_of_layer(h, layer, inputs, t, config) if global_names(config) else h

    def logits(self, logits: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        return softcap(logits, config.final_softcap)


FAMILY = Gemma4("Gemma 4 (text)", "gemma4", "Gemma4ForCausalLM", qk_norm=True)
