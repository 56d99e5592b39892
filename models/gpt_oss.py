"""gpt-oss: a learned logit a query head in its softmax's denominator (attention sinks), Q, K,
V and O biases, sliding-window layers between full ones, a router and experts with biases, the
experts' clamped SwiGLU: config fields the layer's code reads (models/moe.py has the SwiGLU),
which this module reads from a model's files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgetp.models.errors import ModelError
from edgetp.models.family import Family, gguf_key


def fields(
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


def hf_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
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
    return fields(
        tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        int(config["sliding_window"]),
        float(config.get("swiglu_alpha") or 1.702),
        float(config.get("swiglu_limit") or 7.0),
    )


@dataclass(frozen=True)
class GptOss(Family):
    gguf_yarn_truncate: bool = False  # its published config does not truncate
    windowed_layers: bool = True

    def hf_fields(self, config: dict[str, Any], source: str) -> dict[str, Any]:
        return hf_fields(config, source)

    def gguf_fields(
        self, metadata: dict[str, Any], arch: str, source: str, n_layers: int
    ) -> tuple[dict[str, Any], dict[str, int]]:
        # as llama.cpp reads it: the even layers attend to a window
        window = int(gguf_key(metadata, arch, source, "attention.sliding_window"))
        return fields(tuple(range(0, n_layers, 2)), window), {}


# top-k of the router's logits, then a softmax over those: renormalised top-k weights
FAMILY = GptOss(
    "gpt-oss",
    "gpt-oss",
    "GptOssForCausalLM",
    qkv_bias=True,
    moe=True,
    expert_width="intermediate_size",
    norm_topk=True,
)
