"""The sampler's own time a token on the bundled model's logits, inside `generate.stream`.

    git show REV:master/sampling.py > /tmp/old_sampling.py
    .venv/bin/python docs/bench/sampler_cost.py [/tmp/old_sampling.py] [TOKENS] [ROUNDS]

One thread, one float32 engine; for each sampling setting, TOKENS tokens of a story, timing each
`Sampler.__call__`; the current sampler and, when given, another version of master/sampling.py,
alternating over ROUNDS rounds. Prints the median of the rounds' medians in ms a token.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from types import ModuleType
from typing import Any

import edgetp.master.generation.generate as generate
import edgetp.master.generation.sampling as current
from edgetp.master.cluster.engine import Engine
from edgetp.master.generation.params import SamplingParams
from edgetp.models.kernels import set_threads
from edgetp.models.source import open_model

SETTINGS = {
    "chat app (t 0.7, top-p 0.95)": {"temperature": 0.7, "top_p": 0.95},
    "bridge default (t 1)": {"temperature": 1.0},
    "t 1, top-k 40, top-p 0.9, penalty 1.1": {
        "temperature": 1.0,
        "top_k": 40,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
    },
}


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("other_sampling", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timed(sampler: type) -> Any:
    class Timed(sampler):  # type: ignore[misc, valid-type]
        spent: list[float] = []

        def __call__(self, logits: Any, history: Any) -> int:
            started = time.perf_counter()
            token = super().__call__(logits, history)
            Timed.spent.append(time.perf_counter() - started)
            return token

    return Timed


def main() -> None:
    other = _load(sys.argv[1]) if len(sys.argv) > 1 else None
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    set_threads(1)
    source = open_model(None)
    tokenizer = source.tokenizer()
    engine = Engine.local(source, max_context=512, slots=1)
    prompt = tokenizer.encode("Write a short story about a lighthouse keeper.")
    versions = {"current": current, **({"other": other} if other else {})}
    medians: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name, setting in SETTINGS.items():
            for label, module in versions.items():
                timed = _timed(module.Sampler)
                generate.Sampler = timed
                params = SamplingParams(seed=1, max_tokens=tokens, ignore_eos=True, **setting)
                (g,) = generate.start(engine, [prompt], [params])
                for _ in generate.stream(engine, tokenizer, [g]):
                    pass
                medians.setdefault((name, label), []).append(statistics.median(timed.spent))
    for (name, label), values in medians.items():
        rounded = [round(v * 1e3, 3) for v in values]
        print(f"{name:40s} {label:8s} {statistics.median(values) * 1e3:7.3f} ms  {rounded}")


if __name__ == "__main__":
    main()
