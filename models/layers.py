"""What a decoder layer is made of, and how a plan cuts it into slices.

A decoder layer is two residual blocks, attention and FFN. Each is computed as a sum over slices:
a slice holds some query heads (with the KV heads they read) and some FFN intermediate columns,
and returns its *partial* output. Summing the partials of every slice of a plan gives the unsplit
block; one device is the plan with a single slice. This module is the one place that knows how a
full weight is cut into a slice (`slice_layer`); everything else passes slices around.

    attention: x = rmsnorm(h); qkv = x @ Wqkv[slice rows]   (column-parallel)
               partial = attn(q, k, v) @ Wo[:, slice cols]   (row-parallel)
    ffn:       x = rmsnorm(h); g, u = x @ Wgate/Wup[slice rows] (column-parallel)
               partial = (silu(g) * u) @ Wdown[:, slice cols]   (row-parallel)

The caller sums the partials into the residual stream (h += sum) between the two blocks.

Here are the layer's tensor names, a `Slice` and how it cuts and stores them, and the
`StepBatch` of sequences a step feeds a layer: the plain data both sides of the wire share.
The blocks' math is elsewhere: `models.block_math` (torch, any step), `models.block_rows`
(NumPy rows, a decode step) and `models.rope`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgetp.models.config import ModelConfig
from edgetp.models.dtypes import EXACT_WIDENING, common_dtype
from edgetp.models.kernels import dequantize, dtype_name, quantize
from edgetp.models.quant import columns_fit, take_columns, widen

# Canonical per-layer tensor names, full (unsplit) and in PyTorch (out, in) order.
LAYER_TENSORS = ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down")
BIAS_TENSORS = ("q_bias", "k_bias", "v_bias")
QK_NORM_TENSORS = ("q_norm", "k_norm")  # one (head_dim,) weight each, shared by every head
# Norms of a block's summed output (Gemma 3): the master applies them after the allreduce, so
# the master holds them all, as one global (2 n_layers, hidden) tensor named POST_NORMS.
POST_NORM_TENSORS = ("post_attn_norm", "post_ffn_norm")
POST_NORMS = "post_norms"
# A mixture of experts (`ModelConfig.moe`): expert e's gate, up and down are "gate.e", "up.e",
# "down.e", each shaped as the dense FFN's of `ffn_hidden` columns; the router, (n_experts,
# hidden) a layer, is the master's: one global (n_layers n_experts, hidden) tensor, ROUTER.
EXPERT_TENSORS = ("gate", "up", "down")
ROUTER = "router"
# A shared expert (Qwen2-MoE, `ModelConfig.n_shared`): one SwiGLU every token uses, n_shared
# experts' widths wide, cut by the plan as that many more experts (`slice_parts`). Its gate,
# (1, hidden) a layer, is the master's: row n_experts of the layer's rows of ROUTER.
SHARED_TENSORS = ("shared_gate", "shared_up", "shared_down")
SHARED_ROUTER = "shared_router"
# gpt-oss (`ModelConfig.attention_sinks`, `o_bias`, `expert_bias`, `router_bias`): a learned
# logit a query head, the output projection's bias, each expert's gate, up and down biases
# ("gate_bias.e", ...), and the router's bias, which the master holds as ROUTER's last column.
SINKS, O_BIAS, ROUTER_BIAS = "sinks", "o_bias", "router_bias"
EXPERT_BIAS_TENSORS = ("gate_bias", "up_bias", "down_bias")
# A gated DeltaNet layer (`ModelConfig.linear_layers`, models/deltanet.py) in place of attention:
# its in-projections of the convolution's channels (queries and keys of every key head, then
# values of every value head), of the norm's gate z (a value head's width each) and of beta's
# and the decay's inputs b and a (one a value head); the convolution's taps (channels, taps);
# each value head's decay rate (-exp(A_log), as llama.cpp stores it) and dt bias; the gated
# norm (value head's width, its weight as it is); the out-projection (hidden, value heads).
LINEAR_TENSORS = ("ssm_qkv", "ssm_z", "ssm_b", "ssm_a", "ssm_conv", "ssm_decay", "ssm_dt",
                  "ssm_norm", "ssm_out")  # fmt: skip
ATTENTION_ONLY = ("q", "k", "v", "o")  # what a DeltaNet layer holds none of


def expert_of(name: str) -> tuple[str, int] | None:
    """("gate", 3) for canonical "gate.3": an expert's tensor; None for any other."""
    base, _, expert = name.partition(".")
    kinds = EXPERT_TENSORS + EXPERT_BIAS_TENSORS
    return (base, int(expert)) if base in kinds and expert.isdigit() else None


