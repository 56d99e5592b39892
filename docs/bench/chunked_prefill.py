"""A long prompt arrives while a stream decodes: what the stream waits, and what the prompt pays.

One stream (a short chat prompt, greedy, no end) decodes in the generation loop the REST bridge
runs (`Batcher`); once it has made DECODED tokens, a prompt of PROMPT tokens of prose is
submitted. Printed first: ms a step of one sequence's N tokens (a chunk's step by its length).
Then per setting, medians over ROUNDS: the stream's median decode step before the
prompt came, the longest wait between two of its tokens while the prompt prefilled (the loop's
`longest_gap_ms`, and in decode steps), the prompt's time to first token, and the same time
with no stream (the prompt alone). Settings: `chunk_step_s` None (the prompt prefills whole,
the stream waits) and the times a chunk's step aims at. Prompt reuse is off, so every round
prefills the whole prompt.

    PYTHONPATH=. [ROUNDS=3] [PROMPT=2000] [MODEL=...] [DTYPE=q4_0] [DEVICE=cpu=0.5] [STATE=dir] \
        .venv/bin/python -u docs/bench/chunked_prefill.py [NODES [STEP_S ...]]

NODES defaults to 1; STEP_S to 0.1 0.2 0.4 0.8 (0.001: a chunk's step aims at 2 decode steps);
MODEL to the bundled one, as its file stores it unless DTYPE; DEVICE runs every node as an
emulated device (root), as `edgetp bench --device` does.
"""

from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import time
from pathlib import Path

from edgetp.master.bench.long_prompt import prose_tokens
from edgetp.master.cluster.local import local_session
from edgetp.master.cluster.session import Session
from edgetp.master.emulate.devices import emulated
from edgetp.master.emulate.spec import parse_device
from edgetp.master.generation.batcher import Batcher, Delta, Event, Failed, Finished
from edgetp.master.generation.params import SamplingParams
from edgetp.memory.budget import MemoryOptions
from edgetp.memory.files import default_state_dir
from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.layers import StepBatch
from edgetp.models.source import open_model
from edgetp.models.tokenizer import Tokenizer

ROUNDS = int(os.environ.get("ROUNDS", "3"))
MODEL = os.environ.get("MODEL", DEFAULT_MODEL)
DTYPE = os.environ.get("DTYPE", "auto")
DEVICE = os.environ.get("DEVICE")
PROMPT = int(os.environ.get("PROMPT", "2000"))
DECODED = 8  # the stream's tokens before the long prompt comes
STREAM = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
ANSWER = SamplingParams(max_tokens=1, temperature=0.0)


def first_token_s(batcher: Batcher, prompt: list[int]) -> float:
    """Submit `prompt`; the seconds to its first token."""
    events: queue.Queue[tuple[float, Event]] = queue.Queue()
    started = time.perf_counter()
    batcher.submit(prompt, ANSWER, lambda e: events.put((time.perf_counter(), e)))
    while True:
        at, e = events.get(timeout=1800)
        if isinstance(e, Failed):
            raise e.error
        if isinstance(e, Delta | Finished):
            return at - started


def one_round(session: Session, tokenizer: Tokenizer, step_s: float | None) -> dict[str, float]:
    long = prose_tokens(tokenizer, PROMPT, seed=int(time.time()))
    batcher = Batcher(session, tokenizer, prompt_reuse=False, chunk_step_s=step_s).start()
    try:
        alone = first_token_s(batcher, long)
        made: queue.Queue[Event] = queue.Queue()
        ticket = batcher.submit(tokenizer.encode("The three primary colours are"), STREAM, made.put)
        for _ in range(DECODED):
            assert isinstance(made.get(timeout=600), Delta)
        decode_ms = statistics.median(batcher.stats().step_ms_recent[-(DECODED // 2) :])
        before = batcher.stats().longest_gap_ms
        beside = first_token_s(batcher, long)
        while not made.empty():
            made.get()
        assert isinstance(made.get(timeout=600), Delta)  # its wait after the prompt's last step
        stats = batcher.stats()
        ticket.cancel()
    finally:
        batcher.close()
    gap = stats.longest_gap_ms
    assert gap >= before
    return {"decode_ms": decode_ms, "gap_ms": gap, "gap_steps": gap / decode_ms,
            "ttft_s": beside, "alone_s": alone, "chunk": stats.prefill_chunk}  # fmt: skip


def step_ms(session: Session, tokenizer: Tokenizer) -> str:
    """ms a step of one sequence's N tokens at depth 300 (median of 5): what a chunk's step
    costs by its length."""
    engine = session.engine
    assert engine is not None
    text = prose_tokens(tokenizer, 340)
    engine.forward([text[:300]], StepBatch((0,), (0,), (300,)))
    out = []
    for n in (1, 2, 4, 8, 16, 17, 32):
        times = []
        for _ in range(5):
            started = time.perf_counter()
            engine.forward([text[300 : 300 + n]], StepBatch((0,), (300,), (n,)))
            times.append((time.perf_counter() - started) * 1e3)
        out.append(f"{n}: {statistics.median(times):.1f}")
    return "ms a step of N tokens at depth 300: " + "; ".join(out)


def main() -> None:
    nodes = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    steps = [float(a) for a in sys.argv[2:]] or [0.1, 0.2, 0.4, 0.8]
    source = open_model(MODEL)
    tokenizer = source.tokenizer()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                       if ln.startswith("Model name")), "?")  # fmt: skip
    print(f"{model_name}, {os.cpu_count()} cores; {MODEL} ({DTYPE}) on {nodes} node(s)"
          f"{f' as {DEVICE}' if DEVICE else ''}; a {PROMPT}-token prompt beside a stream; "
          f"{ROUNDS} rounds, medians")  # fmt: skip
    settings: list[float | None] = [None, *steps]
    specs = [parse_device(DEVICE)] if DEVICE else None
    state = Path(os.environ["STATE"]) if "STATE" in os.environ else default_state_dir()
    memory = MemoryOptions(dtype=DTYPE)
    with (
        emulated(specs, nodes, state) as devices,
        local_session(source, nodes, state_dir=state, context=PROMPT + 256, slots=2,
                      memory=memory, devices=devices, standby=False) as session,
    ):  # fmt: skip
        print(step_ms(session, tokenizer))
        runs: dict[float | None, list[dict[str, float]]] = {s: [] for s in settings}
        for _ in range(ROUNDS):
            for s in settings:
                runs[s].append(one_round(session, tokenizer, s))
    print("| chunk step | decode step ms | longest gap ms | in decode steps | first token s "
          "(beside a stream) | first token s (alone) | chunk tokens |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for s in settings:
        m = {k: statistics.median(r[k] for r in runs[s]) for k in runs[s][0]}
        print(f"| {'whole' if s is None else f'{s} s'} | {m['decode_ms']:.1f} | "
              f"{m['gap_ms']:.0f} | {m['gap_steps']:.1f} | {m['ttft_s']:.2f} | "
              f"{m['alone_s']:.2f} | {m['chunk']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
