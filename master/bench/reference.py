"""`edgetp bench`: edgetp against the transformers implementation of the same weights.

Both run greedy decoding of the same prompt in this process, alternating rounds so drift on a
shared machine hits both alike; the figures kept are medians, and the comparison is their ratio.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from edgetp.master.bench.greedy import PROMPT, time_greedy
from edgetp.master.cluster.engine import Engine
from edgetp.master.generation.prompts import open_with_tokenizer, prompt_tokens
from edgetp.models.errors import ModelError
from edgetp.models.kernels import activations, set_threads
from edgetp.models.source import GGUFSource, ModelSource


def _reference_model(source: ModelSource) -> Any:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise ModelError(
            "the reference needs transformers: pip install transformers accelerate"
        ) from exc
    if isinstance(source, GGUFSource):
        return AutoModelForCausalLM.from_pretrained(
            source.path.parent, gguf_file=source.path.name, dtype=torch.float32
        ).eval()
    return AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()


@torch.inference_mode()
def _time_reference(
    model: Any, prompt: list[int], n_tokens: int, threads: int
) -> tuple[float, float, list[int]]:
    # The reference runs on torch's own kernels: give them every thread edgetp gets, then hand
    # them back so edgetp's BLAS threads do not compete with torch's.
    torch.set_num_threads(threads)
    try:
        return _greedy_reference(model, prompt, n_tokens)
    finally:
        torch.set_num_threads(1)


def _greedy_reference(
    model: Any, prompt: list[int], n_tokens: int
) -> tuple[float, float, list[int]]:
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    out = model(ids, use_cache=True)
    token = int(out.logits[0, -1].argmax())
    t1 = time.perf_counter()
    tokens = [token]
    past = out.past_key_values
    for _ in range(n_tokens - 1):
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) * 1000 / (n_tokens - 1), tokens


def run_bench(
    model: str | None,
    n_tokens: int,
    rounds: int,
    json_path: str | None,
    threads: int | None,
    context: int | None,
) -> dict[str, Any]:
    """ms/token and time to first token of edgetp and of transformers, and their ratio."""
    if n_tokens < 2 or rounds < 1:
        raise ValueError("--tokens must be >= 2 and --rounds >= 1")
    threads = set_threads(threads)
    source, tokenizer = open_with_tokenizer(model)
    engine = Engine.local(source, max_context=context)
    prompt = prompt_tokens(tokenizer, PROMPT, raw=False)
    reference = _reference_model(source)
    results: dict[str, list[float]] = {
        "edgetp_ms": [],
        "ref_ms": [],
        "edgetp_ttft": [],
        "ref_ttft": [],
    }
    same = True
    time_greedy(engine, tokenizer, prompt, 4)  # warm-up: first calls pay for allocation
    _time_reference(reference, prompt, 4, threads)
    for _ in range(rounds):
        ttft, ms, ours = time_greedy(engine, tokenizer, prompt, n_tokens)
        results["edgetp_ttft"].append(ttft)
        results["edgetp_ms"].append(ms)
        ttft, ms, theirs = _time_reference(reference, prompt, n_tokens, threads)
        results["ref_ttft"].append(ttft)
        results["ref_ms"].append(ms)
        same = same and ours == theirs
    med = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "model": str(source.path),
        "threads": threads,
        "prompt_tokens": len(prompt),
        "tokens": n_tokens,
        "rounds": rounds,
        "edgetp_ms_per_token": round(med["edgetp_ms"], 2),
        "transformers_ms_per_token": round(med["ref_ms"], 2),
        "ratio_edgetp_over_transformers": round(med["edgetp_ms"] / med["ref_ms"], 3),
        "edgetp_tokens_per_s": round(1000 / med["edgetp_ms"], 1),
        "edgetp_ttft_ms": round(med["edgetp_ttft"] * 1000, 1),
        "transformers_ttft_ms": round(med["ref_ttft"] * 1000, 1),
        "greedy_tokens_identical": same,
        "all_rounds": {k: [round(x, 4) for x in v] for k, v in results.items()},
    }
    print(
        f"model {report['model']}  threads {threads}  activations {activations()}  "
        f"prompt {len(prompt)} tokens"
    )
    print(f"{'':14}{'ms/token':>10}{'TTFT ms':>10}")
    print(f"{'edgetp':14}{report['edgetp_ms_per_token']:>10}{report['edgetp_ttft_ms']:>10}")
    print(
        f"{'transformers':14}{report['transformers_ms_per_token']:>10}"
        f"{report['transformers_ttft_ms']:>10}"
    )
    print(f"ratio edgetp/transformers (ms/token): {report['ratio_edgetp_over_transformers']}")
    print(f"greedy tokens identical: {same}")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report
