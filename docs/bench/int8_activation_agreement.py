"""Int8 activations (`--activations int8`) against exact ones on one model file, the field's way
(llama-perplexity --kl-divergence): over a text cut into chunks of 512 tokens, each chunk's
second half scored (its first half is context, as llama-perplexity scores), the mean
KL-divergence of the int8 run's next-token distribution from the exact run's, how often their
top tokens agree, and each run's perplexity; then decode and a 512-token prefill timed in both
modes, alternating rounds, on one node.

Run from the repository:
  .venv/bin/python docs/bench/int8_activation_agreement.py [--chunks 16] [--rounds 3]
      [--threads 1 2] [--model NAME|PATH] [TEXT ...]
TEXT: files read in order (default: the GPL-3, GPL-2 and Apache-2.0 texts of
/usr/share/common-licenses, English prose any Debian system has), joined by blank lines.

llama.cpp's figures on the same file and text (docs/bench/README.md): the text written out, the
file's weights as F32 (`llama-quantize --allow-requantize FILE f32.gguf F32`), then
`llama-perplexity -m f32.gguf -f text.txt -c 512 --chunks 16 --kl-divergence-base base.kld` and
`llama-perplexity -m FILE -f text.txt -c 512 --chunks 16 --kl-divergence-base base.kld
--kl-divergence`."""

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from edgetp.master.cluster.local import local_engine
from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import SamplingParams
from edgetp.memory.budget import MemoryOptions
from edgetp.models import kernels
from edgetp.models.bundled import DEFAULT_MODEL
from edgetp.models.layers import StepBatch
from edgetp.models.source import open_model
from edgetp.node.device import prepare

LICENSES = Path("/usr/share/common-licenses")
CHUNK = 512

parser = argparse.ArgumentParser()
parser.add_argument("text", nargs="*", type=Path)
parser.add_argument("--model", default=DEFAULT_MODEL)
parser.add_argument("--chunks", type=int, default=16)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
parser.add_argument("--tokens", type=int, default=64, help="greedy tokens a decode timing")
args = parser.parse_args()
source = open_model(args.model)
tokenizer = source.tokenizer()
files = args.text or [LICENSES / n for n in ("GPL-3", "GPL-2", "Apache-2.0")]
ids = tokenizer.encode("\n\n".join(f.read_text() for f in files))
chunks = [ids[i * CHUNK : (i + 1) * CHUNK] for i in range(min(args.chunks, len(ids) // CHUNK))]
if tokenizer.add_bos:  # as llama-perplexity does: each chunk starts with the BOS token
    chunks = [[tokenizer.bos_id, *c[1:]] for c in chunks]
memory = MemoryOptions(dtype="auto")  # the file's own formats
state = Path("/tmp/int8-activations-bench")
print(f"model {source.path}: {len(chunks)} chunks of {CHUNK} tokens of {len(ids)}")


def use(mode: str) -> None:
    """This process's products chosen again for `mode` (the prefill path reads the table)."""
    kernels.set_activations(mode)
    prepare({(dtype, out, inp) for dtype, _, out, inp in kernels._chosen})


def log_probs(engine, chunk: list[int]) -> torch.Tensor:  # noqa: ANN001
    logits = engine.forward([chunk], StepBatch((0,), (0,), (len(chunk),)), all_logits=True)
    return torch.log_softmax(logits[0, CHUNK // 2 : -1].double(), dim=-1)


kl, same, nll = [], [], {"exact": [], "int8": []}
with local_engine(source, 1, state_dir=state, context=CHUNK, memory=memory) as engine:
    for chunk in chunks:
        use("exact")
        exact = log_probs(engine, chunk)
        use("int8")
        rounded = log_probs(engine, chunk)
        targets = torch.tensor(chunk[CHUNK // 2 + 1 :])
        kl.append((exact.exp() * (exact - rounded)).sum(-1))
        same.append(exact.argmax(-1) == rounded.argmax(-1))
        for mode, lp in (("exact", exact), ("int8", rounded)):
            nll[mode].append(-lp.gather(1, targets[:, None])[:, 0])
    engine.close()
kl_all, same_all = torch.cat(kl), torch.cat(same).double()
ppl = {m: float(torch.cat(v).mean().exp()) for m, v in nll.items()}
print(
    f"int8 against exact over {len(kl_all)} positions: mean KL-divergence "
    f"{kl_all.mean():.5f} (99th percentile {kl_all.quantile(0.99):.5f}), same top token "
    f"{same_all.mean() * 100:.2f}%, perplexity exact {ppl['exact']:.4f} int8 {ppl['int8']:.4f} "
    f"({(ppl['int8'] / ppl['exact'] - 1) * 100:+.2f}%)"
)


def timed(mode: str, threads: int) -> tuple[float, float]:
    """(ms a decoded token, ms a 512-token prefill) on one node in `mode`."""
    with local_engine(
        source,
        1,
        threads=threads,
        state_dir=state,
        context=2 * CHUNK,
        memory=replace(memory, activations=mode),
    ) as engine:
        engine.forward([chunks[0]], StepBatch((0,), (0,), (CHUNK,)))  # warm
        began = time.perf_counter()
        engine.forward([chunks[0]], StepBatch((0,), (0,), (CHUNK,)))
        prefill = (time.perf_counter() - began) * 1000
        params = SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True)
        seqs = start(engine, [chunks[1][:16]], [params])
        stamps = [time.perf_counter() for _ in stream(engine, tokenizer, seqs)]
        engine.close()
    return (stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1), prefill


for threads in args.threads:
    runs: dict[str, list[tuple[float, float]]] = {"exact": [], "int8": []}
    for r in range(args.rounds):
        for mode in ("exact", "int8") if r % 2 == 0 else ("int8", "exact"):
            runs[mode].append(timed(mode, threads))
    med = {m: [statistics.median(v[i] for v in runs[m]) for i in (0, 1)] for m in runs}
    print(
        f"{threads} thread(s), medians of {args.rounds} alternating rounds: decode ms/token "
        f"exact {med['exact'][0]:.2f} int8 {med['int8'][0]:.2f} "
        f"(int8/exact {med['int8'][0] / med['exact'][0]:.3f}); prefill {CHUNK} tokens ms "
        f"exact {med['exact'][1]:.0f} int8 {med['int8'][1]:.0f} "
        f"(int8/exact {med['int8'][1] / med['exact'][1]:.3f})"
    )
    rounds = {m: [f"{d:.2f}/{p:.0f}" for d, p in v] for m, v in runs.items()}
    print(f"  rounds (decode ms/prefill ms): {rounds}")
