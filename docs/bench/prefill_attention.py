"""Where a long prompt's prefill goes: attention's core against everything else, and what
attention's forms cost at one layer's shapes.

1. The bundled model's prefill of each N tokens (at most its context less 2) in one process
   (torch's path, as a prompt step runs): the seconds in `block_math._attend` (SDPA, or the
   explicit scores with sinks) against the whole step. The rest is the products, norms, RoPE
   and the head.
2. One layer's attention at the model's head shapes, for each N: SDPA with `is_causal` (a prompt
   from its start), with one explicit (T, L) mask (what a continued prompt, a batch and a
   sliding window took before tiles), in tiles (`block_math._attend_tiles`, what they take now),
   a 512-position window in one mask and in tiles, and the explicit scores with sinks (gpt-oss),
   whole and in tiles: seconds, the aten kernel SDPA chose and the memory its ops allocated (the
   largest one, and all together).

Usage, from the repository: `.venv/bin/python docs/bench/prefill_attention.py [N ...]`
(default 4096 8192; `--model M`, `--threads T`).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from edgetp.master.bench.greedy import time_greedy
from edgetp.master.bench.long_prompt import prose_tokens
from edgetp.master.cluster.engine import Engine
from edgetp.master.generation.prompts import open_with_tokenizer
from edgetp.models import block_math
from edgetp.models.config import ModelConfig
from edgetp.models.kernels import set_threads, torch_threads
from edgetp.models.layers import Slice


def prefill_split(model: str | None, n: int) -> tuple[float, float]:
    """(seconds of the whole prefill step, seconds in `_attend`) for an n-token prompt."""
    source, tokenizer = open_with_tokenizer(model)
    engine = Engine.local(source, max_context=n + 2)
    spent = [0.0]
    attend = block_math._attend

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = attend(*args, **kwargs)
        spent[0] += time.perf_counter() - t
        return out

    time_greedy(engine, tokenizer, prose_tokens(tokenizer, 256), 2)  # warm-up
    block_math._attend = timed
    try:
        ttft, _, _ = time_greedy(engine, tokenizer, prose_tokens(tokenizer, n), 2)
    finally:
        block_math._attend = attend
        engine.close()
    return ttft, spent[0]


def attention_forms(config: ModelConfig, n: int) -> None:
    """One layer's attention of n query positions over n keys, each form: seconds, kernel, MB
    allocated."""
    n_heads, n_kv, hd = config.n_heads, config.n_kv_heads, config.head_dim
    every = Slice((0, n_heads), (0, n_kv), (0, 0))
    q = torch.randn(1, n_heads, n, hd)
    k, v = torch.randn(1, n_kv, n, hd), torch.randn(1, n_kv, n, hd)
    mask = torch.arange(n) <= torch.arange(n).unsqueeze(1)  # (T, L), as a continued prompt's
    kv_of_q = torch.arange(n_heads) // (n_heads // n_kv)
    sinks = torch.zeros(n_heads)
    forms = {
        "sdpa is_causal": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
        "sdpa mask (T, L)": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True
        ),
        "sdpa tiles": lambda: block_math._attend_tiles(q, k, v, 0, 0, None, every, config),
        "window 512, one mask": lambda: F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask & (torch.arange(n) > torch.arange(n).unsqueeze(1) - 512),
            enable_gqa=True,
        ),
        "window 512, tiles": lambda: block_math._attend_tiles(q, k, v, 0, 0, 512, every, config),
        "explicit scores (sinks)": lambda: block_math._attend_with_sinks(
            q, k[:, kv_of_q], v[:, kv_of_q], mask, sinks, hd**-0.5
        ),
        "sinks, tiles": lambda: block_math._attend_tiles(q, k, v, 0, 0, None, every, config, sinks),
    }
    scores = n_heads * n * n * 4  # the explicit form's (1, nq, T, L) float32, made ~5 times over
    if 5 * scores > _available_bytes() // 4:  # leave the host's other runs their memory
        del forms["explicit scores (sinks)"]  # (its tiles' scores are tile x n)
        print(f"  explicit scores (sinks): not run, its scores alone {scores / 1e6:.0f} MB")
    reference: dict[str, torch.Tensor] = {}
    for name, run in forms.items():
        run()  # warm-up
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            t = time.perf_counter()
            out = run()
            seconds = time.perf_counter() - t
        kernels = sorted(
            {e.name for e in prof.events() if "attention" in e.name and e.name.startswith("aten")}
        )
        largest, total = _allocated(prof)
        # each form against the first of its kind: causal, a window, or with sinks
        kind = "window" if "window" in name else "sinks" if "sinks" in name else "causal"
        same = torch.allclose(out, reference.setdefault(kind, out), atol=1e-4)
        print(
            f"  {name:<24} {seconds * 1000:9.1f} ms  largest allocation {largest / 1e6:7.1f} MB,"
            f" all {total / 1e6:7.1f} MB  "
            f"same as the first of its kind: {same}  {', '.join(kernels)}"
        )


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
    return kb * 1024


def _allocated(prof: profile) -> tuple[int, int]:
    """(the largest allocation one op made, all the ops' allocations together), in bytes, from
    the profiler's memory figures (it records allocations by op, not their frees)."""
    sizes = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    return max(sizes, default=0), sum(sizes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tokens", type=int, nargs="*", default=[4096, 8192])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    source, _ = open_with_tokenizer(args.model)
    c = source.config
    print(f"{source.path.name}: {c.n_layers} layers, {c.n_heads} query heads over {c.n_kv_heads}")
    for n in args.tokens:
        n = min(n, c.context_length - 2)  # the prompt and the token after it fit the context
        total, attend = prefill_split(args.model, n)
        print(
            f"prefill of {n} tokens: {total:.2f} s ({n / total:.0f} tokens/s), attention's core "
            f"{attend:.2f} s ({attend / total:.0%}), the rest {total - attend:.2f} s"
        )
    for n in args.tokens:
        print(f"one layer's attention over {n} positions ({c.n_heads} heads of {c.head_dim}):")
        with torch_threads(args.threads):  # as a prompt's attention runs (`_attend`)
            attention_forms(c, n)


if __name__ == "__main__":
    main()