def expert_name(name: str, expert: int) -> str:
    """The canonical name of expert `expert`'s `name` ("gate", "up" or "down")."""
    return f"{name}.{expert}"


def layer_tensor_names(config: ModelConfig, layer: int | None = None) -> tuple[str, ...]:
    """A layer's canonical tensors that its slices are cut from (not the master's post norms
    and router); `layer` None: an attention layer's."""
    names: tuple[str, ...] = LAYER_TENSORS
    if config.is_linear(layer):
        names = tuple(n for n in names if n not in ATTENTION_ONLY) + LINEAR_TENSORS
    if config.moe:
        kinds = EXPERT_TENSORS + (EXPERT_BIAS_TENSORS if config.expert_bias else ())
        experts = [expert_name(n, e) for e in range(config.n_experts) for n in kinds]
        names = (*(n for n in names if n not in EXPERT_TENSORS), *experts)
    return (
        names
        + ((SINKS,) if config.attention_sinks else ())
        + ((O_BIAS,) if config.o_bias else ())
        + (SHARED_TENSORS if config.n_shared else ())
        + (BIAS_TENSORS if config.qkv_bias and not config.is_linear(layer) else ())
        + (QK_NORM_TENSORS if config.qk_norm and not config.is_linear(layer) else ())
    )


