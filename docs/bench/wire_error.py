"""Float16 sums (`--wire float16`) against float32 ones across N local nodes, the field's way
(llama-perplexity --kl-divergence), both against one node: over a text cut into chunks of 512
tokens, each chunk's second half scored (its first half is context, as llama-perplexity
scores), the mean KL-divergence of each run's next-token distribution from one node's and how
often their top tokens agree; then greedy decoding (the native loop's sums) from the chunks'
openings, token for token against one node's.

Run from the repository (an `if __name__` guard: local nodes start from a fork server):
  .venv/bin/python docs/bench/wire_error.py [--model NAME|PATH] [--nodes 3] [--chunks 8]
      [--tokens 64] [TEXT ...]
TEXT: files read in order (default: the GPL-3, GPL-2 and Apache-2.0 texts of
/usr/share/common-licenses, English prose any Debian system has), joined by blank lines.
"""

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from edgetp.master.cluster.local import local_engine
from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import SamplingParams
from edgetp.memory.budget import MemoryOptions
from edgetp.models.bundled import DEFAULT_MODEL
from edgetp.models.layers import StepBatch
from edgetp.models.source import open_model
from edgetp.node.protocol import WIRES

LICENSES = Path("/usr/share/common-licenses")
CHUNK = 512


def log_probs(engine, chunk: list[int]) -> torch.Tensor:  # noqa: ANN001
    logits = engine.forward([chunk], StepBatch((0,), (0,), (len(chunk),)), all_logits=True)
    return torch.log_softmax(logits[0, CHUNK // 2 : -1].double(), dim=-1)


def run(source, chunks, tokens, nodes, memory, state):  # noqa: ANN001, ANN201
    """Each chunk's scored log-probabilities, and the greedy tokens from each chunk's opening."""
    tokenizer = source.tokenizer()
    with local_engine(source, nodes, state_dir=state, context=CHUNK, memory=memory) as engine:
        scored = [log_probs(engine, c) for c in chunks]
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        greedy = []
        for c in chunks:
            seqs = start(engine, [c[:32]], [params])
            list(stream(engine, tokenizer, seqs))
            greedy.append(list(seqs[0].tokens))
        engine.close()
    return scored, greedy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("text", nargs="*", type=Path)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens from each chunk")
    args = parser.parse_args()
    source = open_model(args.model)
    tokenizer = source.tokenizer()
    files = args.text or [LICENSES / n for n in ("GPL-3", "GPL-2", "Apache-2.0")]
    ids = tokenizer.encode("\n\n".join(f.read_text() for f in files))
    n = min(args.chunks, len(ids) // CHUNK)
    chunks = [ids[i * CHUNK : (i + 1) * CHUNK] for i in range(n)]
    if tokenizer.add_bos:  # as llama-perplexity does: each chunk starts with the BOS token
        chunks = [[tokenizer.bos_id, *c[1:]] for c in chunks]
    memory = MemoryOptions(dtype="auto")  # the file's own formats
    state = Path("/tmp/wire-error-bench")
    print(f"model {source.path}: {n} chunks of {CHUNK} tokens, {args.nodes} nodes against one")
    one, one_greedy = run(source, chunks, args.tokens, 1, memory, state)
    for wire in WIRES:
        scored, greedy = run(
            source, chunks, args.tokens, args.nodes, replace(memory, wire=wire), state
        )
        kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(one, scored, strict=True)])
        same = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(one, scored, strict=True)])
        first_differs = [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            for a, b in zip(one_greedy, greedy, strict=True)
        ]
        print(
            f"  wire {wire}: mean KL-divergence {kl.mean():.2e} (max {kl.max():.2e}) over "
            f"{len(kl)} positions, same top token {same.double().mean() * 100:.2f}%; greedy "
            f"{args.tokens} tokens identical in {first_differs.count(None)} of {n} "
            f"(first difference at {first_differs})"
        )


if __name__ == "__main__":
    main()
