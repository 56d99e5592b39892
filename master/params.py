"""How one sequence is sampled, and the ranges every front accepts for it.

No torch here: the REST bridge's schema and the chat app check their input against these same
limits without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass

TEMPERATURE_MAX = 2.0  # OpenAI's API takes 0..2; above it, text is noise anyway
GREEDY_BELOW = 1e-4  # a lower temperature is the argmax anyway, and dividing by it may overflow
REPETITION_PENALTY_MIN = 0.01
REPETITION_PENALTY_MAX = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean no cut; seed None means random."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # decode exactly max_tokens (benchmarks)

    def __post_init__(self) -> None:
        problems = []
        if not 0.0 <= self.temperature <= TEMPERATURE_MAX:
            problems.append(
                f"temperature must be in [0, {TEMPERATURE_MAX:g}], got {self.temperature}"
            )
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if not REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX:
            problems.append(
                f"repetition_penalty must be in [{REPETITION_PENALTY_MIN:g}, "
                f"{REPETITION_PENALTY_MAX:g}], got {self.repetition_penalty}"
            )
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise ValueError("; ".join(problems))
