"""`edgetp bench-serve`: aggregate tokens/s of a real `edgetp serve` under concurrent clients.

The server runs as its own process, as people run it; the clients are concurrent streams here,
read by the chat app's reader (server-sent events over HTTP), so the figures include the
bridge. Every request is
greedy and decodes exactly `--tokens` tokens (ignore_eos), so runs compare; each client's text
is checked against the same prompt's text when it ran alone, the batching invariant.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx2 as httpx

from edgetp.master.bridge.client import StreamResult, bridge_http, start_server, timed_chat

PROMPTS = (
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Name three uses of copper.",
    "Explain recursion to a child.",
    "Give me a recipe for pancakes.",
    "What is the capital of Australia?",
    "Tell me a fun fact about octopuses.",
    "How do bees make honey?",
    "What does a compiler do?",
    "Suggest a name for a grey cat.",
    "Why do leaves change colour in autumn?",
    "Describe a sunset in one sentence.",
    "What is the boiling point of water?",
    "How many legs does a spider have?",
    "Give two tips for a job interview.",
)  # 16: `edgetp serve --max-batch 16` full

IGNORE_EOS = {"ignore_eos": True}  # every answer decodes exactly the tokens asked for


async def _measure(
    base: str, clients: Sequence[int], n_tokens: int, rounds: int
) -> tuple[list[StreamResult], dict[int, list[dict[str, Any]]]]:
    """Each prompt alone, then `rounds` rounds of every client count; (solo, runs by count)."""
    runs: dict[int, list[dict[str, Any]]] = {c: [] for c in clients}
    async with bridge_http(base) as http:
        await timed_chat(http, PROMPTS[0], 4, IGNORE_EOS)  # warm-up
        solo = [await timed_chat(http, p, n_tokens, IGNORE_EOS) for p in PROMPTS]
        for _ in range(rounds):  # alternating, so drift on a shared machine hits all alike
            for c in clients:
                sums = await _sums(http)
                wall, results = await _concurrent(http, PROMPTS[:c], n_tokens)
                tokens = sum(r.completion_tokens for r in results)
                sums = await _sums(http) - sums
                runs[c].append(
                    {
                        "tokens": tokens,
                        "seconds": wall,
                        "tokens_per_s": tokens / wall,
                        "sums_per_token": sums / tokens,
                        "ttft_ms_median": statistics.median(r.first_token_s for r in results)
                        * 1000,
                        "identical_to_solo": [
                            r.text == s.text for r, s in zip(results, solo[:c], strict=True)
                        ],
                    }
                )
    return solo, runs


async def _sums(http: httpx.AsyncClient) -> int:
    """The star allreduce's sums so far (none on one node): a step pays one a block whatever
    its batch, so concurrent clients share them."""
    reply = await http.get("/v1/cluster")
    reply.raise_for_status()
    allreduce = reply.json()["allreduce"]
    return allreduce["sums"] if allreduce else 0


async def _concurrent(
    http: httpx.AsyncClient, prompts: Sequence[str], n_tokens: int
) -> tuple[float, list[StreamResult]]:
    """Every prompt streamed by its own client at once; (wall seconds, results in order)."""
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(timed_chat(http, p, n_tokens, IGNORE_EOS) for p in prompts), return_exceptions=True
    )
    wall = time.perf_counter() - t0
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} clients failed, e.g.: {failed[0]}")
    return wall, [r for r in results if isinstance(r, StreamResult)]


def run_serve_bench(
    model: str | None,
    nodes: int,
    clients: Sequence[int],
    n_tokens: int,
    rounds: int,
    context: int | None,
    state_dir: Path | None,
    json_path: str | None,
) -> dict[str, Any]:
    """Aggregate tokens/s for each client count; rounds alternate the counts, medians kept."""
    if n_tokens < 2 or rounds < 1 or not clients or min(clients) < 1:
        raise ValueError(
            "--tokens must be >= 2, --rounds >= 1 and --clients a list of counts like 1,4,8"
        )
    if max(clients) > len(PROMPTS):
        raise ValueError(f"at most {len(PROMPTS)} clients (one distinct prompt each)")
    args = ["--local-nodes", str(nodes), "--max-batch", str(max(clients))]
    args += ["--model", model] if model else []
    args += ["--context", str(context)] if context else []
    args += ["--state-dir", str(state_dir)] if state_dir else []
    server = start_server(args)
    try:
        solo, runs = asyncio.run(_measure(server.base, clients, n_tokens, rounds))
    finally:
        server.stop()
    rows = []
    for c in clients:
        rows.append(
            {
                "clients": c,
                "tokens": runs[c][0]["tokens"],
                "seconds": round(statistics.median(r["seconds"] for r in runs[c]), 3),
                "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs[c]), 1),
                "ttft_ms_median": round(statistics.median(r["ttft_ms_median"] for r in runs[c]), 1),
                "sums_per_token": round(statistics.median(r["sums_per_token"] for r in runs[c]), 1),
                "identical_to_solo": all(all(r["identical_to_solo"]) for r in runs[c]),
                "tokens_per_s_rounds": [round(r["tokens_per_s"], 1) for r in runs[c]],
            }
        )
    base_rate = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_first"] = round(r["tokens_per_s"] / base_rate, 2)
    same = all(r["identical_to_solo"] for r in rows)
    print(
        f"edgetp serve, {nodes} node(s); {n_tokens} greedy tokens per client, streamed over "
        f"SSE; medians of {rounds} rounds"
    )
    vs = f"vs {clients[0]}"
    print(f"{'clients':>7}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{vs:>7}{'TTFT ms':>9}", end="")
    print(f"{'sums/token':>11}  identical to solo")
    for r in rows:
        print(
            f"{r['clients']:>7}{r['tokens']:>8}{r['seconds']:>9}{r['tokens_per_s']:>10}"
            f"{r['vs_first']:>7}{r['ttft_ms_median']:>9}{r['sums_per_token']:>11}"
            f"  {r['identical_to_solo']}"
        )
    ratio = None
    if 1 in clients and 8 in clients:
        one = next(r for r in rows if r["clients"] == 1)["tokens_per_s"]
        eight = next(r for r in rows if r["clients"] == 8)["tokens_per_s"]
        ratio = round(eight / one, 2)
        print(f"aggregate tokens/s, 8 clients / 1 client: {ratio}")
    print(f"every client's greedy output identical to its solo output: {same}")
    report = {
        "model": model,
        "nodes": nodes,
        "tokens_per_client": n_tokens,
        "rounds": rounds,
        "runs": rows,
        "ratio_8_over_1": ratio,
        "identical_to_solo": same,
        "solo_tokens_per_s": [round(s.completion_tokens / s.seconds, 1) for s in solo],
    }
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report
