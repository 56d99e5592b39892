"""Time to first token, turn by turn, of a 7-turn conversation with prompt reuse on and off.

Each turn sends the whole conversation (as `edgetp chat` does) to the generation loop the REST
bridge runs (`master.batcher.Batcher`): a user message of about 150 tokens, a greedy answer of up
to 100. Off, every turn prefills the whole conversation; on, only what is new since the last
answer. The two alternate, ROUNDS times, on one session, and each turn's median is printed, with
the last turn's time over the first's, and whether the greedy answers are the same both ways.

    PYTHONPATH=. [ROUNDS=2] [MODEL=path] .venv/bin/python -u docs/bench/prompt_reuse.py [NODES ...]

NODES defaults to 1 3; MODEL to the bundled SmolLM2 (any model with a chat template).
"""

from __future__ import annotations

import os
import queue
import statistics
import subprocess
import sys
import time

from edgetp.master.cluster.local import local_session
from edgetp.master.cluster.session import Session
from edgetp.master.generation.batcher import Batcher, Delta, Event, Failed, Finished
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.prompts import chat_tokens
from edgetp.models.source import open_model
from edgetp.models.tokenizer import Tokenizer

ROUNDS = int(os.environ.get("ROUNDS", "2"))
ANSWER_TOKENS = 100
SYSTEM = "You are a helpful assistant who answers carefully and in detail."
TOPICS = [
    "how bread rises",
    "why the sky is blue",
    "how a bicycle stays upright",
    "what makes a good cup of tea",
    "how tides work",
    "why leaves change colour in autumn",
    "how a refrigerator keeps food cold",
]
FILLER = (
    "I have read a little about {t} already, and I would like to understand it properly, step "
    "by step, from the basic ideas to the details that people usually leave out. Please explain "
    "the main causes, the order in which things happen, and what would change if one of the "
    "conditions were different. If there are common misconceptions about {t}, point them out "
    "and say why they are wrong. Give one everyday example that makes the idea concrete, and "
    "one number or measurement that shows how large the effect is in practice. Keep the "
    "explanation clear for someone who is curious but not an expert."
)


def ask(batcher: Batcher, tokens: list[int]) -> tuple[float, str]:
    """One request alone: its time to first token (s) and its text."""
    events: queue.Queue[Event] = queue.Queue()
    started = time.perf_counter()
    batcher.submit(tokens, SamplingParams(max_tokens=ANSWER_TOKENS), events.put)
    first, text = None, ""
    while True:
        e = events.get(timeout=600)
        if first is None:
            first = time.perf_counter() - started
        if isinstance(e, Delta):
            text += e.text
        elif isinstance(e, Failed):
            raise e.error
        elif isinstance(e, Finished):
            assert first is not None
            return first, text


def conversation(
    session: Session, tokenizer: Tokenizer, reuse: bool, turns: int = len(TOPICS)
) -> list[tuple[int, int, float, str]]:
    """(prompt tokens, reused, time to first token, answer) per turn."""
    batcher = Batcher(session, tokenizer, prompt_reuse=reuse).start()
    try:
        messages = [{"role": "system", "content": SYSTEM}]
        out = []
        for topic in TOPICS[:turns]:
            messages.append({"role": "user", "content": FILLER.format(t=topic)})
            tokens = chat_tokens(tokenizer, messages)
            ttft, text = ask(batcher, tokens)
            last = batcher.stats().last_reuse
            out.append((len(tokens), last.reused_tokens if last else 0, ttft, text))
            messages.append({"role": "assistant", "content": text})
        return out
    finally:
        batcher.close()


def bench(nodes: int) -> None:
    source = open_model(os.environ.get("MODEL"))
    tokenizer = source.tokenizer()
    runs: dict[bool, list[list[tuple[int, int, float, str]]]] = {False: [], True: []}
    with local_session(source, nodes, context=2048, slots=2) as session:
        conversation(session, tokenizer, True, turns=2)  # warm-up: kernels, page cache
        for _ in range(ROUNDS):
            for reuse in (False, True):
                runs[reuse].append(conversation(session, tokenizer, reuse))
    print(f"\n{nodes} node(s), {source.name}, {ROUNDS} rounds alternating, medians")
    print("turn  prompt  reused  ttft off (s)  ttft on (s)")
    ttft = {r: [statistics.median(run[k][2] for run in runs[r]) for k in range(len(TOPICS))]
            for r in runs}  # fmt: skip
    for k in range(len(TOPICS)):
        prompt, reused = runs[True][0][k][0], runs[True][0][k][1]
        off, on = ttft[False][k], ttft[True][k]
        print(f"{k + 1:4d}  {prompt:6d}  {reused:6d}  {off:12.3f}  {on:11.3f}")
    answers = {tuple(t[3] for t in run) for r in runs for run in runs[r]}
    off_ratio, on_ratio = ttft[False][-1] / ttft[False][0], ttft[True][-1] / ttft[True][0]
    print(f"last turn / first turn: off {off_ratio:.2f}, on {on_ratio:.2f}; greedy answers the "
          f"same in every run, off and on: {len(answers) == 1}")  # fmt: skip


if __name__ == "__main__":
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next(line for line in lscpu.splitlines() if line.startswith("Model name")))
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    for n in [int(a) for a in sys.argv[1:]] or [1, 3]:
        bench(n)