@dataclass(frozen=True)
class Slice:
    """One device's share of every layer: half-open ranges of heads and FFN columns.

    Query heads are contiguous; `kv_heads` are the KV heads those query heads read, so when a
    plan has more slices than KV heads, neighbouring slices hold a copy of the same KV head.
    """

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]
    # A gated DeltaNet's value heads, contiguous, and the key heads they read (replicated
    # where the plan has more slices than key heads), as attention's query and KV heads.
    linear_heads: tuple[int, int] = (0, 0)
    linear_key_heads: tuple[int, int] = (0, 0)

    @property
    def n_q(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def n_kv(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def n_ffn(self) -> int:
        return self.ffn[1] - self.ffn[0]

    @property
    def n_linear(self) -> int:
        return self.linear_heads[1] - self.linear_heads[0]

    @property
    def attends(self) -> bool:
        """Whether it holds heads of attention or of a gated DeltaNet (a plan may give every
        head to the master, master.cluster.plan.plan_slices' `attention_first`)."""
        return self.n_q > 0 or self.n_linear > 0

    @property
    def n_linear_keys(self) -> int:
        return self.linear_key_heads[1] - self.linear_key_heads[0]

    def to_dict(self) -> dict[str, list[int]]:
        d = {
            "q_heads": list(self.q_heads),
            "kv_heads": list(self.kv_heads),
            "ffn": list(self.ffn),
        }
        if self.linear_heads != (0, 0) or self.linear_key_heads != (0, 0):  # a DeltaNet's
            d |= {"linear_heads": list(self.linear_heads),
                  "linear_key_heads": list(self.linear_key_heads)}  # fmt: skip
        return d

    @classmethod
    def from_dict(cls, d: dict[str, list[int]]) -> Slice:
        linear = tuple(d.get("linear_heads", (0, 0))), tuple(d.get("linear_key_heads", (0, 0)))
        return cls(tuple(d["q_heads"]), tuple(d["kv_heads"]), tuple(d["ffn"]), *linear)  # type: ignore[arg-type]

    @classmethod
    def whole(cls, config: ModelConfig) -> Slice:
        return cls(
            (0, config.n_heads),
            (0, config.n_kv_heads),
            (0, config.ffn_hidden),
            (0, config.linear_v_heads),
            (0, config.linear_k_heads),
        )


def attention_on_first(slices: Sequence[Slice]) -> bool:
    """Whether the first slice (the master's) holds all of attention, no other any of it (a
    plan's `attention_first`): its blocks are then the master's alone, with no sum."""
    return not any(s.attends for s in slices[1:])


def kv_heads_for(q_heads: tuple[int, int], group_size: int) -> tuple[int, int]:
    """The KV heads a contiguous run of query heads reads."""
    if q_heads[0] == q_heads[1]:
        return (0, 0)
    return (q_heads[0] // group_size, (q_heads[1] - 1) // group_size + 1)


def full_layer_shapes(config: ModelConfig, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    """The shape of each canonical full tensor of one layer, (out, in) for matrices; `layer`
    None: an attention layer's."""
    d, hd, f = config.hidden, config.head_dim, config.ffn_hidden
    q, kv = config.n_heads * hd, config.n_kv_heads * hd
    shapes = {
        "attn_norm": (d,), "q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q),
        "ffn_norm": (d,), "gate": (f, d), "up": (f, d), "down": (d, f),
    }  # fmt: skip
    if config.attention_gate:  # each head's query, then its gate
        shapes["q"] = (2 * q, d)
    if config.is_linear(layer):
        shapes = {n: v for n, v in shapes.items() if n not in ATTENTION_ONLY}
        shapes |= linear_shapes(config)
    elif config.qkv_bias:
        shapes |= {"q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,)}
    if config.qk_norm and not config.is_linear(layer):
        shapes |= {"q_norm": (hd,), "k_norm": (hd,)}
    if config.post_norms:
        shapes |= {name: (config.hidden,) for name in POST_NORM_TENSORS}
    if config.attention_sinks:
        shapes[SINKS] = (config.n_heads,)
    if config.o_bias:
        shapes[O_BIAS] = (d,)
    if config.moe:
        biases = {"gate_bias": (f,), "up_bias": (f,), "down_bias": (d,)}
        for e in range(config.n_experts):
            shapes |= {expert_name(n, e): shapes[n] for n in EXPERT_TENSORS}
            if config.expert_bias:
                shapes |= {expert_name(n, e): shape for n, shape in biases.items()}
        shapes = {n: v for n, v in shapes.items() if n not in EXPERT_TENSORS}
        shapes[ROUTER] = (config.n_experts, d)
    if config.router_bias:
        shapes[ROUTER_BIAS] = (config.n_experts,)
    if config.n_shared:
        width = config.n_shared * f
        shapes |= {"shared_gate": (width, d), "shared_up": (width, d), "shared_down": (d, width)}
        shapes[SHARED_ROUTER] = (1, d)
    return shapes


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of a gated DeltaNet layer's own tensors (`LINEAR_TENSORS`)."""
    d, nv = config.hidden, config.linear_v_heads
    keys, values = config.linear_k_heads * config.linear_k_dim, nv * config.linear_v_dim
    channels = 2 * keys + values
    return {
        "ssm_qkv": (channels, d), "ssm_z": (values, d), "ssm_b": (nv, d), "ssm_a": (nv, d),
        "ssm_conv": (channels, config.linear_conv), "ssm_decay": (nv,), "ssm_dt": (nv,),
        "ssm_norm": (config.linear_v_dim,), "ssm_out": (d, values),
    }  # fmt: skip


def linear_parts(config: ModelConfig, s: Slice) -> dict[str, tuple[Part, ...]]:
    """What a slice holds of a gated DeltaNet layer's own tensors: the in-projections' rows
    of its value heads and the key heads they read (column-parallel, as one matrix `wqkv`:
    queries, keys, values, z, b, a), the convolution's taps of the same channels (`conv`),
    its value heads' `decay` and `dt`, the gated norm, and the out-projection's columns of its
    value heads (row-parallel: `wo`, summed over slices as attention's O)."""
    dk, dv, d = config.linear_k_dim, config.linear_v_dim, config.hidden
    keys = config.linear_k_heads * dk
    (k0, k1), (v0, v1) = s.linear_key_heads, s.linear_heads
    channels = (
        (k0 * dk, k1 * dk),
        (keys + k0 * dk, keys + k1 * dk),
        (2 * keys + v0 * dv, 2 * keys + v1 * dv),
    )
    return {
        "wqkv": (
            *(Part("ssm_qkv", c) for c in channels),
            Part("ssm_z", (v0 * dv, v1 * dv)),
            Part("ssm_b", (v0, v1)),
            Part("ssm_a", (v0, v1)),
        ),
        "wo": (Part("ssm_out", (0, d), (v0 * dv, v1 * dv)),),
        "conv": tuple(Part("ssm_conv", c) for c in channels),
        "decay": (Part("ssm_decay", (v0, v1)),),
        "dt": (Part("ssm_dt", (v0, v1)),),
        "ssm_norm": (Part("ssm_norm", (0, dv)),),
    }


@dataclass(frozen=True)
class Part:
    """Rows [rows) and columns [cols) of a full source tensor: one piece of a slice's matrix.
    A slice's matrix is its parts stacked by rows, in order; `cols` None is every column.
    `share`: the piece's values times it, a row-parallel bias's share of a slice (`slice_parts`)."""

    source: str
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None
    share: float = 1.0

    @property
    def n_rows(self) -> int:
        return self.rows[1] - self.rows[0]


def slice_parts(
    config: ModelConfig, s: Slice, layer: int | None = None
) -> dict[str, tuple[Part, ...]]:
    """What a slice holds of one layer, by fused name: attn_norm, wqkv (+ bqkv), wo, ffn_norm,
    w_gate_up, w_down. The one rule for cutting a layer: `slice_layer` cuts whole tensors by it,
    the splitter bands of rows. `layer` None: an attention layer's; a gated DeltaNet layer's
    wqkv and wo are its own (`linear_parts`).

    A mixture of experts is cut at the same columns in every expert, stacked by rows: w_gate_up
    (E 2n, D) is expert e's gate then up at rows [2 e n, 2 (e + 1) n), w_down (E D, n) expert
    e's down at rows [e D, (e + 1) D) (`models.moe.expert_rows`). Rows, so every dtype's blocks
    (along the input) stay whole, and the matrices keep their dense names. A shared expert
    follows as n_shared more: its piece j is its columns j F + [a, b) for the slice's [a, b).

    A row-parallel bias (gpt-oss' O and experts' down) is added by every slice, each its share
    of it (its heads' or columns' fraction): any plan's partials sum to the bias, with no slice
    singled out. Column-parallel biases (Q, K, V, experts' gate and up) are cut like their
    matrices: b_gate_up (E 2n,) as w_gate_up's rows, b_down (E D,) as w_down's."""
    hd, d = config.head_dim, config.hidden
    q, k = (s.q_heads[0] * hd, s.q_heads[1] * hd), (s.kv_heads[0] * hd, s.kv_heads[1] * hd)
    # an output gate: each head's query then its gate, so a slice's heads are rows 2 q
    q_rows = (2 * q[0], 2 * q[1]) if config.attention_gate else q
    f = s.ffn
    parts = {
        "attn_norm": (Part("attn_norm", (0, d)),),
        "wqkv": (Part("q", q_rows), Part("k", k), Part("v", k)),
        "wo": (Part("o", (0, d), q),),
        "ffn_norm": (Part("ffn_norm", (0, d)),),
        "w_gate_up": (Part("gate", f), Part("up", f)),
        "w_down": (Part("down", (0, d), f),),
    }
    linear = config.is_linear(layer)
    if linear:
        parts |= linear_parts(config, s)
    if config.moe:
        experts = range(config.n_experts)
        parts["w_gate_up"] = tuple(
            Part(expert_name(n, e), f) for e in experts for n in ("gate", "up")
        )
        parts["w_down"] = tuple(Part(expert_name("down", e), (0, d), f) for e in experts)
        w = config.ffn_hidden
        pieces = [(j * w + f[0], j * w + f[1]) for j in range(config.n_shared)]
        parts["w_gate_up"] += tuple(Part(n, p) for p in pieces for n in SHARED_TENSORS[:2])
        parts["w_down"] += tuple(Part("shared_down", (0, d), p) for p in pieces)
        if config.expert_bias:
            share = s.n_ffn / config.ffn_hidden
            parts["b_gate_up"] = tuple(
                Part(expert_name(n, e), f) for e in experts for n in ("gate_bias", "up_bias")
            )
            parts["b_down"] = tuple(Part(expert_name("down_bias", e), (0, d), None, share)
                                    for e in experts)  # fmt: skip
    if config.attention_sinks:
        parts["sinks"] = (Part(SINKS, s.q_heads),)
    if config.o_bias:
        parts["bo"] = (Part(O_BIAS, (0, d), None, s.n_q / config.n_heads),)
    if config.qkv_bias and not linear:
        parts["bqkv"] = (Part("q_bias", q), Part("k_bias", k), Part("v_bias", k))
    if config.qk_norm and not linear:
        parts |= {"q_norm": (Part("q_norm", (0, hd)),), "k_norm": (Part("k_norm", (0, hd)),)}
    return parts


def cut(t: torch.Tensor, part: Part, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """`part` of the full tensor `t` (plain or in blocks), limited to source rows `rows`; `t`
    may be a band of the full tensor starting at row `rows[0]`."""
    first = 0 if rows is None else rows[0]
    a, b = part.rows if rows is None else (max(part.rows[0], rows[0]), min(part.rows[1], rows[1]))
    piece = t[a - first : b - first]
    if part.cols is not None:
        piece = take_columns(piece, *part.cols)
    if part.share == 1.0 or piece.is_meta:  # a share scales values; a shape-only piece has none
        return piece
    return piece * part.share


def slice_layer(
    config: ModelConfig, full: dict[str, torch.Tensor], s: Slice, layer: int | None = None
) -> dict[str, torch.Tensor]:
    """Cut one layer's full tensors to a slice, fused for compute (`slice_parts`); all
    contiguous copies, so the full tensors can be freed. A fused matrix whose parts are stored
    differently is fused in the one format that holds them all exactly (q4_0 and q5_0 widen to
    q8_0), else in float32."""
    out = {}
    for name, parts in slice_parts(config, s, layer).items():
        pieces = [cut(full[p.source], p) for p in parts]
        names = {dtype_name(p) for p in pieces}
        if len(names) > 1:
            pieces = [cast_matrix(p, common_dtype(names))[""] for p in pieces]
        out[name] = _cat(pieces)
    return out


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces one after another, as one contiguous tensor (a copy, one piece too).
    Shape-only (meta) pieces, as a plan's shapes are cut (node.device.plan_shapes), give a meta
    tensor of the joined shape without an operation on them: the first meta operation of a
    process (torch.cat, a multiplication, a copy of a strided view) imports torch's symbolic
    shapes and sympy, 0.5-2 s of a master's start."""
    if pieces[0].is_meta:
        rows = sum(p.shape[0] for p in pieces)
        return torch.empty((rows, *pieces[0].shape[1:]), dtype=pieces[0].dtype, device="meta")
    return torch.cat(pieces).contiguous()


MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # stored in the shard dtype; the rest float32


def cast_matrix(w: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """A sliced matrix stored as shard dtype `dtype` ({"": weight} plus {"_scale": scales} for
    int8): kept as it is when it already is, widened where that is exact, else through float32."""
    stored = dtype_name(w)
    if stored == dtype and dtype != "int8":
        return {"": w}
    if (stored, dtype) in EXACT_WIDENING:
        return {"": widen(w, dtype)}
    return quantize(dequantize(w), dtype)


def slice_dtypes(parts: dict[str, tuple[Part, ...]], dtypes: dict[str, str]) -> dict[str, str]:
    """The shard dtype of each of a slice's matrices (`parts` as `slice_parts` gives them) when
    the layer's are `dtypes`: a slice whose columns cut through its format's blocks (256 for
    the K-quants: an output projection split by heads of 64) is stored as f32, its values
    exactly, the one dtype that holds any part of any block."""
    return {
        m: d if all(p.cols is None or columns_fit(d, *p.cols) for p in parts[m]) else "f32"
        for m, d in dtypes.items()
    }


def cast_layer(
    layer: dict[str, torch.Tensor], dtypes: str | dict[str, str]
) -> dict[str, torch.Tensor]:
    """A sliced layer with its matrices stored as shard dtype `dtypes` (one for all, or by
    matrix name); int8 adds per-channel scales."""
    out = {}
    for name, t in layer.items():
        if name in MATRICES:
            dtype = dtypes if isinstance(dtypes, str) else dtypes[name]
            out.update({name + k: v for k, v in cast_matrix(t, dtype).items()})
        else:
            out[name] = t
    return out


@dataclass(frozen=True)
class StepBatch:
    """The sequences in one step: KV-cache slot, position of the first new token, new tokens;
    and, for a sequence whose first positions another slot's cache holds (a prompt that begins
    as a running one's, master/generation/reuse.py), that slot (`sources`, -1 for none, empty
    for none at all): before the step, its positions [0, start) are copied into the sequence's.

    Tokens are right-padded to T = max(lengths); padded rows compute garbage that is never read.
    """

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    sources: tuple[int, ...] = ()

    def copies(self) -> list[tuple[int, int, int]]:
        """(source slot, slot, positions) of each copy the step begins with."""
        if not self.sources:
            return []
        return [
            (src, slot, start)
            for src, slot, start in zip(self.sources, self.slots, self.starts, strict=True)
            if src >= 0 and src != slot and start > 0
        ]

    def as_rows(self) -> StepBatch:
        """This step as a row a token, each sequence's in order: its slot at each of its
        positions, the shape of a decode step of as many sequences. A copy a sequence begins
        with stays on its first row."""
        slots: list[int] = []
        starts: list[int] = []
        sources: list[int] = []
        for b, (slot, start, n) in enumerate(
            zip(self.slots, self.starts, self.lengths, strict=True)
        ):
            slots += [slot] * n
            starts += range(start, start + n)
            sources += [self.sources[b] if self.sources else -1] + [-1] * (n - 1)
        return StepBatch(
            tuple(slots), tuple(starts), (1,) * len(slots), tuple(sources) if self.sources else ()
        )

    @property
    def size(self) -> int:
        return len(self.slots)

    @property
    def width(self) -> int:
        return max(self.lengths)

    @property
    def rows(self) -> bool:
        """Whether the step runs as NumPy rows (B, D): a decode step, one new token a sequence
        (`attention_rows` says why). Every other step runs as torch (B, T, D)."""
        return self.width == 1

    def positions(self) -> torch.Tensor:
        """(B, T) absolute positions of the step's tokens."""
        t = torch.arange(self.width)
        return torch.tensor(self.starts).unsqueeze(1) + t
