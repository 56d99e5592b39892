"""Tokens with the plan free to leave devices on standby against the split forced (what
`edgetp bench` times), alternating, on emulated devices (root, cgroups v1).

    .venv/bin/python docs/bench/standby_ab.py "cpu=0.5,rtt=2ms" ROUNDS TOKENS [NODES]

One spec for every node, or one per node separated by ";" (the master first), e.g.
"cpu=0.5;cpu=0.5;cpu=0.5,rtt=2ms" 2 32 3. Results: docs/bench/README.md.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from edgetp.master.bench.greedy import time_greedy
from edgetp.master.cluster.local import local_session
from edgetp.master.emulate.devices import emulated
from edgetp.master.emulate.spec import parse_device
from edgetp.master.generation.prompts import open_with_tokenizer, prompt_tokens


def main() -> None:
    specs = [parse_device(s) for s in sys.argv[1].split(";")]
    rounds, n_tokens = int(sys.argv[2]), int(sys.argv[3])
    nodes = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    source, tokenizer = open_with_tokenizer(None)
    prompt = prompt_tokens(tokenizer, "Name three rivers in Europe.", raw=False)
    state = Path(tempfile.mkdtemp(prefix="standby-ab-"))
    ms: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    try:
        for r in range(rounds):
            for standby in (True, False):
                with (
                    emulated(specs, nodes, state) as devices,
                    local_session(
                        source, nodes, state_dir=state, devices=devices, standby=standby,
                        context=256,
                    ) as session,
                ):  # fmt: skip
                    assert session.engine is not None and session.hub is not None
                    _, per_token, tokens[standby] = time_greedy(
                        session.engine, tokenizer, prompt, n_tokens
                    )
                    ms[standby].append(round(per_token, 2))
                    print(
                        f"round {r} standby={standby}: {per_token:.2f} ms/token, planned "
                        f"{[m.name for m in session.hub.members]}, on standby "
                        f"{[m.name for m in session.hub.standby]}",
                        flush=True,
                    )
    finally:
        shutil.rmtree(state, ignore_errors=True)
    for standby, values in ms.items():
        print(f"standby={standby}: median {statistics.median(values):.2f} ms/token of {values}")
    print("greedy tokens identical:", tokens[True] == tokens[False])


if __name__ == "__main__":
    main()
