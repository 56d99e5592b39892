"""Gemma 3 (text): norms of (1 + weight) (HF files store the weight, GGUF files 1 + weight), an
embedding scaled by sqrt(hidden), post-block norms, GeGLU, and local sliding-window layers of a
RoPE base of their own between global ones: all of it config fields the Llama layer's code
reads, which this module reads from a model's files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from edgetp.models.errors import ModelError
from edgetp.models.family import Family, gguf_key


def hf_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
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


def gguf_fields(metadata: dict[str, Any], arch: str, source: str, n_layers: int) -> dict[str, Any]:
    """The Gemma 3 fields of a GGUF file, as llama.cpp reads it: every 6th layer global unless
    the file says otherwise, local RoPE base 10000, scores scaled by head_dim (27B: hidden /
    heads)."""
    hidden = int(gguf_key(metadata, arch, source, "embedding_length"))
    n_heads = int(gguf_key(metadata, arch, source, "attention.head_count"))
    head_dim = int(gguf_key(metadata, arch, source, "attention.key_length", hidden // n_heads))
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag a layer: local or not
        local = tuple(i for i, is_local in enumerate(pattern) if is_local)
    else:
        local = tuple(i for i in range(n_layers) if (i + 1) % int(pattern))
    scalar = hidden // n_heads if n_layers == 62 else head_dim
    return {
        "embedding_multiplier": math.sqrt(hidden),
        "post_norms": True,
        "activation": "gelu_tanh",
        "query_scale": scalar**-0.5,
        "sliding_window": int(gguf_key(metadata, arch, source, "attention.sliding_window")),
        "local_layers": local,
        "local_rope_theta": float(metadata.get(f"{arch}.rope.freq_base_swa", 10000.0)),
    }


@dataclass(frozen=True)
class Gemma3(Family):
    norm_plus_one: bool = True
    norms_by_place: bool = True
    windowed_layers: bool = True

    def hf_fields(self, config: dict[str, Any], source: str) -> dict[str, Any]:
        return hf_fields(config, source)

    def gguf_fields(
        self, metadata: dict[str, Any], arch: str, source: str, n_layers: int
    ) -> tuple[dict[str, Any], dict[str, int]]:
        return gguf_fields(metadata, arch, source, n_layers), {}


FAMILY = Gemma3("Gemma 3 (text)", "gemma3", "Gemma3ForCausalLM", qk_norm=True)
