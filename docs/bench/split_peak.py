"""Peak RSS of splitting a model for N nodes, sampled from outside every 20 ms.

Usage: .venv/bin/python docs/bench/split_peak.py MODEL NODES DTYPE
"""

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

model, nodes, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
state = tempfile.mkdtemp()
code = f"""
from edgetp.master.cluster.plan import plan_slices
from edgetp.memory.splitter import split_model
from edgetp.memory.shards import ShardStore
from edgetp.models.source import open_model
src = open_model({model!r})
slices = plan_slices(src.config, [1.0] * {nodes})
split_model(src, slices, ShardStore({state!r} + '/shards'), dtype={dtype!r})
"""
child = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2])
peak, start = 0, time.time()
while child.poll() is None:
    try:
        for line in Path(f"/proc/{child.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                peak = max(peak, int(line.split()[1]))
    except OSError:
        pass
    time.sleep(0.02)
shutil.rmtree(state)
print(
    f"split {model} for {nodes} nodes at {dtype}: exit {child.returncode}, "
    f"{time.time() - start:.1f} s, peak RSS {peak / 2**20:.3f} GiB"
)
