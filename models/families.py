"""The registry of model families: each one's names in GGUF and HF files, mapped to the
`Family` (models/family.py) that says what it does differently, and the one error for any
other architecture.

A family whose differences are flags of the Llama layer is a line here; one that computes
something of its own is its module's `FAMILY`, listed here by one line.
"""

from __future__ import annotations

from typing import Any

from edgetp.models import deltanet, gemma3, gemma4, gpt_oss, smollm3
from edgetp.models.config import ModelConfig
from edgetp.models.errors import ModelError
from edgetp.models.family import Family

FAMILIES: tuple[Family, ...] = (
    Family("Llama 2, 3.x", "llama", "LlamaForCausalLM", gguf_permuted=True),
    Family("Mistral", "mistral", "MistralForCausalLM", gguf_permuted=True),
    Family("Qwen2, 2.5", "qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    Family("Qwen3", "qwen3", "Qwen3ForCausalLM", qk_norm=True),
    Family("Phi-3, 3.5, 4-mini", "phi3", "Phi3ForCausalLM", fused=True),
    gemma3.FAMILY,
    Family("Qwen3-MoE", "qwen3moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True),
    smollm3.FAMILY,
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
        gguf_permuted=True,
    ),
    gemma4.FAMILY,
    gpt_oss.FAMILY,
    deltanet.QWEN35,
    deltanet.QWEN35_MOE,
    deltanet.QWEN3_NEXT,
)
# A GGUF architecture's family is its first: a `llama` file with experts is read as Mixtral
# by `config_files.config_from_gguf`.
GGUF_ARCHITECTURES: dict[str, Family] = {}
for _family in FAMILIES:
    GGUF_ARCHITECTURES.setdefault(_family.gguf, _family)
HF_ARCHITECTURES = {f.hf: f for f in FAMILIES}


def family_of(config: ModelConfig) -> Family:
    """What `config`'s model does differently: the family of its architecture (a GGUF or an HF
    name). The one way the runtime reaches a family."""
    arch = config.architecture
    family = GGUF_ARCHITECTURES.get(arch) or HF_ARCHITECTURES.get(arch)
    if family is None:
        raise unsupported("model config", arch)
    return family


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
