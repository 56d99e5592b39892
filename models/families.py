"""The model families edgetp runs: their names in GGUF and HF files and what each changes in
the Llama layer math, and the one error for any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgetp.models.errors import ModelError


@dataclass(frozen=True)
class Family:
    """A supported model family: its names in GGUF and HF files, and what it changes in the
    Llama layer math."""

    name: str  # as users know it
    gguf: str  # GGUF `general.architecture`
    hf: str  # HF config.json `architectures[0]`
    qkv_bias: bool = False  # the Q, K and V projections carry a bias (Qwen2)
    qk_norm: bool = False  # each query and key head is RMS-normed before RoPE (Qwen3)
    fused: bool = False  # Q, K, V stored as one matrix, gate and up as another (Phi-3)
    # Gemma 3: norms of (1 + weight) (HF files store the weight, GGUF files 1 + weight), an
    # embedding scaled by sqrt(hidden), post-block norms, GeGLU, local sliding-window layers
    gemma: bool = False
    moe: bool = False  # every layer's FFN is a mixture of experts (Qwen3-MoE, Mixtral)
    # config.json's key of an expert's width; Mixtral's experts are `intermediate_size` wide
    expert_width: str = "moe_intermediate_size"
    # Mixtral renormalises its top-k weights always (a softmax over the top-k logits); None:
    # as config.json's `norm_topk_prob` says (Qwen3-MoE)
    norm_topk: bool | None = None
    # the FFN holds a shared expert beside the routed ones, weighted by a sigmoid gate (Qwen2-MoE)
    shared_expert: bool = False
    # llama.cpp renormalises the top-k weights of a GGUF file's mixture (unless the file says
    # otherwise), but never a qwen2moe's
    gguf_norm_topk: bool = True
    # every n-th layer's queries and keys are not rotated (SmolLM3's NoPE layers: llama.cpp
    # fixes n at 4, with no GGUF key for it; a config.json may list other layers)
    unrotated_every: int = 0
    # gpt-oss: a learned logit a query head in its softmax's denominator (attention sinks), Q,
    # K, V and O biases, sliding-window layers between full ones, a router and experts with
    # biases, the experts' clamped SwiGLU
    gpt_oss: bool = False
    # Qwen3.5, Qwen3-Next: gated DeltaNet (linear attention) layers among full-attention ones
    # whose queries carry an output gate; every norm but the DeltaNet's own scales by (1 +
    # weight), as Gemma's (HF files store the weight)
    deltanet: bool = False
    # Gemma 4 (text): Gemma 3's layer with plain norms, unscaled values' norm, scores unscaled,
    # per-layer input embeddings, KV shared by the last layers, proportional RoPE on the global
    # layers and a soft-capped final logit (models/gemma4.py)
    gemma4: bool = False


FAMILIES = (
    Family("Llama 2, 3.x", "llama", "LlamaForCausalLM"),
    Family("Mistral", "mistral", "MistralForCausalLM"),
    Family("Qwen2, 2.5", "qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    Family("Qwen3", "qwen3", "Qwen3ForCausalLM", qk_norm=True),
    Family("Phi-3, 3.5, 4-mini", "phi3", "Phi3ForCausalLM", fused=True),
    Family("Gemma 3 (text)", "gemma3", "Gemma3ForCausalLM", qk_norm=True, gemma=True),
    Family("Qwen3-MoE", "qwen3moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True),
    Family("SmolLM3", "smollm3", "SmolLM3ForCausalLM", unrotated_every=4),
    Family(
        "Qwen2-MoE",
        "qwen2moe",
        "Qwen2MoeForCausalLM",
        qkv_bias=True,
        moe=True,
        shared_expert=True,
        gguf_norm_topk=False,
    ),
    # llama.cpp writes Mixtral as a `llama` whose layers hold experts (`llama.expert_count`)
    Family(
        "Mixtral",
        "llama",
        "MixtralForCausalLM",
        moe=True,
        expert_width="intermediate_size",
        norm_topk=True,
    ),
    Family("Gemma 4 (text)", "gemma4", "Gemma4ForCausalLM", qk_norm=True, gemma4=True),
    # top-k of the router's logits, then a softmax over those: renormalised top-k weights
    Family(
        "gpt-oss",
        "gpt-oss",
        "GptOssForCausalLM",
        qkv_bias=True,
        moe=True,
        expert_width="intermediate_size",
        norm_topk=True,
        gpt_oss=True,
    ),
    Family("Qwen3.5", "qwen35", "Qwen3_5ForCausalLM", qk_norm=True, deltanet=True),
    Family(
        "Qwen3.5-MoE",
        "qwen35moe",
        "Qwen3_5MoeForCausalLM",
        qk_norm=True,
        moe=True,
        norm_topk=True,  # its router renormalises its top-k weights always
        shared_expert=True,
        deltanet=True,
    ),
    Family(
        "Qwen3-Next",
        "qwen3next",
        "Qwen3NextForCausalLM",
        qk_norm=True,
        moe=True,
        shared_expert=True,
        deltanet=True,
    ),
)
# A GGUF architecture's family is its first: a `llama` file with experts is read as Mixtral
# by `ModelConfig.from_gguf`.
GGUF_ARCHITECTURES: dict[str, Family] = {}
for _family in FAMILIES:
    GGUF_ARCHITECTURES.setdefault(_family.gguf, _family)
HF_ARCHITECTURES = {f.hf: f for f in FAMILIES}


# What edgetp lacks for families people ask for, by GGUF and HF architecture name.
MISSING = {
    **dict.fromkeys(
        ("deepseek2", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"),
        "multi-head latent attention (MLA)",
    ),
}


def unsupported(source: str, arch: Any) -> ModelError:
    """The one error for a model of another family, naming what it lacks where that is known
    and every family that is supported."""
    supported = "; ".join(f"{f.name} ({f.gguf} / {f.hf})" for f in FAMILIES)
    lacks = f" (it needs {MISSING[arch]}, which edgetp lacks)" if arch in MISSING else ""
    return ModelError(
        f"{source}: architecture {arch!r} is not supported{lacks}. Supported families: {supported}"
    )
