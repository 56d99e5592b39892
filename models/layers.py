"""Llama-family layer math, shard-aware.

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

Each block has two implementations: torch for any step, and NumPy rows for decode steps (one new
token per sequence), which are bound by fixed costs, not arithmetic; `attention_rows` says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from models.config import ModelConfig
from models.dtypes import EXACT_WIDENING, common_dtype
from models.kernels import SCALE_SUFFIX, dequantize, dtype_name, linear, linear_rows, quantize
from models.quant import columns_fit, matrix_size, take_columns, widen

# Canonical per-layer tensor names, full (unsplit) and in PyTorch (out, in) order.
LAYER_TENSORS = ("attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down")
BIAS_TENSORS = ("q_bias", "k_bias", "v_bias")
QK_NORM_TENSORS = ("q_norm", "k_norm")  # one (head_dim,) weight each, shared by every head
# Norms of a block's summed output (Gemma 3): the master applies them after the allreduce, so
# the master holds them all, as one global (2 n_layers, hidden) tensor named POST_NORMS.
POST_NORM_TENSORS = ("post_attn_norm", "post_ffn_norm")
POST_NORMS = "post_norms"


@dataclass(frozen=True)
class Slice:
    """One device's share of every layer: half-open ranges of heads and FFN columns.

    Query heads are contiguous; `kv_heads` are the KV heads those query heads read, so when a
    plan has more slices than KV heads, neighbouring slices hold a copy of the same KV head.
    """

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]

    @property
    def n_q(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def n_kv(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def n_ffn(self) -> int:
        return self.ffn[1] - self.ffn[0]

    def to_dict(self) -> dict[str, list[int]]:
        return {
            "q_heads": list(self.q_heads),
            "kv_heads": list(self.kv_heads),
            "ffn": list(self.ffn),
        }

    @classmethod
    def from_dict(cls, d: dict[str, list[int]]) -> Slice:
        return cls(tuple(d["q_heads"]), tuple(d["kv_heads"]), tuple(d["ffn"]))  # type: ignore[arg-type]

    @classmethod
    def whole(cls, config: ModelConfig) -> Slice:
        return cls((0, config.n_heads), (0, config.n_kv_heads), (0, config.ffn_hidden))


def kv_heads_for(q_heads: tuple[int, int], group_size: int) -> tuple[int, int]:
    """The KV heads a contiguous run of query heads reads."""
    if q_heads[0] == q_heads[1]:
        return (0, 0)
    return (q_heads[0] // group_size, (q_heads[1] - 1) // group_size + 1)


def full_layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each canonical full tensor of one layer, (out, in) for matrices."""
    d, hd, f = config.hidden, config.head_dim, config.ffn_hidden
    q, kv = config.n_heads * hd, config.n_kv_heads * hd
    shapes = {
        "attn_norm": (d,), "q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q),
        "ffn_norm": (d,), "gate": (f, d), "up": (f, d), "down": (d, f),
    }  # fmt: skip
    if config.qkv_bias:
        shapes |= {"q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,)}
    if config.qk_norm:
        shapes |= {"q_norm": (hd,), "k_norm": (hd,)}
    if config.post_norms:
        shapes |= {name: (config.hidden,) for name in POST_NORM_TENSORS}
    return shapes


@dataclass(frozen=True)
class Part:
    """Rows [rows) and columns [cols) of a full source tensor: one piece of a slice's matrix.
    A slice's matrix is its parts stacked by rows, in order; `cols` None is every column."""

    source: str
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None

    @property
    def n_rows(self) -> int:
        return self.rows[1] - self.rows[0]


def slice_parts(config: ModelConfig, s: Slice) -> dict[str, tuple[Part, ...]]:
    """What a slice holds of one layer, by fused name: attn_norm, wqkv (+ bqkv), wo, ffn_norm,
    w_gate_up, w_down. The one rule for cutting a layer: `slice_layer` cuts whole tensors by it,
    the splitter bands of rows."""
    hd, d = config.head_dim, config.hidden
    q, k = (s.q_heads[0] * hd, s.q_heads[1] * hd), (s.kv_heads[0] * hd, s.kv_heads[1] * hd)
    f = s.ffn
    parts = {
        "attn_norm": (Part("attn_norm", (0, d)),),
        "wqkv": (Part("q", q), Part("k", k), Part("v", k)),
        "wo": (Part("o", (0, d), q),),
        "ffn_norm": (Part("ffn_norm", (0, d)),),
        "w_gate_up": (Part("gate", f), Part("up", f)),
        "w_down": (Part("down", (0, d), f),),
    }
    if config.qkv_bias:
        parts["bqkv"] = (Part("q_bias", q), Part("k_bias", k), Part("v_bias", k))
    if config.qk_norm:
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
    return piece


def slice_layer(
    config: ModelConfig, full: dict[str, torch.Tensor], s: Slice
) -> dict[str, torch.Tensor]:
    """Cut one layer's full tensors to a slice, fused for compute (`slice_parts`); all
    contiguous copies, so the full tensors can be freed. A fused matrix whose parts are stored
    differently is fused in the one format that holds them all exactly (q4_0 and q5_0 widen to
    q8_0), else in float32."""
    out = {}
    for name, parts in slice_parts(config, s).items():
        pieces = [cut(full[p.source], p) for p in parts]
        names = {dtype_name(p) for p in pieces}
        if len(names) > 1:
            pieces = [cast_matrix(p, common_dtype(names))[""] for p in pieces]
        out[name] = _cat(pieces) if len(pieces) > 1 else pieces[0].clone()
    return out


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The pieces one after another, as one contiguous tensor. Shape-only (meta) pieces, as a
    plan's shapes are cut (node.device.plan_shapes), give a meta tensor of the joined shape
    without torch.cat: its first meta call imports torch._dynamo, 1.1-1.6 s a process."""
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


def project(
    x: torch.Tensor, w: dict[str, torch.Tensor], name: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x times the layer's matrix `name`, whatever dtype it is stored in."""
    return linear(x, w[name], bias, w.get(name + SCALE_SUFFIX))


def rope_inv_freq(
    config: ModelConfig, freq_factors: torch.Tensor | None = None, context: int = 0
) -> torch.Tensor:
    """Per-pair rotation frequencies (rope_dims/2,), with Llama 3, YaRN, LongRoPE or linear
    scaling. LongRoPE takes its long factors for a `context` past the original one (as
    llama.cpp does; transformers switches by the length of the sequence so far, which would
    change the keys already cached)."""
    d = config.rope_dims
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = config.rope_scaling
    if sc is not None and sc.kind == "linear":
        inv = inv / sc.factor
    elif sc is not None and sc.kind == "longrope":
        long = context > sc.original_context
        inv = inv / torch.tensor(sc.long_factor if long else sc.short_factor, dtype=torch.float64)
    elif sc is not None and sc.kind == "yarn":
        # Pairs that turn fewer than beta_slow times over the original context are
        # interpolated (divided by the factor), more than beta_fast kept, a linear ramp between.
        def pair(rotations: float) -> float:
            turns = sc.original_context / (rotations * 2 * math.pi)
            return d * math.log(turns) / (2 * math.log(config.rope_theta))

        low = max(math.floor(pair(sc.beta_fast)), 0)
        high = min(math.ceil(pair(sc.beta_slow)), d - 1)
        ramp = (torch.arange(d // 2, dtype=torch.float64) - low) / max(high - low, 0.001)
        keep = 1 - ramp.clamp(0, 1)
        inv = inv / sc.factor * (1 - keep) + inv * keep
    elif sc is not None and sc.kind == "llama3":
        low_wavelen = sc.original_context / sc.low_freq_factor
        high_wavelen = sc.original_context / sc.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (sc.original_context / wavelen - sc.low_freq_factor) / (
            sc.high_freq_factor - sc.low_freq_factor
        )
        mid = (1 - smooth) * inv / sc.factor + smooth * inv
        inv = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, inv)
    if freq_factors is not None:  # GGUF stores llama3 scaling as per-frequency divisors
        inv = inv / freq_factors.to(torch.float64)
    return inv.to(torch.float32)


def rope_attention_factor(config: ModelConfig) -> float:
    """The scale YaRN and LongRoPE put on cos and sin (so on every attention logit, squared);
    1 otherwise."""
    sc = config.rope_scaling
    if sc is None or sc.kind not in ("yarn", "longrope"):
        return 1.0
    if sc.attention_factor is not None:
        return float(sc.attention_factor)
    if sc.factor <= 1:
        return 1.0
    if sc.kind == "yarn":
        return 0.1 * math.log(sc.factor) + 1.0
    return math.sqrt(1 + math.log(sc.factor) / math.log(sc.original_context))


class Rope:
    """Precomputed cos/sin tables up to `max_positions`, indexed by absolute position."""

    def __init__(
        self, config: ModelConfig, max_positions: int, freq_factors: torch.Tensor | None = None
    ) -> None:
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(config, freq_factors, max_positions))  # (P, rd/2)
        scale = rope_attention_factor(config)
        self.cos = freqs.cos() * scale
        self.sin = freqs.sin() * scale

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions (B, T) shaped (B, 1, T, hd/2) to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rows(self, positions: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin for one position per sequence, as arrays (B, 1, hd/2)."""
        index = list(positions)
        return self.cos.numpy()[index][:, None], self.sin.numpy()[index][:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, hd) by half-split pairs, as HF Llama does (GGUF rows are un-permuted):
    the leading 2 x cos.shape[-1] dims of each head (all of them but for partial rotary)."""
    half = cos.shape[-1]
    if 2 * half < x.shape[-1]:
        return torch.cat((apply_rope(x[..., : 2 * half], cos, sin), x[..., 2 * half :]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


@dataclass(frozen=True)
class StepBatch:
    """The sequences in one step: KV-cache slot, position of the first new token, new tokens.

    Tokens are right-padded to T = max(lengths); padded rows compute garbage that is never read.
    """

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

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

    def to_dict(self) -> dict[str, list[int]]:
        return {
            "slots": list(self.slots),
            "starts": list(self.starts),
            "lengths": list(self.lengths),
        }

    @classmethod
    def from_dict(cls, d: dict[str, list[int]]) -> StepBatch:
        return cls(tuple(d["slots"]), tuple(d["starts"]), tuple(d["lengths"]))


def attention_partial(
    h: torch.Tensor,
    w: dict[str, torch.Tensor],
    s: Slice,
    config: ModelConfig,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    batch: StepBatch,
    window: int | None = None,
) -> torch.Tensor:
    """This slice's share of the attention block's output for h (B, T, D).

    cache_k/cache_v: this layer's cache, (slots, n_kv, max_ctx, hd); the step's keys and values
    are written into it before attending. A local layer (`window`: it attends to that many last
    positions) has a ring of min(window, max_ctx) positions instead (`_attend_window`).
    """
    B, T, _ = h.shape
    hd, nq, nkv = config.head_dim, s.n_q, s.n_kv
    if nq == 0:
        return h.new_zeros(h.shape)
    x = rms_norm(h, w["attn_norm"], config.norm_eps)
    qkv = project(x, w, "wqkv", w.get("bqkv"))  # (B, T, (nq + 2 nkv) hd)
    q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
    q, k = q.view(B, T, nq, hd), k.view(B, T, nkv, hd)
    if config.qk_norm:
        q = rms_norm(q, w["q_norm"], config.norm_eps)
        k = rms_norm(k, w["k_norm"], config.norm_eps)
    q = q.transpose(1, 2)  # (B, nq, T, hd)
    k = k.transpose(1, 2)  # (B, nkv, T, hd)
    v = v.view(B, T, nkv, hd).transpose(1, 2)
    cos, sin = cos_sin
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)

    if window is not None:
        out = _attend_window(q, k, v, cache_k, cache_v, batch, window, s, config)
    elif B == 1:
        slot, start = batch.slots[0], batch.starts[0]
        end = start + T
        cache_k[slot, :, start:end] = k[0]
        cache_v[slot, :, start:end] = v[0]
        keys, values = cache_k[slot : slot + 1, :, :end], cache_v[slot : slot + 1, :, :end]
        mask = None
        causal = T > 1 and start == 0
        if T > 1 and start > 0:  # a continued prompt: attend to the past and causally within
            mask = torch.arange(end) <= (start + torch.arange(T)).unsqueeze(1)  # (T, L)
        out = _attend(q, keys, values, mask, causal, s, config)
    else:
        ends = [st + n for st, n in zip(batch.starts, batch.lengths, strict=True)]
        for b, (slot, st, n) in enumerate(
            zip(batch.slots, batch.starts, batch.lengths, strict=True)
        ):
            cache_k[slot, :, st : st + n] = k[b, :, :n]
            cache_v[slot, :, st : st + n] = v[b, :, :n]
        L = max(ends)
        slots = torch.tensor(batch.slots)
        keys, values = cache_k[slots, :, :L], cache_v[slots, :, :L]
        qpos = batch.positions()  # (B, T)
        kpos = torch.arange(L)
        mask = (kpos <= qpos.unsqueeze(-1)).unsqueeze(1)  # (B, 1, T, L)
        out = _attend(q, keys, values, mask, False, s, config)
    out = out.transpose(1, 2).reshape(B, T, nq * hd)
    return project(out, w, "wo")  # (B, T, D), row-parallel: sum over slices


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    s: Slice,
    config: ModelConfig,
) -> torch.Tensor:
    """Attention of this slice's query heads q (B, nq, T, hd) over its KV heads' keys and
    values (B, nkv, L, hd)."""
    nq, nkv, group = s.n_q, s.n_kv, config.group_size
    scale = config.query_scale
    if nq == nkv * group and s.q_heads[0] % group == 0:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=nq != nkv, scale=scale
        )
    # query heads split within a group: map each local query head to its KV head
    kv_of_q = torch.arange(*s.q_heads) // group - s.kv_heads[0]
    return F.scaled_dot_product_attention(
        q, keys[:, kv_of_q], values[:, kv_of_q], attn_mask=mask, is_causal=causal, scale=scale
    )


def _attend_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    batch: StepBatch,
    window: int,
    s: Slice,
    config: ModelConfig,
) -> torch.Tensor:
    """A local layer's attention: each query sees the last `window` positions, itself included.

    The cache is a ring of W = min(window, max_ctx) positions, position p at p % W: a sequence's
    past comes out of it in position order, its new keys join, and the last W go back in.
    """
    W = cache_k.shape[2]
    out = torch.zeros_like(q)
    for b, (slot, st, n) in enumerate(zip(batch.slots, batch.starts, batch.lengths, strict=True)):
        past = torch.arange(max(0, st - window + 1), st)
        kpos = torch.cat((past, torch.arange(st, st + n)))
        keys = torch.cat((cache_k[slot][:, past % W], k[b, :, :n]), dim=1).unsqueeze(0)
        values = torch.cat((cache_v[slot][:, past % W], v[b, :, :n]), dim=1).unsqueeze(0)
        qpos = torch.arange(st, st + n).unsqueeze(1)
        mask = (kpos <= qpos) & (kpos > qpos - window)  # (n, L)
        out[b : b + 1, :, :n] = _attend(q[b : b + 1, :, :n], keys, values, mask, False, s, config)
        kept = torch.arange(max(st, st + n - W), st + n)
        cache_k[slot][:, kept % W] = k[b][:, kept - st]
        cache_v[slot][:, kept % W] = v[b][:, kept - st]
    return out


