"""Timing the kernel candidates under a CPU quota by the wall clock and by the CPU clock.

    .venv/bin/python docs/bench/kernel_clock.py OUT IN [ROUNDS]    (root, cgroups v1)

Runs itself in a cgroup of half a core (5000 of a 10000 us period) on core 1, as an emulated
cpu=0.5 device's kernel check does, and times f32 OUT x IN products of one row with each
candidate as `node.device`'s check does (median of calls within 10 ms), by each clock in turn.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup/cpu/edgetp-kernel-clock")


def child(out: int, inp: int, rounds: int) -> None:
    import numpy as np

    from edgetp.models import kernels
    from edgetp.node.kernel_probe import Probe

    kernels.limit_blas(1)
    probe = Probe("f32", out, inp, np.random.default_rng(0))
    loaded = {c.name: c.load() for c in kernels.CANDIDATES["f32"]}
    for k in range(rounds):
        for name, clock in (("wall", time.perf_counter), ("cpu", time.thread_time)):
            probe.best.clear()
            us = {c: round(probe.check(f, 0, clock)[1] or 0) for c, f in loaded.items()}
            print(k, name, us, "->", min(us, key=lambda c: us[c]), flush=True)


if __name__ == "__main__":
    out, inp = int(sys.argv[1]), int(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    if os.environ.get("KERNEL_CLOCK_CHILD"):
        child(out, inp, rounds)
        sys.exit(0)
    CGROUP.mkdir(exist_ok=True)
    try:
        (CGROUP / "cpu.cfs_period_us").write_text("10000")
        (CGROUP / "cpu.cfs_quota_us").write_text("5000")
        command = ["taskset", "-c", "1", sys.executable, __file__, *sys.argv[1:]]
        env = os.environ | {"KERNEL_CLOCK_CHILD": "1"}
        into = lambda: (CGROUP / "tasks").write_text(str(os.getpid()))  # noqa: E731
        subprocess.run(command, env=env, preexec_fn=into, check=True)
    finally:
        CGROUP.rmdir()
