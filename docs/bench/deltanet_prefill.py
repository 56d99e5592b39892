"""A gated DeltaNet layer's prompt, token by token against in chunks (models/deltanet.py), on
one device that holds the whole layer of Qwen3.5-35B-A3B's shape (32 value heads of 128, 16 key
heads, hidden 2048), random float32 weights, same inputs, alternating rounds, medians:

    .venv/bin/python docs/bench/deltanet_prefill.py [--tokens 1024] [--rounds 3] [--threads 2]
        [--model DIR [--dtype q4_0]]

Prints the delta rule alone (`by_token` against `chunked`) at a few step lengths, then the whole
layer (`deltanet_partial`: projections, convolution, rule, gated norm, out-projection) for a
TOKENS-token prompt, its rule as before (token by token) and as now (chunked). With --model (e.g.
`edgetp synth --shape qwen3.5-35b-a3b --layers 4`), also the whole model's time to first token
for a prompt of TOKENS random tokens, one node in this process, shards at --dtype under
$EDGETP_HOME (as `edgetp bench --local-nodes 1` splits them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from edgetp.master.bench.synth_models import SHAPES
from edgetp.models import deltanet
from edgetp.models.config_files import config_from_hf
from edgetp.models.layers import Slice, StepBatch


def timed(rounds: int, runs: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each run's median seconds, the runs alternating within each round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="q4_0")
    args = parser.parse_args()
    tokens, rounds, threads = args.tokens, args.rounds, args.threads
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = config_from_hf(SHAPES["qwen3.5-35b-a3b"], "qwen3.5-35b-a3b")
    nv, nk, dk, dv = (
        config.linear_v_heads,
        config.linear_k_heads,
        config.linear_k_dim,
        config.linear_v_dim,
    )
    s = Slice((0, 0), (0, 0), (0, 0), linear_heads=(0, nv), linear_key_heads=(0, nk))
    print(f"{nv} value heads, dk {dk}, dv {dv}, {threads} threads, {rounds} rounds, medians")

    print("the delta rule alone, ms a step (tokens/s):")
    for T in (1, 2, 4, 16, tokens):
        q = F.normalize(torch.randn(T, nv, dk), dim=-1) * dk**-0.5
        k = F.normalize(torch.randn(T, nv, dk), dim=-1)
        v, beta, g = torch.randn(T, nv, dv), torch.rand(T, nv), -torch.rand(T, nv)
        rules = {"by_token": deltanet.by_token, "chunked": deltanet.chunked}
        # each rule carries its own state on from round to round: the time is the same
        runs = {n: partial(r, q, k, v, beta, g, torch.zeros(nv, dk, dv)) for n, r in rules.items()}
        with torch.inference_mode():
            got = timed(rounds, runs)
        line = ", ".join(f"{n} {t * 1e3:.1f} ({T / t:.0f})" for n, t in got.items())
        print(f"  {T:5d} tokens: {line}; chunked {got['by_token'] / got['chunked']:.1f}x")

    C = sum(deltanet.channels(config, s))
    D, K = config.hidden, config.linear_conv
    w = {
        "attn_norm": torch.ones(D),
        "wqkv": torch.randn(C + nv * dv + 2 * nv, D) * D**-0.5,
        "decay": -torch.rand(nv) * 8,
        "dt": torch.randn(nv),
        "conv": torch.randn(C, K) * 0.5,
        "ssm_norm": torch.ones(dv),
        "wo": torch.randn(D, nv * dv) * (nv * dv) ** -0.5,
    }
    h = torch.randn(1, tokens, D)
    batch = StepBatch((0,), (0,), (tokens,))

    def layer() -> None:
        conv, states = torch.zeros(1, C, K - 1), torch.zeros(1, nv, dk, dv)
        deltanet.deltanet_partial(h, w, s, config, conv, states, batch)

    with torch.inference_mode():
        got = timed(rounds, {"before (token by token)": as_before(layer), "now (chunked)": layer})
    print(f"the whole layer, a {tokens}-token prompt:")
    report(got, tokens)
    if args.model:
        model_prefill(args.model, args.dtype, tokens, rounds, threads)


def as_before(run: Callable[[], object]) -> Callable[[], None]:
    """`run` with a prompt's delta rule token by token, as `recur` ran it before chunks."""

    def before() -> None:
        chunked = deltanet.chunked
        deltanet.chunked = deltanet.by_token
        try:
            run()
        finally:
            deltanet.chunked = chunked

    return before


def report(got: dict[str, float], tokens: int) -> None:
    for name, t in got.items():
        print(f"  {name}: {t * 1e3:.0f} ms, {tokens / t:.0f} tokens/s")
    old, new = got.values()
    print(f"  chunked {old / new:.2f}x")


def model_prefill(model: str, dtype: str, tokens: int, rounds: int, threads: int) -> None:
    from edgetp.master.bench.greedy import time_greedy
    from edgetp.master.cluster.local import local_session
    from edgetp.memory.budget import MemoryOptions
    from edgetp.models.source import open_model

    source = open_model(model)
    tokenizer = source.tokenizer()
    prompt = torch.randint(0, source.config.vocab_size, (tokens,)).tolist()
    memory = MemoryOptions(dtype=dtype)
    with local_session(source, 1, threads=threads, context=tokens + 8, memory=memory) as session:
        engine = session.engine
        assert engine is not None

        def first_token() -> None:
            time_greedy(engine, tokenizer, prompt, 2)  # its first token timed

        first_token()  # warm-up
        got = timed(rounds, {"before (token by token)": as_before(first_token),
                             "now (chunked)": first_token})  # fmt: skip
    print(f"{model} ({dtype}, {source.config.n_layers} layers), time to first token, "
          f"a {tokens}-token prompt:")  # fmt: skip
    report(got, tokens)


if __name__ == "__main__":
    main()
