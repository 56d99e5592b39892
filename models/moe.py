"""A mixture of experts' FFN block (Qwen3-MoE, Mixtral, Qwen2-MoE, gpt-oss): the master's
router and a slice's partial.

The router lives on the master: after the attention sum it has each token's hidden state, and
`route` picks each token's `n_experts_used` experts and their weights, as transformers'
Qwen3MoeTopKRouter does (softmax over the router's logits, top-k, renormalised when
`norm_topk_prob`). A shared expert (Qwen2-MoE), cut as `n_shared` more experts, is added to
every token's with the weight sigmoid(x @ its gate), as Qwen2MoeSparseMoeBlock weights it. The
routing goes to every node with the FFN step.

Every slice holds the same columns of every expert (`models.layers.slice_parts`), so

    partial = sum over the token's experts e of weight_e * down_e[:, cols](act(x @ gate_e[cols])
              * (x @ up_e[cols]))

and the sum of the slices' partials is the weighted sum of the experts' outputs: still one sum
for the block, whatever the routing. A step's tokens are grouped by expert: each expert the step
chose multiplies all of its tokens at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from edgetp.models.block_math import rms_norm
from edgetp.models.block_rows import rms_norm_rows
from edgetp.models.config import ModelConfig
from edgetp.models.kernels import SCALE_SUFFIX, linear_rows
from edgetp.models.quant import matrix_size


@dataclass(frozen=True)
class Routing:
    """Each token's experts and their weights, one row a token: a decode step's (B, k), any
    other step's (B T, k), its tokens in (B, T) order; k counts a shared expert's pieces."""

    experts: np.ndarray  # (N, k) int64, each below n_stacked
    weights: np.ndarray  # (N, k) float32

    @property
    def tokens(self) -> int:
        return self.experts.shape[0]


def route(h: np.ndarray, norm: torch.Tensor, router: torch.Tensor, config: ModelConfig) -> Routing:
    """The routing of the hidden states h (B, D) or (B, T, D) after a layer's attention sum:
    the FFN's norm `norm` (D,), then `router` (router_rows, router_columns): the experts'
    router, then a shared expert's gate; a router's bias (gpt-oss) is its last column."""
    d = config.hidden
    rows = torch.from_numpy(np.ascontiguousarray(h).reshape(-1, d))
    x = rms_norm(rows, norm, config.norm_eps)  # (N, D), as the experts' input
    bias = router[:, d] if config.router_bias else None
    logits = F.linear(x, router[:, :d], bias)  # (N, router_rows)
    e = config.n_experts
    probs = torch.softmax(logits[:, :e], dim=-1, dtype=torch.float)
    top, experts = torch.topk(probs, config.n_experts_used, dim=-1)  # (N, k)
    if config.norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    if config.n_shared:  # every piece of the shared expert, at its gate's weight
        n, pieces = rows.shape[0], config.n_shared
        shared = torch.arange(e, e + pieces).expand(n, pieces)
        experts = torch.cat((experts, shared), dim=1)  # (N, k + n_shared)
        top = torch.cat((top, torch.sigmoid(logits[:, e:]).float().expand(n, pieces)), dim=1)
    return Routing(experts.numpy().astype(np.int64), top.numpy().astype(np.float32))


# A slice's tensors stacked by expert, their rows n_stacked-fold (an int8 matrix's scales
# alike, gpt-oss' biases too): what a node that streams reads an expert at a time
# (memory/experts.py).
EXPERT_TENSORS = (
    "w_gate_up",
    "w_down",
    "w_gate_up" + SCALE_SUFFIX,
    "w_down" + SCALE_SUFFIX,
    "b_gate_up",
    "b_down",
)


def expert_rows(config: ModelConfig, n: int, expert: int) -> tuple[slice, slice]:
    """Expert `expert`'s rows of a slice's w_gate_up (its gate then its up, `n` columns each)
    and of its w_down (`models.layers.slice_parts`)."""
    d = config.hidden
    return slice(2 * n * expert, 2 * n * (expert + 1)), slice(d * expert, d * (expert + 1))


def expert_specs(
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], experts: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A slice's matrices' (dtype, shape) as they are multiplied: with `experts` (a mixture's
    n_experts), the stacked w_gate_up and w_down one expert's rows at a time, which is the
    product a device needs a kernel for."""
    if not experts:
        return specs
    out = dict(specs)
    for name in ("w_gate_up", "w_down"):
        if name in specs:
            dtype, shape = specs[name]
            out[name] = (dtype, (shape[0] // experts, *shape[1:]))
    return out


def _product(x: np.ndarray, w: dict[str, torch.Tensor], name: str, rows: slice) -> np.ndarray:
    """x (R, in) times rows `rows` of a slice's matrix `name` (with its int8 scales, if any)."""
    scale = w.get(name + SCALE_SUFFIX)
    return linear_rows(x, w[name][rows], scale=None if scale is None else scale[rows])


def _experts(x: np.ndarray, w: dict[str, torch.Tensor], n: int, config: ModelConfig,
             routing: Routing) -> np.ndarray:  # fmt: skip
    """The weighted sum of this slice's partials of each token's experts for the normed rows
    x (N, D): (N, D)."""
    out = np.zeros_like(x)
    for e in np.unique(routing.experts):
        tokens, which = np.nonzero(routing.experts == e)  # a token chooses an expert once
        gate_up_rows, down_rows = expert_rows(config, n, int(e))
        gate_up = _product(np.ascontiguousarray(x[tokens]), w, "w_gate_up", gate_up_rows)
        if "b_gate_up" in w:
            gate_up += w["b_gate_up"][gate_up_rows].numpy()
        gate, up = gate_up[:, :n], gate_up[:, n:]  # column-parallel
        y = _product(_swiglu(gate, up, config), w, "w_down", down_rows)
        if "b_down" in w:  # this slice's share of it (`models.layers.slice_parts`)
            y += w["b_down"][down_rows].numpy()
        out[tokens] += y * routing.weights[tokens, which][:, None]  # row-parallel
    return out


def _swiglu(gate: np.ndarray, up: np.ndarray, config: ModelConfig) -> np.ndarray:
    """silu(gate) up, as `ffn_rows`, or gelu's where the model's experts are GeGLU (Gemma 4);
    gpt-oss' clamped one where the config has a limit: (up + 1) gate sigmoid(alpha gate), gate
    at most the limit, up within +-limit, as transformers' GptOssExperts computes it."""
    if config.activation == "gelu_tanh":  # Gemma 4's experts: GeGLU
        inner = np.float32(math.sqrt(2 / math.pi)) * (gate + np.float32(0.044715) * gate**3)
        return np.float32(0.5) * gate * (1 + np.tanh(inner)) * up
    if config.swiglu_limit is None:
        return gate * (0.5 + 0.5 * np.tanh(0.5 * gate)) * up  # sigmoid without overflow
    limit, alpha = np.float32(config.swiglu_limit), np.float32(config.swiglu_alpha or 1.0)
    gate = np.minimum(gate, limit)
    up = np.clip(up, -limit, limit)
    return (up + 1) * gate * (0.5 + 0.5 * np.tanh(0.5 * alpha * gate))


def moe_rows(
    h: np.ndarray, w: dict[str, torch.Tensor], config: ModelConfig, routing: Routing
) -> np.ndarray:
    """This slice's partial of the experts' FFN block for a decode step's rows h (B, D)."""
    n = matrix_size(w["w_down"])[1]
    if n == 0:
        return np.zeros_like(h)
    x = rms_norm_rows(h, w["ffn_norm"], config.norm_eps)
    return _experts(x, w, n, config, routing)


def moe_partial(
    h: torch.Tensor, w: dict[str, torch.Tensor], config: ModelConfig, routing: Routing
) -> torch.Tensor:
    """This slice's partial of the experts' FFN block for h (B, T, D)."""
    n = matrix_size(w["w_down"])[1]
    if n == 0:
        return h.new_zeros(h.shape)
    x = rms_norm(h, w["ffn_norm"], config.norm_eps).reshape(-1, h.shape[-1])  # (B T, D)
    out = _experts(x.float().numpy(), w, n, config, routing)
    return torch.from_numpy(out).view(h.shape)
