"""The one interface to a model family: what it changes in the Llama layer, with Llama's own
behaviour as the default.

A family that only switches parts of the layer on (biases, query and key norms, fused
matrices, a mixture's experts) is a `Family` with its flags set, one line of the registry
(models/families.py). A family that computes something of its own subclasses `Family` in its
module (models/gemma4.py, models/deltanet.py, ...) and overrides the methods below; the engine,
the executor, the KV cache and the splitter reach it only through `families.family_of(config)`,
and never ask which family it is.

Every method takes the model's config: a family is one object for all its models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from edgetp.models.errors import ModelError

if TYPE_CHECKING:  # models.config builds itself with the families: no import at run time
    from edgetp.models.config import ModelConfig
    from edgetp.models.gguf_file import GGUFFile
    from edgetp.models.layers import Slice, StepBatch


class Source(Protocol):
    """What a family reads of a model source (models.source_base.ModelSource)."""

    config: ModelConfig

    def stored_type(self, layer: int | None, name: str) -> str: ...

    def _rows(
        self, layer: int | None, name: str, start: int, stop: int, blocks: bool
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Family:
    """A supported model family: its names in GGUF and HF files, the parts of the Llama layer
    it switches on, and (in a subclass) what it computes otherwise."""

    name: str  # as users know it
    gguf: str  # GGUF `general.architecture`
    hf: str  # HF config.json `architectures[0]`
    qkv_bias: bool = False  # the Q, K and V projections carry a bias (Qwen2)
    qk_norm: bool = False  # each query and key head is RMS-normed before RoPE (Qwen3)
    fused: bool = False  # Q, K, V stored as one matrix, gate and up as another (Phi-3)
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

    # An HF file stores the weight of a norm that scales by (1 + weight) (`norm_plus_one`);
    # names its norms after where they sit, "post_attention" after attention, not before the
    # FFN as Llama's (`norms_by_place`).
    norm_plus_one: bool = False
    norms_by_place: bool = False
    # A yarn RoPE of a GGUF file ramps between whole pairs (transformers' default), unless the
    # family's published configs say not (a GGUF file has no key for it).
    gguf_yarn_truncate: bool = True
    # llama.cpp's converter permutes a GGUF file's Q and K rows for its interleaved RoPE
    gguf_permuted: bool = False
    # Some layers attend to a window (an HF file's `sliding_window` does not cut the context).
    windowed_layers: bool = False

    # -- the config: what a file's metadata gives the family's own fields (models.config)

    def hf_fields(self, config: dict[str, Any], source: str) -> dict[str, Any]:
        """The family's own ModelConfig fields, read from a config.json."""
        return {}

    def gguf_fields(
        self, metadata: dict[str, Any], arch: str, source: str, n_layers: int
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """The family's own ModelConfig fields, read from GGUF metadata under `arch`; and the
        shape fields (head_dim, n_kv_heads, ffn_hidden) where the family's keys give them."""
        return {}, {}

    # -- a layer's shape and its KV

    def layer_config(self, config: ModelConfig, layer: int) -> ModelConfig:
        """Layer `layer`'s shape: the model's, in Llama."""
        return config

    def layer_view(self, config: ModelConfig, s: Slice, layer: int) -> tuple[ModelConfig, Slice]:
        """Layer `layer`'s shape and slice `s`'s share of it: the model's, in Llama."""
        return config, s

    def rope_config(self, config: ModelConfig) -> ModelConfig:
        """The shape the model's RoPE table is built for."""
        return config

    def kv_source(self, config: ModelConfig, layer: int) -> int:
        """The layer whose keys and values `layer` attends to: its own."""
        return layer

    def shares_kv(self, config: ModelConfig, layer: int) -> bool:
        """Whether `layer` reads another layer's keys and values (and holds none)."""
        return self.kv_source(config, layer) != layer

    def keeps_whole_context(self, config: ModelConfig, layer: int) -> bool:
        """Whether a local `layer` keeps every position, not a ring of its window."""
        return False

    def gguf_name(self, config: ModelConfig, layer: int | None, name: str) -> str | None:
        """The GGUF name of a tensor of the family's own layout (`layer` None: a global);
        None for the name every family shares (models/source.py)."""
        return None

    def hf_name(self, config: ModelConfig, layer: int | None, name: str) -> str | None:
        """Likewise in an HF folder, "model."-prefixed (models/hf_source.py)."""
        return None

    def gguf_tensor_fields(self, config: ModelConfig, file: GGUFFile) -> dict[str, Any]:
        """The family's fields that a GGUF file's tensors say rather than its keys."""
        return {}

    def stored_name(self, config: ModelConfig, layer: int, name: str) -> str:
        """The canonical tensor a file holds layer `layer`'s `name` as: itself."""
        return name

    def absent(self, config: ModelConfig, layer: int, name: str) -> bool:
        """Whether layer `layer`'s file lacks `name`, for which zeros stand in (never read)."""
        return False

    # -- linear-attention layers (`ModelConfig.linear_layers`) and their recurrent state

    def linear_channels(self, config: ModelConfig, s: Slice) -> tuple[int, int, int]:
        """A slice's convolution channels of queries, keys and values."""
        raise ModelError(f"{self.name} has no linear-attention layers")

    def linear_recur(
        self,
        x: torch.Tensor,
        beta: torch.Tensor,
        g: torch.Tensor,
        taps: torch.Tensor,
        conv_state: torch.Tensor,
        state: torch.Tensor,
        s: Slice,
        config: ModelConfig,
    ) -> torch.Tensor:
        """One sequence's tokens through a linear-attention layer's recurrence, its state
        carried on in place."""
        raise ModelError(f"{self.name} has no linear-attention layers")

    def linear_partial(
        self,
        h: torch.Tensor,
        w: dict[str, torch.Tensor],
        s: Slice,
        config: ModelConfig,
        conv_states: torch.Tensor,
        states: torch.Tensor,
        batch: StepBatch,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A slice's partial of a linear-attention layer, and its recurrence's inputs."""
        raise ModelError(f"{self.name} has no linear-attention layers")

    # -- the master's: tensors of its own, and what it computes between the layers' sums

    def global_names(self, config: ModelConfig) -> list[str]:
        """The tensors the master holds beside the embedding, head and norms: none."""
        return []

    def global_dtypes(self, source: Source, dtype: str) -> dict[str, str]:
        """How the split stores `global_names` when it asks for `dtype`."""
        return {}

    def global_shape(self, config: ModelConfig, name: str) -> tuple[int, int]:
        """The shape of one of `global_names`."""
        raise KeyError(name)

    def gathered(self, name: str) -> bool:
        """Whether the global `name` gathers a tensor of each layer (`global_rows`)."""
        return False

    def global_rows(self, source: Source, name: str, start: int, stop: int) -> torch.Tensor | None:
        """Rows [start, stop) of a global the family gathers from the file's tensors of each
        layer (float32); None for a tensor the file holds as it is."""
        return None

    def layer_inputs(
        self,
        ids: torch.Tensor,
        embedded: torch.Tensor,
        t: dict[str, torch.Tensor],
        config: ModelConfig,
    ) -> torch.Tensor | None:
        """What the layers take beside the hidden state, from the tokens `ids` (B, T) and
        their embedding (B, T, D): nothing."""
        return None

    def route(
        self,
        h: np.ndarray,
        layer: int,
        t: dict[str, torch.Tensor],
        router: torch.Tensor,
        config: ModelConfig,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """A router of the family's own form: each token's experts and weights; None for the
        one every mixture shares (models/moe.py)."""
        return None

    def ffn_out(
        self,
        h: np.ndarray,
        layer: int,
        out: np.ndarray,
        t: dict[str, torch.Tensor],
        config: ModelConfig,
    ) -> np.ndarray:
        """Layer `layer`'s FFN output from the sum of its slices' `out`: that sum."""
        return out

    def end_of_layer(
        self,
        h: np.ndarray,
        layer: int,
        inputs: torch.Tensor | None,
        t: dict[str, torch.Tensor],
        config: ModelConfig,
    ) -> np.ndarray:
        """The hidden state after layer `layer`'s two sums: as they left it."""
        return h

    def logits(self, logits: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """The model's logits from the head's: the same."""
        return logits


def gguf_key(
    metadata: dict[str, Any], arch: str, source: str, name: str, default: Any = None
) -> Any:
    """GGUF metadata key `arch.name`: its value, else `default`, else a ModelError naming it."""
    full = f"{arch}.{name}"
    if full in metadata:
        return metadata[full]
    if default is None:
        raise ModelError(f"{source}: GGUF metadata key {full!r} is missing")
    return default
