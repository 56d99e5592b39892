"""Two ways to plan the same emulated devices, alternating session by session: each session's
ms a token, each device's CPU a token and the busiest device's over the mean.

    .venv/bin/python docs/bench/plan_pairs.py PAIRS A B    (root, cgroups v1)

A and B each name a plan: `probes` (what the session measures, as `edgetp run` plans), `c1,c2`
(capacities set by hand, master first), `learned` (capacities from the session just before:
its capacities over each device's CPU a token, `probes` for the first), `measured:c1,c2` (the
probes and links measured as for `probes`, then capacities set to c1,c2). Two cpu=0.5 devices,
SmolLM2 f32, 32 greedy tokens, a fresh state folder each session; the order within a pair
alternates. docs/decisions.md (Emulated devices; Benchmarks and tests) has what it decided;
its history (`git log -p docs/decisions.md`) has what it showed.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import edgetp.master.cluster.session as session_module
from edgetp.master.bench.greedy import PROMPT, time_greedy
from edgetp.master.cluster.local import local_session
from edgetp.master.emulate.devices import emulated
from edgetp.master.emulate.spec import parse_device
from edgetp.master.generation.prompts import open_with_tokenizer, prompt_tokens

TOKENS = 32
SPECS = [parse_device("cpu=0.5")] * 2
_measured_shares = session_module.Session.shares
_forced: list[list[float] | None] = [None]


def _shares(self: Any) -> tuple[list[float], list[float] | None]:
    planned = _measured_shares(self)
    return (list(_forced[0]), planned[1]) if _forced[0] else planned


session_module.Session.shares = _shares  # type: ignore[method-assign]


def _session(capacities: tuple[float, ...] | None, source: Any, tokenizer: Any, prompt: list[int]):
    state = Path(tempfile.mkdtemp(prefix="plan-pairs-"))
    try:
        with (
            emulated(SPECS, len(SPECS), state) as devices,
            local_session(
                source, len(SPECS), capacities=capacities, state_dir=state, devices=devices
            ) as session,
        ):
            engine = session.engine
            assert engine is not None and devices is not None
            planned = list(session.planned_capacities)
            time_greedy(engine, tokenizer, prompt, 4)
            before: list[float] = []

            def mark() -> None:  # as the timed decode steps start
                before.extend(devices.cpu_seconds())

            _, ms, tokens = time_greedy(engine, tokenizer, prompt, TOKENS, None, mark)
            after = devices.cpu_seconds()
            engine.close()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    cpu = [(b - a) * 1000 / (len(tokens) - 1) for a, b in zip(before, after, strict=True)]
    return ms, planned, cpu, tokens


def main() -> None:
    pairs, names = int(sys.argv[1]), sys.argv[2:4]
    source, tokenizer = open_with_tokenizer(None)
    prompt = prompt_tokens(tokenizer, PROMPT, raw=False)
    last: tuple[list[float], list[float]] | None = None
    outputs = set()
    for k in range(pairs):
        for name in names if k % 2 == 0 else names[::-1]:
            capacities: tuple[float, ...] | None = None
            _forced[0] = None
            if name == "learned" and last is not None:
                total = sum(last[0])
                capacities = tuple(c / total / u for c, u in zip(*last, strict=True))
            elif name.startswith("measured:"):
                _forced[0] = [float(c) for c in name.split(":", 1)[1].split(",")]
            elif name not in ("probes", "learned"):
                capacities = tuple(float(c) for c in name.split(","))
            ms, planned, cpu, tokens = _session(capacities, source, tokenizer, prompt)
            last = (planned, cpu)
            outputs.add(tuple(tokens))
            print(
                f"{k} {name:<16} {ms:7.2f} ms a token, capacities "
                f"{[round(c, 3) for c in planned]}, CPU a token {[round(c, 2) for c in cpu]} ms, "
                f"busiest over mean {max(cpu) / statistics.mean(cpu):.3f}",
                flush=True,
            )
    print(f"greedy tokens identical across sessions: {len(outputs) == 1}")


if __name__ == "__main__":
    main()
