"""What a model is: the shapes and constants the layer math and the split plan need.

One typed config, read from GGUF metadata or an HF `config.json` by models/config_files.py.
Anything edgetp does not support (another architecture, a missing key) is a `ModelError`
naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from edgetp.models.errors import ModelError

# The model `edgetp` runs when none is named: a PyPI package installed by `make setup`.
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama 3.x "llama3", YaRN "yarn" (Qwen2.5), LongRoPE "longrope"
    (Phi-3.5, Phi-4-mini) or plain "linear"."""

    kind: str  # "llama3" | "yarn" | "longrope" | "linear" | "proportional"
    factor: float
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_context: int = 8192  # llama3, yarn, longrope
    beta_fast: float = 32.0  # yarn: rotations below which a frequency is only extrapolated
    beta_slow: float = 1.0  # yarn: rotations above which it is only interpolated
    # yarn: the ramp between them starts and ends at whole pairs (transformers' default; gpt-oss
    # configs say false)
    truncate: bool = True
    # yarn, longrope: cos/sin scale; None: yarn 0.1 ln(factor) + 1, longrope
    # sqrt(1 + ln(factor) / ln(original_context))
    attention_factor: float | None = None
    # longrope: per-frequency divisors for a context within original_context, and beyond it
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # proportional (Gemma 4's global layers): the leading `rotated` of each half of a head's
    # pairs turn at base^(-2k / head_dim), the rest not at all
    rotated: float = 1.0

    def __post_init__(self) -> None:  # JSON gives lists
        object.__setattr__(self, "short_factor", tuple(self.short_factor))
        object.__setattr__(self, "long_factor", tuple(self.long_factor))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    fused: bool = False
    rotary_dim: int | None = None  # leading dims of each head RoPE turns; None: all of them
    tied_embeddings: bool = False
    embedding_multiplier: float = 1.0  # the embedding's rows are scaled by it (Gemma: sqrt(D))
    post_norms: bool = False  # each block's summed output is RMS-normed before the residual
    activation: str = "silu"  # of the FFN's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    query_scale: float | None = None  # of the attention scores; None: 1 / sqrt(head_dim)
    sliding_window: int | None = None  # local layers attend to this many last positions
    local_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # the local layers' RoPE base (they are unscaled)
    # A mixture of experts (Qwen3-MoE): every layer's FFN is `n_experts` SwiGLU experts of
    # `ffn_hidden` columns each (the plan cuts every expert at the same columns), of which a
    # router picks `n_experts_used` a token, their weights renormalised when `norm_topk_prob`.
    n_experts: int = 0
    n_experts_used: int = 0
    norm_topk_prob: bool = False
    # Qwen2-MoE's shared expert, which every token uses weighted by sigmoid(x @ its gate), is
    # `n_shared` experts' widths wide: the plan cuts it as that many more experts, which the
    # master's routing adds to every token's (models/moe.py).
    n_shared: int = 0
    # Layers whose queries and keys RoPE leaves as they are (SmolLM3's NoPE layers; the ones
    # transformers' `no_rope_layers` flags with 0): they attend by content alone.
    unrotated_layers: tuple[int, ...] = ()
    # gpt-oss: each query head's learned logit joins its softmax's denominator (attention
    # sinks); the output projection, the router and the experts carry biases; the experts'
    # SwiGLU is clamped, (up + 1) * gate * sigmoid(alpha * gate), gate at most `swiglu_limit`,
    # up within +-`swiglu_limit` (models/moe.py).
    attention_sinks: bool = False
    o_bias: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    # Qwen3.5, Qwen3-Next (models/deltanet.py): `linear_layers` are gated DeltaNet layers,
    # `linear_v_heads` value heads of `linear_v_dim` reading `linear_k_heads` key heads of
    # `linear_k_dim` through a causal convolution of `linear_conv` taps; the other layers'
    # queries carry an output gate (`attention_gate`: q_proj gives each head its query, then
    # its gate, and the attention's output is times sigmoid(gate) before O).
    linear_layers: tuple[int, ...] = ()
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 0
    attention_gate: bool = False
    # Gemma 4 (models/gemma4.py): values RMS-normed without a weight; the last `kv_shared`
    # layers attend to the keys and values of the last earlier layer of their kind, holding none
    # of their own, and with `wide_ffn` have FFNs twice as wide; the global layers' values are
    # their keys' projection (`k_eq_v`), their heads `global_head_dim` wide and
    # `global_kv_heads` of them (None: as the local layers'); per-layer input embeddings of
    # `ple_dim` a layer from a vocabulary of `ple_vocab`; logits soft-capped at `final_softcap`.
    value_norm: bool = False
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    wide_ffn: bool = False
    # Gemma 4's mixture: beside the experts (`ffn_hidden` wide each), a dense GeGLU
    # `dense_ffn` wide, the master's; each normed on its own before they add
    dense_ffn: int = 0
    kv_shared: int = 0
    k_eq_v: bool = False
    ple_dim: int = 0
    ple_vocab: int = 0
    final_softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("local_layers", "unrotated_layers", "linear_layers"):  # JSON gives lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.unrotated_layers and self.local_rope_theta is not None:
            raise ModelError("unrotated layers beside local layers of their own RoPE base")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ModelError(f"FFN activation {self.activation!r} is not supported")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(
                f"{self.n_heads} attention heads do not divide into {self.n_kv_heads} KV heads"
            )
        if self.n_experts and not 0 < self.n_experts_used <= self.n_experts:
            raise ModelError(f"{self.n_experts_used} of {self.n_experts} experts a token")
        if self.linear_layers and (
            not self.linear_k_heads or self.linear_v_heads % self.linear_k_heads
        ):
            raise ModelError(
                f"{self.linear_v_heads} linear-attention value heads do not divide into "
                f"{self.linear_k_heads} key heads"
            )

    @property
    def moe(self) -> bool:
        """Whether every layer's FFN is a mixture of experts."""
        return self.n_experts > 0

    @property
    def n_stacked(self) -> int:
        """The experts a slice's stacked matrices hold: the routed ones, then the shared
        expert's pieces."""
        return self.n_experts + self.n_shared

    @property
    def router_columns(self) -> int:
        """The columns of the master's router: the hidden state's, then its bias (gpt-oss)."""
        return self.hidden + (1 if self.router_bias else 0)

    @property
    def router_rows(self) -> int:
        """A layer's rows of the master's router: one an expert, then the shared expert's gate."""
        return self.n_experts + (1 if self.n_shared else 0)

    def own_rope(self, layer: int) -> bool:
        """Whether `layer` turns its queries and keys by the second RoPE table, not the model's:
        a local layer's own base (Gemma 3) or none at all (an unrotated layer)."""
        if layer in self.unrotated_layers:
            return True
        return self.is_local(layer) and self.local_rope_theta is not None

    def is_linear(self, layer: int | None) -> bool:
        """Whether `layer` is a gated DeltaNet (linear attention) layer, not attention."""
        return layer in self.linear_layers

    @property
    def linear_group(self) -> int:
        """Linear-attention value heads that read one key head."""
        return self.linear_v_heads // max(self.linear_k_heads, 1)

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends only to the last `sliding_window` positions."""
        return layer in self.local_layers

    @property
    def rope_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads that share one KV head."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """Build from a plain dict (e.g. a manifest); unknown keys are an error, not dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(unknown)}")
        values = dict(values)
        if isinstance(values.get("rope_scaling"), dict):
            values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """As a plain dict; a dense model's without the experts' fields, so that its split's
        identity (memory.splitter.model_identity) is what it was before they existed."""
        values = dataclasses.asdict(self)
        if not self.moe:
            for name in ("n_experts", "n_experts_used", "norm_topk_prob"):
                del values[name]
        # as before they existed
        later = _LATER_FIELDS
        for name in later:
            if not values[name]:
                del values[name]
        if values["rope_scaling"] is not None and values["rope_scaling"]["truncate"]:
            del values["rope_scaling"]["truncate"]
        if values["rope_scaling"] is not None and values["rope_scaling"]["rotated"] == 1.0:
            del values["rope_scaling"]["rotated"]
        return values


# Fields a model that does not use them leaves out of its dict, as before they existed (so that
# a split's identity, memory.splitter.model_identity, stays what it was)
_LATER_FIELDS = (
    "unrotated_layers", "n_shared",
    "attention_sinks", "o_bias", "router_bias", "expert_bias", "swiglu_alpha", "swiglu_limit",
    "linear_layers", "linear_k_heads", "linear_v_heads", "linear_k_dim", "linear_v_dim",
    "linear_conv", "attention_gate",
    "value_norm", "kv_shared", "k_eq_v", "ple_dim", "ple_vocab", "final_softcap",
    "global_head_dim", "global_kv_heads", "wide_ffn", "dense_ffn",
)  # fmt: skip
