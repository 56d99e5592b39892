"""A model's config read from its file: GGUF metadata or an HF `config.json`, each through its
family (models/families.py), which adds what it does differently."""

from __future__ import annotations

from typing import Any

from edgetp.models.config import ModelConfig, RopeScaling
from edgetp.models.errors import ModelError
from edgetp.models.families import GGUF_ARCHITECTURES, HF_ARCHITECTURES, unsupported
from edgetp.models.family import Family, gguf_key
from edgetp.models.family_fields import hf_moe, shared_experts


def config_from_gguf(
    metadata: dict[str, Any],
    source: str,
    tied: bool,
    longrope: tuple[list[float], list[float]] | None = None,
) -> ModelConfig:
    """`longrope`: the file's short and long RoPE factor tensors, where it has them."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise unsupported(source, arch)
    family: Family = GGUF_ARCHITECTURES[arch]
    arch = family.gguf

    def key(name: str, default: Any = None) -> Any:
        return gguf_key(metadata, arch, source, name, default)

    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", []))
    if not vocab:
        raise ModelError(f"{source}: neither {arch}.vocab_size nor a token list is present")
    scaling = None
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
    elif scaling_type == "yarn":
        scaling = RopeScaling(
            "yarn",
            float(key("rope.scaling.factor")),
            original_context=int(key("rope.scaling.original_context_length")),
            truncate=family.gguf_yarn_truncate,
        )
    elif scaling_type not in (None, "none"):
        raise ModelError(f"{source}: RoPE scaling {scaling_type!r} is not supported")
    if longrope is not None:
        original = int(key("rope.scaling.original_context_length"))
        scaling = RopeScaling(
            "longrope",
            float(key("context_length")) / original,
            original_context=original,
            attention_factor=metadata.get(f"{arch}.rope.scaling.attn_factor"),
            short_factor=tuple(longrope[0]),
            long_factor=tuple(longrope[1]),
        )
    head_dim = int(key("attention.key_length", hidden // n_heads))
    rotary_dim = int(key("rope.dimension_count", head_dim))
    n_layers = int(key("block_count"))
    # the family's own fields, and its shape where its keys give it (one a layer)
    own, shape = family.gguf_fields(metadata, arch, source, n_layers)
    if "head_dim" in shape:  # most layers' where the key gives another kind's
        head_dim = rotary_dim = shape["head_dim"]
    moe: dict[str, Any] = {}
    if family.moe or metadata.get(f"{arch}.expert_count"):
        # llama.cpp's converter: a qwen3moe's experts' own width, a Mixtral's the FFN's
        width = int(metadata.get(f"{arch}.expert_feed_forward_length") or 0)
        width = width or int(key("feed_forward_length"))
        moe = {
            "ffn_hidden": width,
            "n_experts": int(key("expert_count")),
            "n_experts_used": int(key("expert_used_count")),
            "norm_topk_prob": bool(
                metadata.get(f"{arch}.expert_weights_norm", family.gguf_norm_topk)
            ),
        }
        if family.shared_expert:  # llama.cpp: as wide as the FFN unless the file says
            shared = metadata.get(f"{arch}.expert_shared_feed_forward_length")
            shared = int(shared or key("feed_forward_length"))
            moe["n_shared"] = shared_experts(shared, width, source)
    else:
        moe = {"ffn_hidden": shape.get("ffn_hidden") or int(key("feed_forward_length"))}
    return ModelConfig(
        architecture=arch,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=shape.get("n_kv_heads") or int(key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        context_length=int(key("context_length")),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        fused=family.fused,
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        tied_embeddings=tied,
        **own,
        **moe,
    )


def config_from_hf(config: dict[str, Any], source: str) -> ModelConfig:
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in HF_ARCHITECTURES:
        raise unsupported(source, arch)
    family: Family = HF_ARCHITECTURES[arch]
    arch = family.hf

    def key(name: str) -> Any:
        if config.get(name) is None:
            raise ModelError(f"{source}: config.json key {name!r} is missing")
        return config[name]

    hidden = int(key("hidden_size"))
    n_heads = int(key("num_attention_heads"))
    head_dim = int(config.get("head_dim") or hidden // n_heads)
    partial = float(_hf_rope(config).get("partial_rotary_factor") or 1.0)
    if _hf_rope(config).get("rope_type") == "proportional":  # RopeScaling.rotated
        partial = 1.0
    rotary_dim = int(head_dim * partial)
    context = int(key("max_position_embeddings"))
    # Attention over only the last `sliding_window` positions (Mistral 7B v0.1, Phi-3 mini
    # 4k) equals full attention while the sequence fits in the window: the context stops
    # there. (Qwen2 configs name a window they do not use.)
    window = config.get("sliding_window")
    # (not a family's whose window is on some layers only)
    if window and config.get("use_sliding_window", True) and not family.windowed_layers:
        context = min(context, int(window))
    own = family.hf_fields(config, source)
    # transformers' attention_bias gives O its bias too (Llama, Qwen3, Gemma 3, SmolLM3);
    # the families whose O has none (Mistral, Qwen2) have no such key
    o_bias = {"o_bias": True} if config.get("attention_bias") else {}
    dense = {"ffn_hidden": int(key("intermediate_size"))} if not family.moe else {}
    moe = hf_moe(config, source, family) if family.moe else dense
    return ModelConfig(
        architecture=arch,
        n_layers=int(key("num_hidden_layers")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        vocab_size=int(key("vocab_size")),
        context_length=context,
        norm_eps=float(key("rms_norm_eps")),
        rope_theta=float(_hf_rope(config).get("rope_theta") or 10000.0),
        rope_scaling=_hf_rope_scaling(config, source),
        qkv_bias=family.qkv_bias or bool(config.get("attention_bias")),
        qk_norm=family.qk_norm,
        fused=family.fused,
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        **(o_bias | moe | own),  # a family's own experts' width (Gemma 4's) is its own
    )


def _hf_rope(config: dict[str, Any]) -> dict[str, Any]:
    """RoPE base and scaling keys of a config.json: top-level `rope_theta`,
    `partial_rotary_factor` and `rope_scaling` as most published models have them, or the one
    `rope_parameters` of newer files."""
    top = {k: config.get(k) for k in ("rope_theta", "partial_rotary_factor")}
    newer = config.get("rope_parameters") or {}
    newer = newer.get("full_attention", newer)  # Gemma 3: one per kind of layer; global here
    return top | (config.get("rope_scaling") or {}) | newer


def _hf_rope_scaling(config: dict[str, Any], source: str) -> RopeScaling | None:
    scaling = _hf_rope(config)
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(scaling["factor"]))
    if kind == "yarn":
        if scaling.get("mscale") or scaling.get("mscale_all_dim"):
            raise ModelError(f"{source}: YaRN with mscale (DeepSeek's variant) is not supported")
        return RopeScaling(
            "yarn",
            float(scaling["factor"]),
            original_context=int(
                scaling.get("original_max_position_embeddings") or config["max_position_embeddings"]
            ),
            beta_fast=float(scaling.get("beta_fast") or 32.0),
            beta_slow=float(scaling.get("beta_slow") or 1.0),
            attention_factor=scaling.get("attention_factor"),
            truncate=bool(scaling.get("truncate", True)),
        )
    if kind == "longrope":
        original = int(
            scaling.get("original_max_position_embeddings")
            or config.get("original_max_position_embeddings")
            or config["max_position_embeddings"]
        )
        return RopeScaling(
            "longrope",
            float(scaling.get("factor") or config["max_position_embeddings"] / original),
            original_context=original,
            attention_factor=scaling.get("attention_factor"),
            short_factor=tuple(scaling["short_factor"]),
            long_factor=tuple(scaling["long_factor"]),
        )
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    if kind == "proportional":
        return RopeScaling(
            "proportional",
            float(scaling.get("factor") or 1.0),
            rotated=float(scaling.get("partial_rotary_factor") or 1.0),
        )
    raise ModelError(f"{source}: RoPE scaling {kind!r} is not supported")
