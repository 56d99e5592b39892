"""`edgetp bench-serve`: aggregate tokens/s of a real `edgetp serve` under concurrent clients.

The server runs as its own process, as people run it; clients are threads here speaking plain
HTTP with streaming (server-sent events), so the figures include the bridge. Every request is
greedy and decodes exactly `--tokens` tokens (ignore_eos), so runs compare; each client's text
is checked against the same prompt's text when it ran alone, the batching invariant.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPTS = (
    "Why is the sky blue?",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Name three uses of copper.",
    "Explain recursion to a child.",
    "Give me a recipe for pancakes.",
    "What is the capital of Australia?",
    "Tell me a fun fact about octopuses.",
)

READY = re.compile(r"OpenAI API at (http://\S+)/v1")


@dataclass
class StreamResult:
    text: str
    completion_tokens: int
    first_token_s: float  # from sending the request
    seconds: float
    lines: list[tuple[float, str]]  # (arrival time, SSE line) as they came


def stream_chat(
    base: str,
    prompt: str,
    max_tokens: int,
    api_key: str | None = None,
    timeout: float = 300.0,
    extra: dict[str, Any] | None = None,
) -> StreamResult:
    """One greedy streaming chat completion over plain HTTP, read line by line."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read().decode(errors='replace')}")
        text, tokens, first, lines = [], 0, 0.0, []
        for raw in resp:
            line = raw.decode().rstrip("\n")
            lines.append((time.perf_counter() - t0, line))
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content")
                if piece:
                    first = first or time.perf_counter() - t0
                    text.append(piece)
        return StreamResult("".join(text), tokens, first, time.perf_counter() - t0, lines)
    finally:
        conn.close()


@dataclass
class ServerProcess:
    """A running `edgetp serve`: its process, base URL and the stderr lines so far."""

    proc: subprocess.Popen
    base: str
    log: list[str]

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    def stop(self, timeout: float = 20.0) -> int:
        """Ctrl-C, as a person would; killed if it does not exit within `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    args: Sequence[str], verbose: bool = False, timeout: float = 300.0
) -> ServerProcess:
    """`edgetp serve ARGS --port 0` as a process, returned once it listens."""
    exe = Path(sys.executable).parent / "edgetp"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tui.cli"]
    proc = subprocess.Popen(
        [*cmd, *(["-v"] if verbose else []), "serve", "--port", "0", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    found: list[str] = []
    seen: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            m = READY.search(line)
            if m and not found:
                found.append(m.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found:
        if proc.poll() is not None or time.monotonic() > deadline:
            ServerProcess(proc, "", seen).stop()
            raise RuntimeError("edgetp serve did not start:\n" + "".join(seen[-20:]))
        time.sleep(0.05)
    return ServerProcess(proc, found[0], seen)


def _concurrent(base: str, prompts: Sequence[str], n_tokens: int) -> tuple[float, list[Any]]:
    """Every prompt streamed by its own client at once; (wall seconds, results in order)."""
    results: list[Any] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts) + 1)

    def client(i: int) -> None:
        barrier.wait()
        try:
            results[i] = stream_chat(base, prompts[i], n_tokens, extra={"ignore_eos": True})
        except Exception as exc:  # reported below, with the others' figures
            results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} clients failed, e.g.: {failed[0]}")
    return wall, results


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
    base = server.base
    runs: dict[int, list[dict[str, Any]]] = {c: [] for c in clients}
    try:
        stream_chat(base, PROMPTS[0], 4, extra={"ignore_eos": True})  # warm-up
        solo = [stream_chat(base, p, n_tokens, extra={"ignore_eos": True}) for p in PROMPTS]
        for _ in range(rounds):  # alternating, so drift on a shared machine hits all alike
            for c in clients:
                wall, results = _concurrent(base, PROMPTS[:c], n_tokens)
                tokens = sum(r.completion_tokens for r in results)
                runs[c].append(
                    {
                        "tokens": tokens,
                        "seconds": wall,
                        "tokens_per_s": tokens / wall,
                        "ttft_ms_median": statistics.median(r.first_token_s for r in results)
                        * 1000,
                        "identical_to_solo": [
                            r.text == s.text for r, s in zip(results, solo[:c], strict=True)
                        ],
                    }
                )
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
    print("  identical to solo")
    for r in rows:
        print(
            f"{r['clients']:>7}{r['tokens']:>8}{r['seconds']:>9}{r['tokens_per_s']:>10}"
            f"{r['vs_first']:>7}{r['ttft_ms_median']:>9}  {r['identical_to_solo']}"
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
