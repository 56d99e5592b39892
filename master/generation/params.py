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
PENALTY_LIMIT = 2.0  # presence and frequency penalties: OpenAI's API takes -2..2
# The generation loop's: the least time a step of a long prompt's chunk takes while other
# requests decode (master/generation/batcher.py, `--prefill-chunk-ms`)
CHUNK_STEP_S = 1.0
TOP_LOGPROBS_MAX = 20  # alternatives reported per token (OpenAI's chat API: up to 20)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 mean no cut; seed None means
    random. `logprobs` None reports none; k reports each token's log probability and the k
    likeliest alternatives'. `grammar` constrains every token to what it
    allows. `stream` tells a request's n choices apart: choice i > 0 draws
    from the seed's i-th child stream, so each is repeatable and none repeats another."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # decode exactly max_tokens (benchmarks)
    logprobs: int | None = None
    stream: int = 0
    # What the output must match, in llguidance's form (master/generation/grammar.py): JSON mode, a
    # JSON
    # schema, a forced tool call. None: anything.
    grammar: str | None = None

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
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                problems.append(
                    f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value}"
                )
        if self.logprobs is not None and not 0 <= self.logprobs <= TOP_LOGPROBS_MAX:
            problems.append(f"logprobs must be in [0, {TOP_LOGPROBS_MAX}], got {self.logprobs}")
        if self.stream < 0:
            problems.append(f"stream must be >= 0, got {self.stream}")
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            problems.append("stop strings must not be empty")
        if problems:
            raise ValueError("; ".join(problems))
