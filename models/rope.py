"""Rotary position embeddings: the rotation frequencies a model's config asks for (Llama 3,
YaRN, LongRoPE or linear scaling), their cos/sin tables, and the rotation itself, for torch
tensors and for a decode step's NumPy rows.

Its own module because every scaling rule a model family adds lands here, apart from the
attention that uses the tables (`models.block_math`, `models.block_rows`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from edgetp.models.config import ModelConfig


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
    elif sc is not None and sc.kind == "proportional":  # the rest of the pairs do not turn
        inv[int(sc.rotated * d // 2) :] = 0
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

        low, high = pair(sc.beta_fast), pair(sc.beta_slow)
        if sc.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
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
        self,
        config: ModelConfig,
        max_positions: int,
        freq_factors: torch.Tensor | None = None,
        rotate: bool = True,
    ) -> None:
        """`rotate` False: an unrotated layer's tables, cos 1 and sin 0, which turn nothing
        (and scale nothing) in every path that rotates, the C blocks' included."""
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(config, freq_factors, max_positions))  # (P, rd/2)
        scale = rope_attention_factor(config)
        self.cos = freqs.cos() * scale if rotate else torch.ones_like(freqs)
        self.sin = freqs.sin() * scale if rotate else torch.zeros_like(freqs)

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


def rope_rows(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """`apply_rope` for (B, H, hd) with cos, sin (B, 1, rd/2)."""
    half = cos.shape[-1]
    if 2 * half < x.shape[-1]:
        return np.concatenate((rope_rows(x[..., : 2 * half], cos, sin), x[..., 2 * half :]), -1)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)
