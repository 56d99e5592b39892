"""`edgetp bench` with `perf record -a` running over exactly each run's timed decode steps.

    TAG=c .venv/bin/python docs/bench/perf_decode.py bench --local-nodes 1,2 --device cpu=0.5 \
        --dtype f32 --tokens 200 --rounds 1
    perf report -i /tmp/perf-c-1.data --no-children --sort pid,comm,dso --stdio -n

Writes /tmp/perf-$TAG-<k>.data for the k-th timed run (warm-ups are not recorded); samples at
999 Hz, so a row's samples / 999 / decoded tokens is its CPU seconds a token. Needs perf and root.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import edgetp.master.bench.cluster as cluster

_time_greedy = cluster.time_greedy
_runs = [0]


def _recorded(
    engine: Any,
    tokenizer: Any,
    prompt: list[int],
    n_tokens: int,
    speculator: Any = None,
    on_first_token: Callable[[], object] | None = None,
) -> tuple[float, float, list[int]]:
    if n_tokens <= 4:  # a warm-up
        return _time_greedy(engine, tokenizer, prompt, n_tokens, speculator, on_first_token)
    _runs[0] += 1
    out = f"/tmp/perf-{os.environ.get('TAG', 'run')}-{_runs[0]}.data"
    perf: list[subprocess.Popen] = []

    def start() -> None:
        command = ["perf", "record", "-a", "-F", "999", "-o", out]
        perf.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)  # perf's own start, outside the timing
        if on_first_token is not None:
            on_first_token()

    result = _time_greedy(engine, tokenizer, prompt, n_tokens, speculator, start)
    perf[0].send_signal(signal.SIGINT)
    perf[0].wait()
    return result


if __name__ == "__main__":  # the echo process of the bench's round trips imports this module
    cluster.time_greedy = _recorded
    from edgetp.tui.cli import main

    sys.exit(main(sys.argv[1:]))
