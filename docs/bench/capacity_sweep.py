"""The plan from measured capacities against hand-set `--capacities`, on mixed emulated devices.

Runs SmolLM2 greedy on local nodes that are emulated devices (root, cgroups v1), once with the
plan the session makes from what each device measured and once per hand-set capacity vector,
alternating over rounds; prints each one's median ms/token and the plan's ratio to the best.

    .venv/bin/python docs/bench/capacity_sweep.py cpu=0.75 cpu=0.25 [rounds]
"""

from __future__ import annotations

import statistics
import sys

from edgetp.master.bench.greedy import PROMPT, time_greedy
from edgetp.master.cluster.local import local_session
from edgetp.master.emulate.devices import emulated
from edgetp.master.emulate.spec import DeviceSpec, parse_device
from edgetp.master.generation.prompts import open_with_tokenizer, prompt_tokens
from edgetp.memory.files import default_state_dir
from edgetp.models.source import ModelSource
from edgetp.models.tokenizer import Tokenizer

TOKENS = 32
HAND_SET = {
    2: [(1, 1), (2, 1), (3, 1), (4, 1), (1, 2), (1, 3)],
    3: [(1, 1, 1), (2, 1, 1), (1, 2, 2), (3, 1, 1), (1, 3, 3), (2, 1, 2), (2, 2, 1)],
}


def _run(
    specs: list[DeviceSpec],
    capacities: tuple[float, ...] | None,
    source: ModelSource,
    tokenizer: Tokenizer,
    prompt: list[int],
) -> tuple[float, list[float], list[int]]:
    state_dir = default_state_dir()
    with (
        emulated(specs, len(specs), state_dir) as devices,
        local_session(
            source, len(specs), capacities=capacities, state_dir=state_dir, devices=devices
        ) as session,
    ):
        engine = session.engine
        assert engine is not None
        planned = session.planned_capacities
        time_greedy(engine, tokenizer, prompt, 4)
        _, ms, tokens = time_greedy(engine, tokenizer, prompt, TOKENS)
        engine.close()
    return ms, planned, tokens


def main() -> None:
    args = sys.argv[1:]
    rounds = int(args.pop()) if args and args[-1].isdigit() else 3
    specs = [parse_device(a) for a in args]
    source, tokenizer = open_with_tokenizer(None)
    prompt = prompt_tokens(tokenizer, PROMPT, raw=False)
    configs: list[tuple[float, ...] | None] = [None, *HAND_SET[len(specs)]]
    times: dict[object, list[float]] = {}
    planned: list[list[float]] = []
    outputs = set()
    for _ in range(rounds):
        for capacities in configs:
            ms, used, tokens = _run(specs, capacities, source, tokenizer, prompt)
            times.setdefault(capacities, []).append(ms)
            outputs.add(tuple(tokens))
            if capacities is None:
                planned.append([round(c, 2) for c in used])
    print(f"devices: {' | '.join(s.describe() for s in specs)}; {TOKENS} tokens, "
          f"medians of {rounds} alternating rounds")  # fmt: skip
    medians = {c: statistics.median(t) for c, t in times.items()}
    best = min(v for c, v in medians.items() if c is not None)
    for capacities, ms in medians.items():
        name = (
            "measured plan"
            if capacities is None
            else "capacities " + ",".join(f"{c:g}" for c in capacities)
        )
        print(
            f"  {name:<24} {ms:8.1f} ms/token   rounds {[round(t, 1) for t in times[capacities]]}"
        )
    print(f"measured capacities per round: {planned}")
    print(f"the measured plan against the best hand-set one: {medians[None] / best:.3f}")
    print(f"greedy tokens identical across plans: {len(outputs) == 1}")


if __name__ == "__main__":
    main()
