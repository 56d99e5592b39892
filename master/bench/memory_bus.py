"""How much of one memory system the cores of this machine share: the same weight stream timed on
one core alone and on every core at once, alternating.

Emulated devices get cores and quotas of their own, but not memory of their own: a decode step
streams its weights from memory, and on one host N devices stream through one memory system at
once, where N real devices would each have theirs. `edgetp bench --local-nodes` prints this next
to the round trips, so that a split whose products cost more than their share of one device's
can be told apart from a split that does more work.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import statistics
import time
from typing import Any

import numpy as np

STREAM_BYTES = 256 << 20  # far past any cache here (32 MB of L3): a stream from memory
STREAM_WIDTH = 1024


def _stream(k: int, core: int, rounds: int, seconds: float, gate: Any, results: Any) -> None:
    """Process `k`, on `core`: for each round, past `gate`, stream a matrix through a product for
    `seconds` of CPU time if the round is one of every process (odd rounds) or `k` is 0, and put
    (round, k, GB/s) on `results`."""
    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before NumPy's BLAS starts its threads
    os.sched_setaffinity(0, {core})
    w = np.full((STREAM_BYTES // (4 * STREAM_WIDTH), STREAM_WIDTH), 0.5, np.float32)
    x = np.ones(STREAM_WIDTH, np.float32)
    w @ x
    for r in range(rounds):
        gate.wait()
        if r % 2 == 0 and k > 0:
            continue  # a round of process 0 alone
        begin, n = time.process_time(), 0
        while time.process_time() - begin < seconds:
            w @ x
            n += 1
        results.put((r, k, n * w.nbytes / (time.process_time() - begin) / 1e9))


def stream_rates(
    cores: list[int], pairs: int = 3, seconds: float = 0.5
) -> tuple[float, list[float]]:
    """GB/s of one process streaming on `cores[0]` alone, and of one on each of `cores` streaming
    at the same time (in the order of `cores`): medians of `pairs` alternating rounds, since
    these hosts drift between seconds. Timed in CPU seconds: a loaded host's other work moves
    when each process runs, not what it reads a CPU second."""
    context = multiprocessing.get_context("spawn")
    rounds = 2 * pairs
    gate, results = context.Barrier(len(cores)), context.Queue()
    procs = [
        context.Process(target=_stream, args=(k, c, rounds, seconds, gate, results), daemon=True)
        for k, c in enumerate(cores)
    ]
    for p in procs:
        p.start()
    try:
        got = _results(procs, cores, results, pairs * (1 + len(cores)), 60 + rounds * seconds)
    except BaseException:
        for p in procs:  # the others wait for the one that failed at the next round
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    alone = statistics.median(rate for r, _k, rate in got if r % 2 == 0)
    together = [
        statistics.median(rate for r, k, rate in got if r % 2 and k == i) for i in range(len(cores))
    ]
    return alone, together


def _results(
    procs: list[Any], cores: list[int], results: Any, count: int, within_s: float
) -> list[tuple[int, int, float]]:
    """`count` results off `results`; RuntimeError at once if a stream process dies first, or
    if they are not all in within `within_s` seconds."""
    got: list[tuple[int, int, float]] = []
    deadline = time.monotonic() + within_s
    while len(got) < count:
        try:
            got.append(results.get(timeout=0.5))
        except queue.Empty:
            for core, p in zip(cores, procs, strict=True):
                if p.exitcode not in (None, 0):
                    raise RuntimeError(
                        f"the memory stream on core {core} failed (exit code {p.exitcode})"
                    ) from None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the memory streams gave {len(got)} of {count} figures in {within_s:.0f} s"
                ) from None
    return got