def _gate(gate: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if config.activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    return F.silu(gate)


def ffn_partial(h: torch.Tensor, w: dict[str, torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """This slice's share of the FFN block's output for h (B, T, D): SwiGLU, or GeGLU."""
    n = matrix_size(w["w_down"])[1]
    if n == 0:
        return h.new_zeros(h.shape)
    x = rms_norm(h, w["ffn_norm"], config.norm_eps)
    gate, up = project(x, w, "w_gate_up").split(n, dim=-1)  # column-parallel
    return project(_gate(gate, config) * up, w, "w_down")  # row-parallel: sum over slices


# -- the decode path: NumPy rows -----------------------------------------------------------------


def project_rows(
    x: np.ndarray, w: dict[str, torch.Tensor], name: str, bias: torch.Tensor | None = None
) -> np.ndarray:
    """`project` for float32 rows (B, in)."""
    return linear_rows(x, w[name], bias, w.get(name + SCALE_SUFFIX))


def rms_norm_rows(x: np.ndarray, weight: torch.Tensor, eps: float) -> np.ndarray:
    """`rms_norm` for float32 rows (B, D)."""
    # einsum: one pass, without np.mean's Python-level bookkeeping (~60 calls a token)
    mean_square = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[-1])
    return x / np.sqrt(mean_square + np.float32(eps)) * weight.numpy()


def _head_norm_rows(x: np.ndarray, weight: torch.Tensor, eps: float) -> np.ndarray:
    """`rms_norm` of each head of x (B, H, hd)."""
    B, H, hd = x.shape
    return rms_norm_rows(x.reshape(B * H, hd), weight, eps).reshape(B, H, hd)


def _rope_rows(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """`apply_rope` for (B, H, hd) with cos, sin (B, 1, rd/2)."""
    half = cos.shape[-1]
    if 2 * half < x.shape[-1]:
        return np.concatenate((_rope_rows(x[..., : 2 * half], cos, sin), x[..., 2 * half :]), -1)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)


def attention_rows(
    h: np.ndarray,
    w: dict[str, torch.Tensor],
    s: Slice,
    config: ModelConfig,
    cos_sin: tuple[np.ndarray, np.ndarray],
    cache_k: np.ndarray,
    cache_v: np.ndarray,
    batch: StepBatch,
    window: int | None = None,
) -> np.ndarray:
    """`attention_partial` for a decode step: h (B, D), one new token per sequence at
    `batch.starts`; cos_sin from `Rope.rows`; the cache as arrays (slots, n_kv, max_ctx, hd),
    or a local layer's ring (`window`).

    Why NumPy: a decode step's slice of a layer is a few MB of weights, and between messages
    every torch call runs cold. Measured on SmolLM2 (a third of a layer, one thread): attention
    in torch 412 us, here 274; a message decoded into torch 55 us, into NumPy 8.
    """
    B = h.shape[0]
    hd, nq, nkv = config.head_dim, s.n_q, s.n_kv
    if nq == 0:
        return np.zeros_like(h)
    x = rms_norm_rows(h, w["attn_norm"], config.norm_eps)
    qkv = project_rows(x, w, "wqkv", w.get("bqkv"))  # (B, (nq + 2 nkv) hd)
    qk = qkv[:, : (nq + nkv) * hd].reshape(B, nq + nkv, hd)
    if config.qk_norm:
        qk = np.concatenate(
            (
                _head_norm_rows(qk[:, :nq], w["q_norm"], config.norm_eps),
                _head_norm_rows(qk[:, nq:], w["k_norm"], config.norm_eps),
            ),
            axis=1,
        )
    roped = _rope_rows(qk, *cos_sin)
    q, k = roped[:, :nq], roped[:, nq:]
    v = qkv[:, (nq + nkv) * hd :].reshape(B, nkv, hd)
    group = config.group_size
    grouped = nq == nkv * group and s.q_heads[0] % group == 0
    kv_of_q = None if grouped else np.arange(*s.q_heads) // group - s.kv_heads[0]
    scale = np.float32(config.query_scale or 1.0 / math.sqrt(hd))
    W = cache_k.shape[2]  # a local layer's ring: position p at p % W, the last W positions
    out = np.empty((B, nq, hd), dtype=np.float32)
    for b, (slot, pos) in enumerate(zip(batch.slots, batch.starts, strict=True)):
        at = pos % W if window is not None else pos
        cache_k[slot, :, at] = k[b]
        cache_v[slot, :, at] = v[b]
        seen = min(pos + 1, W)
        keys, values = cache_k[slot, :, :seen], cache_v[slot, :, :seen]  # (nkv, L, hd)
        if grouped:  # each KV head serves `group` query heads
            queries = q[b].reshape(nkv, group, hd)
        else:  # query heads split within a group: each reads its own KV head
            keys, values = keys[kv_of_q], values[kv_of_q]
            queries = q[b][:, None, :]
        scores = queries @ keys.transpose(0, 2, 1) * scale  # (heads, queries per head, L)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out[b] = (scores @ values).reshape(nq, hd)
    return project_rows(out.reshape(B, nq * hd), w, "wo")  # (B, D), row-parallel


def ffn_rows(h: np.ndarray, w: dict[str, torch.Tensor], config: ModelConfig) -> np.ndarray:
    """`ffn_partial` for a decode step's rows h (B, D)."""
    n = matrix_size(w["w_down"])[1]
    if n == 0:
        return np.zeros_like(h)
    x = rms_norm_rows(h, w["ffn_norm"], config.norm_eps)
    gate_up = project_rows(x, w, "w_gate_up")
    gate, up = gate_up[:, :n], gate_up[:, n:]
    if config.activation == "gelu_tanh":
        inner = np.float32(math.sqrt(2 / math.pi)) * (gate + np.float32(0.044715) * gate**3)
        act = np.float32(0.5) * gate * (1 + np.tanh(inner)) * up
    else:
        # silu(g) = g * sigmoid(g), with sigmoid as 0.5 (1 + tanh(g / 2)): no overflow for any g
        act = gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * up
    return project_rows(act, w, "w_down")
