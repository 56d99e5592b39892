"""SmolLM3: Llama's layer, but every 4th layer's queries and keys are not rotated (its NoPE
layers), which `ModelConfig.unrotated_layers` lists and the executor's second RoPE table leaves
as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgetp.models.errors import ModelError
from edgetp.models.family import Family

# llama.cpp fixes the interval at 4, with no GGUF key for it; a config.json may list other layers
EVERY = 4


def hf_unrotated(config: dict[str, Any], source: str) -> tuple[int, ...]:
    """The layers a SmolLM3 config.json leaves unrotated, as transformers reads it: those its
    `no_rope_layers` flags with 0, or else every `no_rope_layer_interval`-th."""
    n_layers = int(config["num_hidden_layers"])
    flags = config.get("no_rope_layers")
    if flags is None:
        every = int(config.get("no_rope_layer_interval") or EVERY)
        flags = [int((i + 1) % every != 0) for i in range(n_layers)]
    if len(flags) != n_layers:
        raise ModelError(f"{source}: no_rope_layers has {len(flags)} flags for {n_layers} layers")
    return tuple(i for i, rotated in enumerate(flags) if not rotated)


@dataclass(frozen=True)
class SmolLM3(Family):
    def hf_fields(self, config: dict[str, Any], source: str) -> dict[str, Any]:
        return {"unrotated_layers": hf_unrotated(config, source)}

    def gguf_fields(
        self, metadata: dict[str, Any], arch: str, source: str, n_layers: int
    ) -> tuple[dict[str, Any], dict[str, int]]:
        unrotated = tuple(i for i in range(n_layers) if (i + 1) % EVERY == 0)
        return {"unrotated_layers": unrotated}, {}


FAMILY = SmolLM3("SmolLM3", "smollm3", "SmolLM3ForCausalLM", gguf_permuted=True)
