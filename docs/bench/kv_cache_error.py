"""A reduced-precision KV cache (--kv-cache f16, q8_0) against float32 KV on the bundled SmolLM2:
its error, measured as the field measures it, and decode time at depth, side by side.

Error: teacher-forced over TEXT_TOKENS tokens of the repository's own prose (README.md, then
docs/*.md, in order), prefilled in chunks so every position attends to keys read back from the
cache: the mean KL-divergence of each format's next-token distribution from float32 KV's, and
the share of positions whose top-1 token is float32 KV's.

Decode: ms a token of the C decode blocks at a depth of DEPTH tokens, each format's engine in
turn within every round (alternating, so a shared machine's load falls on all of them alike),
the median over rounds. Run from the repository:

    [THREADS=N] .venv/bin/python docs/bench/kv_cache_error.py [TEXT_TOKENS [DEPTH]]

TEXT_TOKENS 0: the decode times alone. Threads as `edgetp --threads THREADS` sets them (torch on
one, BLAS and the C blocks on THREADS, default the process's cores).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

from edgetp.master.cluster.engine import Engine
from edgetp.models.bundled import DEFAULT_MODEL
from edgetp.models.kernels import set_threads
from edgetp.models.layers import StepBatch
from edgetp.models.source import open_model

FORMATS = ("f32", "f16", "q8_0")
TEXT_TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
DEPTH = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
CHUNK = 512  # prompt tokens a prefill step: its logits (CHUNK x vocab) stay ~100 MB
STEPS, ROUNDS = 16, 7  # decode steps a round, rounds

set_threads(int(os.environ.get("THREADS", "0")) or None)
source = open_model(DEFAULT_MODEL)
tokenizer = source.tokenizer()
root = Path(__file__).resolve().parents[2]
prose = "\n\n".join(p.read_text() for p in [root / "README.md", *sorted(root.glob("docs/*.md"))])
ids = tokenizer.encode(prose)[: max(TEXT_TOKENS, DEPTH)]
assert len(ids) >= TEXT_TOKENS, f"the prose holds {len(ids)} tokens, not {TEXT_TOKENS}"
context = max(TEXT_TOKENS, DEPTH + STEPS * ROUNDS) + 1
engines = {f: Engine.local(source, max_context=context, slots=1, kv_format=f) for f in FORMATS}
for e in engines.values():  # the admission's timing may turn them away on a loaded machine
    for _ in range(3):
        if e.executors[0].native is None:
            e.executors[0].admit_native()
assert all(e.executors[0].native is not None for e in engines.values()), "C decode blocks"
kv_bytes = {f: e.executors[0].cache.nbytes for f, e in engines.items()}

kl = {f: 0.0 for f in FORMATS[1:]}
agree = {f: 0 for f in FORMATS[1:]}
with torch.inference_mode():
    for start in range(0, TEXT_TOKENS, CHUNK):
        chunk = ids[start : start + CHUNK]
        batch = StepBatch((0,), (start,), (len(chunk),))
        logp = {
            f: torch.log_softmax(e.forward([chunk], batch, all_logits=True)[0], -1)
            for f, e in engines.items()
        }
        ref = logp["f32"]
        for f in FORMATS[1:]:
            kl[f] += (ref.exp() * (ref - logp[f])).sum(-1).sum().item()
            agree[f] += (ref.argmax(-1) == logp[f].argmax(-1)).sum().item()

if TEXT_TOKENS:
    print(f"SmolLM2-135M, {TEXT_TOKENS} tokens of the repository's prose, against float32 KV:")
    print(f"  {'KV':<6}{'bytes':>8}{'mean KL':>12}{'top-1 agreement':>17}")
    print(f"  {'f32':<6}{'1.00x':>8}{'-':>12}{'-':>17}")
    for f in FORMATS[1:]:
        ratio = kv_bytes[f] / kv_bytes["f32"]
        line = f"{ratio:.2f}x{kl[f] / TEXT_TOKENS:>12.2e}{agree[f] / TEXT_TOKENS:>17.4f}"
        print(f"  {f:<6}{line:>37}")

# Decode at depth: the text's first DEPTH tokens as the prompt, then greedy steps on the C
# blocks (one row: a decode step), each round from the same depth.
prompt = ids[:DEPTH]
ms: dict[str, list[float]] = {f: [] for f in FORMATS}
with torch.inference_mode():
    for e in engines.values():
        e.forward([prompt], StepBatch((0,), (0,), (DEPTH,)))
    for _ in range(ROUNDS):
        for f, e in engines.items():
            token = prompt[-1]
            started = time.perf_counter()
            for i in range(STEPS):
                logits = e.forward([[token]], StepBatch((0,), (DEPTH + i,), (1,)))
                token = int(logits[0].argmax())
            ms[f].append((time.perf_counter() - started) / STEPS * 1e3)
print(f"decode at depth {DEPTH}, ms a token (median of {ROUNDS} alternating rounds of {STEPS}):")
for f in FORMATS:
    median = statistics.median(ms[f])
    ratio = median / statistics.median(ms["f32"])
    print(f"  {f:<6}{median:>8.2f} ms  {ratio:.2f}x f32's   rounds {[round(x, 2) for x in ms[f]]}")
