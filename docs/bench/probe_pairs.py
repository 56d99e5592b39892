"""Two emulated cpu=0.5 devices' speed probes taken at one moment, as MEASURE has them before a
plan: how far apart identical devices measure, by probe shape.

    .venv/bin/python docs/bench/probe_pairs.py PAIRS ROUNDS:SECONDS [ROUNDS:SECONDS ...]  (root)

Two processes, each in a cgroup of half a core (5000 of 10000 us) on a core of its own, take
`node.worker.measure_speed(1, rounds, seconds)` for each shape in turn, at moments agreed a
second and a half apart; prints each pair's ratio (core 0 over core 1) and their spread.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CGROUPS = Path("/sys/fs/cgroup/cpu")


def child(core: int, group: str, start: float, pairs: int, shapes: list[str]) -> None:
    (CGROUPS / group / "tasks").write_text(str(os.getpid()))
    os.sched_setaffinity(0, {core})
    from edgetp.models.kernels import limit_blas
    from edgetp.node.probes import measure_speed

    limit_blas(1)
    measure_speed(1)
    out: dict[str, list[float]] = {s: [] for s in shapes}
    for k in range(pairs):
        for j, shape in enumerate(shapes):
            while time.time() < start + (k * len(shapes) + j) * 1.5:
                time.sleep(0.005)
            rounds, seconds = shape.split(":")
            out[shape].append(measure_speed(1, int(rounds), float(seconds)))
    print(repr(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "child":
        core, group, start, pairs = (
            int(sys.argv[2]),
            sys.argv[3],
            float(sys.argv[4]),
            int(sys.argv[5]),
        )
        child(core, group, start, pairs, sys.argv[6:])
        sys.exit(0)
    pairs, shapes = int(sys.argv[1]), sys.argv[2:]
    groups = [f"edgetp-probe-pairs-{os.getpid()}-{k}" for k in range(2)]
    for g in groups:
        (CGROUPS / g).mkdir()
        (CGROUPS / g / "cpu.cfs_period_us").write_text("10000")
        (CGROUPS / g / "cpu.cfs_quota_us").write_text("5000")
    try:
        start = time.time() + 10
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "child", str(k), groups[k], str(start), str(pairs)]
                + shapes,
                stdout=subprocess.PIPE, text=True,
            )
            for k in range(2)
        ]  # fmt: skip
        a, b = (eval(p.communicate()[0]) for p in procs)  # noqa: S307 (our own repr)
        for shape in shapes:
            ratios = [x / y for x, y in zip(a[shape], b[shape], strict=True)]
            furthest = max(abs(r - 1) for r in ratios)
            print(
                f"{shape}: ratios {', '.join(f'{r:.3f}' for r in ratios)}; "
                f"spread (sd) {statistics.stdev(ratios):.3f}, furthest {furthest:.3f}"
            )
    finally:
        for g in groups:
            (CGROUPS / g).rmdir()
