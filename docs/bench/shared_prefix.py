"""Requests that arrive together over one long system prompt (an agent's tools), reuse off and on.

CLIENTS requests, each the same system prompt of ~1,300 tokens and a question of its own, are
submitted at once to the generation loop the REST bridge runs (`master.batcher.Batcher`), each
for 16 greedy tokens. Off, each prefills its whole prompt; on, the first prefills it and the
others copy its positions into their slots (master/generation/reuse.py) and prefill their
questions. Each batcher starts with nothing kept, so only the copy is measured. The two alternate,
ROUNDS times, on one session; printed: the medians of the wall time and of the time to first
token, and whether the answers are the same both ways.

    PYTHONPATH=. [ROUNDS=3] [CLIENTS=8] .venv/bin/python -u docs/bench/shared_prefix.py [NODES ...]

NODES defaults to 1 3.
"""

from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import time

from edgetp.master.cluster.local import local_session
from edgetp.master.generation.batcher import Batcher, Delta, Event, Failed, Finished
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.prompts import chat_tokens
from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.source import open_model

ROUNDS = int(os.environ.get("ROUNDS", "3"))
CLIENTS = int(os.environ.get("CLIENTS", "8"))
TOOLS = " ".join(
    f"Tool {i}: get_item_{i}(city: string, day: integer) returns the item {i} of the city on that "
    "day." for i in range(40)
)  # fmt: skip
SYSTEM = "You are an agent with these tools. " + TOOLS


def together(batcher: Batcher, prompts: list[list[int]]) -> tuple[float, float, list[str]]:
    """Every prompt submitted at once: (wall s, median time to first token s, texts)."""
    events: list[queue.Queue[tuple[float, Event]]] = [queue.Queue() for _ in prompts]
    started = time.perf_counter()
    for tokens, q in zip(prompts, events, strict=True):
        batcher.submit(tokens, SamplingParams(max_tokens=16),
                       lambda e, q=q: q.put((time.perf_counter(), e)))  # fmt: skip
    firsts, texts = [], []
    for q in events:
        first, text = None, ""
        while True:
            at, e = q.get(timeout=900)
            if isinstance(e, Delta):
                first = at if first is None else first
                text += e.text
            elif isinstance(e, Failed):
                raise e.error
            elif isinstance(e, Finished):
                firsts.append((first or at) - started)
                texts.append(text)
                break
    return time.perf_counter() - started, statistics.median(firsts), texts


def main(nodes: int) -> None:
    source = open_model(DEFAULT_MODEL)
    tokenizer = source.tokenizer()
    prompts = [
        chat_tokens(tokenizer, [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": f"What is item {i} in city {i}?"}])
        for i in range(CLIENTS)
    ]  # fmt: skip
    runs: dict[bool, list[tuple[float, float, list[str]]]] = {False: [], True: []}
    with local_session(source, nodes, context=2048, slots=CLIENTS) as session:
        for _ in range(ROUNDS):
            for reuse in (False, True):
                batcher = Batcher(session, tokenizer, prompt_reuse=reuse).start()
                try:
                    runs[reuse].append(together(batcher, prompts))
                finally:
                    batcher.close()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("Model name")), "?")  # fmt: skip
    same = all(r[2] == runs[False][0][2] for r in runs[True] + runs[False])
    print(f"{nodes} node(s), {CLIENTS} requests of {len(prompts[0])} tokens, {model}:")
    for reuse in (False, True):
        wall = statistics.median(r[0] for r in runs[reuse])
        ttft = statistics.median(r[1] for r in runs[reuse])
        print(f"  reuse {'on ' if reuse else 'off'}: wall {wall:.2f} s, first token {ttft:.2f} s")
    print(f"  answers the same off and on: {same}")


if __name__ == "__main__":
    for n in [int(a) for a in sys.argv[1:]] or [1, 3]:
        main(n)
