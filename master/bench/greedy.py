"""One timed greedy run of an engine: what every benchmark of `edgetp bench` repeats."""

from __future__ import annotations

import time
from collections.abc import Callable

from edgetp.master.cluster.engine import Engine
from edgetp.master.generation.generate import start, step
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.speculate import Speculator
from edgetp.models.tokenizer import Tokenizer

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def time_greedy(
    engine: Engine,
    tokenizer: Tokenizer,
    prompt: list[int],
    n_tokens: int,
    speculator: Speculator | None = None,
    on_first_token: Callable[[], object] | None = None,
) -> tuple[float, float, list[int]]:
    """(time to first token s, ms per decoded token, tokens) for one greedy run, drafting
    tokens with `speculator` if given; `on_first_token` is called between the prompt and the
    decode steps, outside both timings."""
    # No end-of-sequence: every round decodes exactly n_tokens, so the rounds compare.
    params = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    (g,) = start(engine, [prompt], [params])
    t0 = time.perf_counter()
    step(engine, tokenizer, [g], speculator)
    t1 = time.perf_counter()
    if on_first_token is not None:
        on_first_token()
    decode_started = time.perf_counter()
    while not g.finished:
        step(engine, tokenizer, [g], speculator)
    t2 = time.perf_counter()
    return t1 - t0, (t2 - decode_started) * 1000 / (len(g.tokens) - 1), g.tokens
