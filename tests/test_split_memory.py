"""Splitting a model holds one layer (and, once, the embedding) in memory, not the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from edgetp.master.cluster.plan import plan_slices
    from edgetp.memory.splitter import split_model
    from edgetp.memory.shards import ShardStore
    from edgetp.models.source import open_model

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    source = open_model(None)
    c = source.config
    slices = plan_slices(c, [1, 1, 1])
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak: measure the split alone
    base = status("VmRSS")
    split_model(source, slices, ShardStore(Path(sys.argv[1])))
    peak = status("VmHWM")
    hd = c.head_dim
    layer = 4 * (c.hidden * hd * (2 * c.n_heads + 2 * c.n_kv_heads) + 3 * c.hidden * c.ffn_hidden)
    embedding = 4 * c.vocab_size * c.hidden
    print(json.dumps({"base": base, "peak": peak, "layer": layer, "embedding": embedding}))
    """
)


def test_split_peak_rss_is_bounded_by_a_layer_and_the_embedding(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "shards")],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ,
    )
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["base"]
    bound = 2 * (m["layer"] + m["embedding"])
    print(
        f"split for 3 nodes: peak RSS {growth / 2**20:.0f} MiB above the baseline "
        f"{m['base'] / 2**20:.0f} MiB; bound 2 x (layer {m['layer'] / 2**20:.0f} MiB + "
        f"embedding {m['embedding'] / 2**20:.0f} MiB) = {bound / 2**20:.0f} MiB"
    )
    assert growth < bound
