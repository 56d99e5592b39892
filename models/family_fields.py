"""What each model family adds to a config: its fields, read from a config.json or fixed
for its GGUF files (Gemma 3's and gpt-oss' local layers, the experts of a mixture, SmolLM3's
unrotated layers). `models.config.ModelConfig` builds itself with them.
"""

from __future__ import annotations

import math
from typing import Any

from edgetp.models.errors import ModelError
from edgetp.models.families import Family

GPT_OSS_FIELDS = ("attention_sinks", "o_bias", "router_bias", "expert_bias", "swiglu_alpha",
                   "swiglu_limit")  # fmt: skip


def gpt_oss_fields(
    local: tuple[int, ...], window: int, alpha: float = 1.702, limit: float = 7.0
) -> dict[str, Any]:
    """The fields of a gpt-oss: its local layers (`window` positions), sinks, biases, and its
    experts' SwiGLU clamped at `limit` (1.702 and 7.0 as transformers' GptOssConfig and
    llama.cpp have them)."""
    return {
        "sliding_window": window,
        "local_layers": local,
        "attention_sinks": True,
        "o_bias": True,
        "router_bias": True,
        "expert_bias": True,
        "swiglu_alpha": alpha,
        "swiglu_limit": limit,
    }


def hf_gpt_oss(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The gpt-oss fields of a `GptOssForCausalLM` config.json: by default the even layers
    attend to a window (transformers' GptOssConfig)."""
    n_layers = int(config["num_hidden_layers"])
    types = config.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
    ]
    if len(types) != n_layers:
        raise ModelError(f"{source}: layer_types has {len(types)} entries for {n_layers} layers")
    if config.get("sliding_window") is None:
        raise ModelError(f"{source}: config.json key 'sliding_window' is missing")
    if not config.get("attention_bias", True):
        raise ModelError(f"{source}: a gpt-oss without attention biases is not supported")
    return gpt_oss_fields(
        tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        int(config["sliding_window"]),
        float(config.get("swiglu_alpha") or 1.702),
        float(config.get("swiglu_limit") or 7.0),
    )


DELTANET_FIELDS = ("linear_layers", "linear_k_heads", "linear_v_heads", "linear_k_dim",
                   "linear_v_dim", "linear_conv", "attention_gate")  # fmt: skip


def hf_deltanet(config: dict[str, Any], source: str) -> dict[str, Any]:
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


def gguf_deltanet(
    metadata: dict[str, Any], arch: str, source: str, n_layers: int
) -> dict[str, Any]:
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


def hf_unrotated(config: dict[str, Any], source: str, family: Family) -> tuple[int, ...]:
    """The layers a SmolLM3 config.json leaves unrotated, as transformers reads it: those its
    `no_rope_layers` flags with 0, or else every `no_rope_layer_interval`-th."""
    if not family.unrotated_every:
        return ()
    n_layers = int(config["num_hidden_layers"])
    flags = config.get("no_rope_layers")
    if flags is None:
        every = int(config.get("no_rope_layer_interval") or family.unrotated_every)
        flags = [int((i + 1) % every != 0) for i in range(n_layers)]
    if len(flags) != n_layers:
        raise ModelError(f"{source}: no_rope_layers has {len(flags)} flags for {n_layers} layers")
    return tuple(i for i, rotated in enumerate(flags) if not rotated)


def hf_moe(config: dict[str, Any], source: str, family: Family) -> dict[str, Any]:
    """The mixture-of-experts fields of a `Qwen3MoeForCausalLM` or `MixtralForCausalLM`
    config.json. Every layer's FFN must be sparse: dense layers among them (`mlp_only_layers`,
    `decoder_sparse_step`) are not supported yet."""
    n_layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or []) | {
        i for i in range(n_layers) if (i + 1) % step
    }
    if dense:
        raise ModelError(
            f"{source}: dense FFN layers {sorted(dense)} among the experts' are not supported"
        )
    # "num_experts" as published; transformers 5 writes "num_local_experts"
    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts is None:
        raise ModelError(f"{source}: config.json key 'num_experts' is missing")
    for name in ("num_experts_per_tok", family.expert_width):
        if config.get(name) is None:
            raise ModelError(f"{source}: config.json key {name!r} is missing")
    if (config.get("hidden_act") or "silu") != "silu":
        raise ModelError(f"{source}: expert activation {config['hidden_act']!r} is not supported")
    shared = {}
    if family.shared_expert:
        if config.get("shared_expert_intermediate_size") is None:
            raise ModelError(
                f"{source}: config.json key 'shared_expert_intermediate_size' is missing"
            )
        width = int(config["shared_expert_intermediate_size"])
        shared["n_shared"] = shared_experts(width, int(config[family.expert_width]), source)
    return shared | {
        "ffn_hidden": int(config[family.expert_width]),
        "n_experts": int(experts),
        "n_experts_used": int(config["num_experts_per_tok"]),
        "norm_topk_prob": family.norm_topk
        if family.norm_topk is not None
        else bool(config.get("norm_topk_prob", False)),
    }


def shared_experts(shared: int, expert: int, source: str) -> int:
    """How many experts' widths the shared expert is: it is cut as that many more experts."""
    if not shared or shared % expert:
        raise ModelError(
            f"{source}: a shared expert {shared} wide, not a multiple of the experts' {expert}, "
            "is not supported"
        )
    return shared // expert


def hf_gemma(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The Gemma 3 fields of a `Gemma3ForCausalLM` config.json."""
    for unsupported_key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(unsupported_key) is not None:  # Gemma 2's, not Gemma 3's
            raise ModelError(f"{source}: {unsupported_key} is not supported")
    if config.get("use_bidirectional_attention"):
        raise ModelError(f"{source}: bidirectional attention (an embedding model) is not supported")
    activation = config.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelError(f"{source}: FFN activation {activation!r} is not supported")
    n_layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if not types:  # older files: every `sliding_window_pattern`-th layer is global
        pattern = int(config.get("sliding_window_pattern") or 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(n_layers)]  # fmt: skip
    local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    return {
        "embedding_multiplier": math.sqrt(int(config["hidden_size"])),
        "post_norms": True,
        "activation": "gelu_tanh",
        "query_scale": float(config.get("query_pre_attn_scalar") or 256) ** -0.5,
        "sliding_window": int(config["sliding_window"]),
        "local_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        "local_rope_theta": float(
            local.get("rope_theta") or config.get("rope_local_base_freq") or 10000.0
        ),
    }


GEMMA4_FIELDS = ("value_norm", "kv_shared", "k_eq_v", "ple_dim", "ple_vocab", "final_softcap",
                 "global_head_dim", "global_kv_heads", "wide_ffn", "dense_ffn")  # fmt: skip


def hf_gemma4(config: dict[str, Any], source: str) -> dict[str, Any]:
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
    global_heads = _gemma4_global_heads(config, types, source)
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
        **(_gemma4_experts(config, source) if config.get("enable_moe_block") else {}),
    }


def _gemma4_experts(config: dict[str, Any], source: str) -> dict[str, Any]:
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


def _gemma4_global_heads(config: dict[str, Any], types: list[str], source: str) -> dict[str, Any]:
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


def gguf_gemma4(
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
        # a mixture's dense MLP beside its experts (whose fields `ModelConfig.from_gguf` reads)
        "dense_ffn": width if metadata.get(f"{arch}.expert_count") else 0,
    }
    shape = {"head_dim": head_dim, "n_kv_heads": kv_heads or global_kv, "ffn_hidden": width}
    return fields, shape
