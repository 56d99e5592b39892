"""What one device's slice of each SmolLM2 layer costs to compute in a decode step, warm, in one
process: the executor's attention and FFN blocks for the plan of the given capacities, per layer.
Run it pinned to one core so that it uses one BLAS thread:

    taskset -c 1 .venv/bin/python docs/bench/slice_cost.py 0.375,0.625
"""

from __future__ import annotations

import sys
import time

import numpy as np

from edgetp.master.cluster.engine import Engine
from edgetp.models.layers import StepBatch
from edgetp.models.source import open_model

PROMPT = 40  # tokens in the KV cache before the timed decode blocks
LAYERS_TIMED = 300


def main() -> None:
    capacities = tuple(float(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "1").split(","))
    engine = Engine.local(open_model(None), capacities=capacities, max_context=512)
    config = engine.config
    engine.forward([list(range(100, 100 + PROMPT))], StepBatch((0,), (0,), (PROMPT,)))
    h = np.random.default_rng(0).standard_normal((1, config.hidden), dtype=np.float32)
    for k, executor in enumerate(engine.executors):
        executor.begin_step(StepBatch((0,), (PROMPT,), (1,)))
        attention = ffn = 0.0
        for r in range(LAYERS_TIMED):
            i = r % config.n_layers
            t0 = time.perf_counter()
            executor.attention(i, h)
            t1 = time.perf_counter()
            executor.ffn(i, h)
            attention += t1 - t0
            ffn += time.perf_counter() - t1
        a, f = attention / LAYERS_TIMED * 1e6, ffn / LAYERS_TIMED * 1e6
        print(f"slice {k} {executor.slice}: attention {a:.0f} + FFN {f:.0f} = {a + f:.0f} us")


if __name__ == "__main__":
    main()
