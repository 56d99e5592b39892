"""`edgetp bench`: edgetp against the transformers implementation of the same weights.

Both run greedy decoding of the same prompt in this process, alternating rounds so drift on a
shared machine hits both alike; the figures kept are medians, and the comparison is their ratio.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from master.generate import start, step
from master.sampling import SamplingParams
from master.session import load, prompt_tokens
from memory.budget import ALL_RESIDENT, MemoryOptions, format_size
from models.errors import ModelError
from models.kernels import set_threads
from models.layers import Slice
from models.source import GGUFSource, ModelSource
from node.kvcache import KVCache

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _time_edgetp(loaded: Any, prompt: list[int], n_tokens: int) -> tuple[float, float, list[int]]:
    return _time_edgetp_engine(loaded.engine, loaded.tokenizer, prompt, n_tokens)


def _time_edgetp_engine(
    engine: Any, tokenizer: Any, prompt: list[int], n_tokens: int
) -> tuple[float, float, list[int]]:
    """(time to first token s, ms per decoded token, tokens) for one greedy run."""
    # No end-of-sequence: every round decodes exactly n_tokens, so the rounds compare.
    params = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    (g,) = start(engine, [prompt], [params])
    t0 = time.perf_counter()
    step(engine, tokenizer, [g])
    t1 = time.perf_counter()
    while not g.finished:
        step(engine, tokenizer, [g])
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) * 1000 / (len(g.tokens) - 1), g.tokens


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
    if n_tokens < 2 or rounds < 1:
        raise ValueError("--tokens must be >= 2 and --rounds >= 1")
    threads = set_threads(threads)
    loaded = load(model, max_context=context)
    prompt = prompt_tokens(loaded.tokenizer, PROMPT, raw=False)
    reference = _reference_model(loaded.source)
    results: dict[str, list[float]] = {
        "edgetp_ms": [],
        "ref_ms": [],
        "edgetp_ttft": [],
        "ref_ttft": [],
    }
    same = True
    _time_edgetp(loaded, prompt, 4)  # warm-up: first calls pay for allocation and dispatch
    _time_reference(reference, prompt, 4, threads)
    for _ in range(rounds):
        ttft, ms, ours = _time_edgetp(loaded, prompt, n_tokens)
        results["edgetp_ttft"].append(ttft)
        results["edgetp_ms"].append(ms)
        ttft, ms, theirs = _time_reference(reference, prompt, n_tokens, threads)
        results["ref_ttft"].append(ttft)
        results["ref_ms"].append(ms)
        same = same and ours == theirs
    med = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "model": str(loaded.source.path),
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
    print(f"model {report['model']}  threads {threads}  prompt {len(prompt)} tokens")
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


def _echo(endpoint: str) -> None:
    """A peer that sends every message straight back (runs in its own process)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(b"hello")  # lets the ROUTER learn this peer's identity
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 1:
            break
        sock.send_multipart(frames, copy=False)
    sock.close(0)
    ctx.term()


def raw_round_trips(shape: tuple[int, ...], n: int) -> list[float]:
    """Seconds per ROUTER->DEALER->ROUTER round trip of a header and an f32 tensor of `shape`,
    to another process on this machine: the floor an allreduce hop pair can reach."""
    import multiprocessing

    import zmq

    from node import protocol as P

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    peer = multiprocessing.get_context("spawn").Process(
        target=_echo, args=(f"tcp://127.0.0.1:{port}",), daemon=True
    )
    peer.start()
    identity = sock.recv_multipart()[0] if sock.poll(30_000) else None
    if identity is None:
        raise RuntimeError("the echo process did not start")
    payload = torch.zeros(shape)
    header = {"op": P.STEP, "step": 0, "layer": 0, "block": P.ATTENTION}
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send_multipart([identity, *P.encode(header, (payload,))], copy=False)
        sock.recv_multipart(copy=False)
        times.append(time.perf_counter() - t0)
    sock.send_multipart([identity, b"stop"])
    peer.join(timeout=5)
    sock.close(0)
    ctx.term()
    return times


