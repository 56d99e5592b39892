"""A mixture's fields of a config.json, which every family of experts reads alike
(`Family.moe`): `models.config.ModelConfig` builds itself with them. What a family adds of its
own, its module reads (`Family.hf_fields`, `Family.gguf_fields`).
"""

from __future__ import annotations

from typing import Any

from edgetp.models.errors import ModelError
from edgetp.models.family import Family


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