def _tcp_echo(port: int) -> None:
    """A peer that sends every byte straight back over a plain TCP socket."""
    import socket

    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := sock.recv(1 << 16):
            sock.sendall(data)


def raw_tcp_round_trips(size: int, n: int) -> list[float]:
    """Seconds per round trip of `size` bytes over a plain TCP socket to another process: what
    the machine's loopback costs without ZeroMQ's I/O threads in the way."""
    import multiprocessing
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        peer = multiprocessing.get_context("spawn").Process(
            target=_tcp_echo, args=(server.getsockname()[1],), daemon=True
        )
        peer.start()
        server.settimeout(30)
        sock, _ = server.accept()
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload, times = bytes(size), []
        for _ in range(n):
            t0 = time.perf_counter()
            sock.sendall(payload)
            got = 0
            while got < size:
                got += len(sock.recv(1 << 16))
            times.append(time.perf_counter() - t0)
    peer.join(timeout=5)
    return times


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_cluster_bench(
    model: str | None,
    node_counts: list[int],
    n_tokens: int,
    json_path: str | None,
    context: int | None,
    state_dir: Path | None,
    memory: MemoryOptions = ALL_RESIDENT,
    rss_tokens: int = 0,
    rounds: int = 3,
) -> dict[str, Any]:
    """ms/token, TTFT, allreduce latency and every node's loader and memory figures, for each
    node count, with a raw ZeroMQ floor.

    Where nodes stream, each node count also gets its overlap: ms/token against the slowest
    node's reads and its compute (waits excluded) per token, both measured in the same run.
    Streaming hides its reads when ms/token is near the larger of the two.
    `rss_tokens` adds a long generation with each node's memory at its first and last token.
    """
    from master.session import open_with_tokenizer

    source, tokenizer = open_with_tokenizer(model)
    prompt = prompt_tokens(tokenizer, PROMPT, raw=False)
    hidden = source.config.hidden
    raw = raw_round_trips((1, 1, hidden), 2000)
    raw_med, raw_p99 = statistics.median(raw) * 1e6, _percentile(raw, 0.99) * 1e6
    tcp_med = statistics.median(raw_tcp_round_trips(hidden * 4, 2000)) * 1e6
    # Node counts alternate for `rounds` rounds and each keeps its median run: these shared
    # machines drift by 20% between minutes, and a ratio of runs taken minutes apart would
    # measure the drift.
    runs: dict[int, list[dict[str, Any]]] = {}
    for _round in range(rounds):
        for nodes in node_counts:
            runs.setdefault(nodes, []).append(
                _cluster_run(source, tokenizer, prompt, nodes, n_tokens, context, state_dir, memory)
            )
    rows = []
    for kept in runs.values():
        ordered = sorted(kept, key=lambda r: r["ms_per_token"])
        median = ordered[len(ordered) // 2]
        median["rounds_ms_per_token"] = [r["ms_per_token"] for r in kept]
        rows.append(median)
    print(f"model {source.path}  prompt {len(prompt)} tokens  {n_tokens} greedy tokens")
    print(f"memory: {_describe(memory)}; medians of {rounds} alternating rounds")
    print(f"raw ZeroMQ round trip, {hidden * 4} B payload: median {raw_med:.0f} us, ", end="")
    print(f"p99 {raw_p99:.0f} us; plain TCP, no ZeroMQ: median {tcp_med:.0f} us")
    base = rows[0]["ms_per_token"]
    title = "allreduce us (med/p99 per sum)"
    print(f"{'nodes':>5}{'ms/token':>9}{'vs first':>9}{'TTFT ms':>9}{title:>33}")
    for r in rows:
        ar = (
            f"{r['allreduce_us_median']:.0f} / {r['allreduce_us_p99']:.0f}"
            if r["allreduce_us_median"] is not None
            else "-"
        )
        print(
            f"{r['nodes']:>5}{r['ms_per_token']:>9}"
            f"{r['ms_per_token'] / base:>9.2f}{r['ttft_ms']:>9}{ar:>33}"
        )
    for r in rows:
        _print_nodes(r)
        _print_overlap(r)
    same = all(  # every round of every node count, not just the medians
        r["tokens"] == rows[0]["tokens"] for kept in runs.values() for r in kept
    )
    print(f"greedy tokens identical across node counts: {same}")
    long_runs = []
    if rss_tokens:
        for nodes in node_counts:
            long_runs.append(
                _rss_run(source, tokenizer, prompt, nodes, rss_tokens, context, state_dir, memory)
            )
    report = {
        "model": str(source.path),
        "tokens": n_tokens,
        "memory": dataclasses.asdict(memory),
        "raw_round_trip_us_median": round(raw_med, 1),
        "raw_round_trip_us_p99": round(raw_p99, 1),
        "raw_tcp_round_trip_us_median": round(tcp_med, 1),
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        "greedy_tokens_identical": same,
        "rss_runs": long_runs,
    }
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _describe(memory: MemoryOptions) -> str:
    budget = format_size(memory.budget) if memory.budget else "none"
    window = memory.window or "from the budget"
    return (
        f"dtype {memory.dtype}, budget {budget}, window {window}, "
        f"page cache {'dropped after each read' if memory.drop_cache else 'kept'}"
    )


def _overlap(ms_per_token: float, per_node: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How well the slowest streaming node hides its reads behind its compute: ms/token over
    the larger of its reads and its compute (waits excluded) per token, from the same run."""
    streaming = [r for r in per_node if r.get("mb_read_per_token")]
    if not streaming:
        return None
    slowest = max(
        streaming, key=lambda r: max(r["load_ms_per_token"], r["own_compute_ms_per_token"])
    )
    load, compute = slowest["load_ms_per_token"], slowest["own_compute_ms_per_token"]
    bound = max(load, compute)
    ratio = round(ms_per_token / bound, 3) if bound else None
    return {"node": slowest["node"], "load_ms": load, "compute_ms": compute, "ratio": ratio}


def _print_overlap(run: dict[str, Any]) -> None:
    o = run["overlap"]
    if o is not None:
        print(
            f"overlap, {run['nodes']} node(s): {run['ms_per_token']} ms/token vs node "
            f"{o['node']}'s reads {o['load_ms']} ms and compute {o['compute_ms']} ms per "
            f"token: ratio {o['ratio']}"
        )


def _cluster_run(
    source: ModelSource,
    tokenizer: Any,
    prompt: list[int],
    nodes: int,
    n_tokens: int,
    context: int | None,
    state_dir: Path | None,
    memory: MemoryOptions,
) -> dict[str, Any]:
    from master.local import local_engine

    with local_engine(source, nodes, state_dir=state_dir, context=context, memory=memory) as engine:
        _time_edgetp_engine(engine, tokenizer, prompt, 4)  # warm-up
        members = _clear_figures(engine)
        ttft, ms, tokens = _time_edgetp_engine(engine, tokenizer, prompt, n_tokens)
        sums = engine.remote.allreduce_seconds if engine.remote else []
        per_node = [_node_row("master", engine.history)] + [
            _node_row(m.name, m.history) for m in members
        ]
        engine.close()
    return {
        "nodes": nodes,
        "ms_per_token": round(ms, 2),
        "ttft_ms": round(ttft * 1000, 1),
        "tokens": tokens,
        "allreduce_us_median": round(statistics.median(sums) * 1e6, 1) if sums else None,
        "allreduce_us_p99": round(_percentile(sums, 0.99) * 1e6, 1) if sums else None,
        "per_node": per_node,
        "overlap": _overlap(round(ms, 2), per_node),
    }


def _clear_figures(engine: Any) -> list[Any]:
    members = list(engine.remote.members) if engine.remote else []
    if engine.remote:
        engine.remote.allreduce_seconds.clear()
    engine.history.clear()
    for m in members:
        m.history.clear()
    return members


def _node_row(name: str, history: Any) -> dict[str, Any]:
    """A node's loader and memory figures, averaged over the decode steps (one token each)."""
    steps = list(history)[1:]  # the first step is the prompt's
    if not steps:
        return {"node": name}
    n = len(steps)
    return {
        "node": name,
        "window": steps[-1].get("window"),
        "mb_read_per_token": round(sum(s["bytes_read"] for s in steps) / n / 1e6, 2),
        "load_ms_per_token": round(sum(s["load_s"] for s in steps) / n * 1000, 2),
        "wait_ms_per_token": round(sum(s["wait_s"] for s in steps) / n * 1000, 2),
        "compute_ms_per_token": round(sum(s["compute_s"] for s in steps) / n * 1000, 2),
        "own_compute_ms_per_token": round(
            sum(s["compute_s"] - s["wait_s"] for s in steps) / n * 1000, 2
        ),
        "buffer_mb": round(steps[-1]["buffer_bytes"] / 1e6, 1),
        "rss_mb": round(steps[-1]["rss"] / 1e6, 1),
        "peak_rss_mb": round(max(s["peak_rss"] for s in steps) / 1e6, 1),
    }


def _print_nodes(run: dict[str, Any]) -> None:
    print(f"per node, {run['nodes']} node(s), averaged per decoded token:")
    print(
        f"  {'node':<10}{'window':>7}{'MB read':>9}{'load ms':>9}{'wait ms':>9}"
        f"{'buffers MB':>11}{'RSS MB':>9}{'peak RSS MB':>12}"
    )
    for r in run["per_node"]:
        if "window" not in r:
            continue
        print(
            f"  {r['node']:<10}{r['window']:>7}{r['mb_read_per_token']:>9}"
            f"{r['load_ms_per_token']:>9}{r['wait_ms_per_token']:>9}{r['buffer_mb']:>11}"
            f"{r['rss_mb']:>9}{r['peak_rss_mb']:>12}"
        )


def _rss_run(
    source: ModelSource,
    tokenizer: Any,
    prompt: list[int],
    nodes: int,
    n_tokens: int,
    context: int | None,
    state_dir: Path | None,
    memory: MemoryOptions,
) -> dict[str, Any]:
    """Each node's RSS after the first decoded token and after the last, with the KV cache
    written meanwhile: streaming must not grow memory beyond the cache."""
    from master.local import local_engine

    with local_engine(source, nodes, state_dir=state_dir, context=context, memory=memory) as engine:
        members = _clear_figures(engine)
        _time_edgetp_engine(engine, tokenizer, prompt, n_tokens)
        histories = [("master", engine.history)] + [(m.name, m.history) for m in members]
        slices = [engine.slices[0], *(Slice.from_dict(m.slice) for m in members)]
        kv_per_token = [KVCache.bytes_per_token(engine.config, s, torch.float32) for s in slices]
        engine.close()
    print(f"memory over {n_tokens} tokens, {nodes} node(s):")
    print(
        f"  {'node':<10}{'RSS tok 1 MB':>13}{'RSS tok N MB':>13}{'growth MB':>10}"
        f"{'KV written MB':>14}{'peak MB':>9}"
    )
    out = []
    for (name, history), kv in zip(histories, kv_per_token, strict=True):
        steps = list(history)
        first, last = steps[1], steps[-1]
        row = {
            "node": name,
            "rss_first_mb": round(first["rss"] / 1e6, 1),
            "rss_last_mb": round(last["rss"] / 1e6, 1),
            "growth_mb": round((last["rss"] - first["rss"]) / 1e6, 1),
            "kv_written_mb": round(kv * (len(steps) - 2) / 1e6, 1),
            "peak_rss_mb": round(max(s["peak_rss"] for s in steps) / 1e6, 1),
        }
        out.append(row)
        print(
            f"  {name:<10}{row['rss_first_mb']:>13}{row['rss_last_mb']:>13}"
            f"{row['growth_mb']:>10}{row['kv_written_mb']:>14}{row['peak_rss_mb']:>9}"
        )
    return {"nodes": nodes, "tokens": n_tokens, "per_node": out}
