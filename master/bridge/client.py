"""The client side of the REST bridge: start `edgetp serve` on this machine, and read a streamed
chat completion.

The chat app, the bridge benchmark and the tests all start their local bridge with
`start_server` and read server-sent events with `read_chat_stream`, so what they measure and
what people see come from the same code. Nothing here imports torch: the chat app loads this.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx

log = logging.getLogger(__name__)

READY = re.compile(r"OpenAI API at (http://\S+)/v1")  # the line `edgetp serve` prints when up
# Lines of a local server's stderr kept: enough for a test to find one request's log line
# after a few hundred requests, bounded for a chat left open for days.
LOG_LINES = 10_000
ERROR_LINES = 40  # of those, shown when the server fails to start


class BridgeError(Exception):
    """The bridge refused a request, failed mid-answer, or could not be reached or started."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code  # the bridge's error code (e.g. "cluster_down"), if it sent one


def http_failure(exc: httpx.HTTPError) -> str:
    """What went wrong in words: some httpx errors carry no message."""
    return str(exc) or type(exc).__name__


def response_error(status: int, content: bytes) -> BridgeError:
    """The error of a refused request: its OpenAI-shaped body's message and code, else the
    status and the start of the body."""
    try:
        error = json.loads(content)["error"]
        return BridgeError(f"{error['message']} (HTTP {status})", error.get("code"))
    except (ValueError, KeyError, TypeError):
        return BridgeError(f"HTTP {status}: {content[:200].decode(errors='replace')}")


@dataclass(frozen=True)
class Reasoning:
    """A piece of a thinking model's reasoning, streamed apart from its answer (the bridge's
    `delta.reasoning_content`, as vLLM and DeepSeek send it)."""

    text: str


@dataclass(frozen=True)
class StreamEnd:
    """The last event of a streamed answer: why it ended, and its length if the bridge said."""

    finish_reason: str  # "stop" | "length"
    completion_tokens: int | None


async def read_chat_stream(
    http: httpx.AsyncClient, body: dict[str, Any]
) -> AsyncIterator[str | Reasoning | StreamEnd]:
    """POST `body` to `http`'s /v1/chat/completions, streamed; yield the answer's text piece by
    piece (a thinking model's reasoning as `Reasoning` pieces), then one `StreamEnd`.

    Raises BridgeError when the request is refused, generation fails, or the stream is cut.
    Closing the iterator early closes the connection, which makes the bridge drop the request.
    """
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    finish: str | None = None
    tokens: int | None = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise response_error(resp.status_code, await resp.aread())
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    yield StreamEnd(finish or "stop", tokens)
                    return
                try:
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = chunk["error"]
                        raise BridgeError(error["message"], error.get("code"))
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    choices = [
                        (
                            c["delta"].get("reasoning_content"),
                            c["delta"].get("content"),
                            c.get("finish_reason"),
                        )
                        for c in chunk["choices"]
                    ]
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    raise BridgeError(
                        f"{http.base_url} sent an event that is not an OpenAI chat chunk "
                        f"({type(exc).__name__}: {exc}): {line[:120]!r}"
                    ) from exc
                for thought, piece, reason in choices:
                    if thought:
                        yield Reasoning(thought)
                    if piece:
                        yield piece
                    finish = reason or finish
    except httpx.HTTPError as exc:
        raise BridgeError(f"lost the bridge at {http.base_url}: {http_failure(exc)}") from exc
    raise BridgeError("the bridge closed the stream before the answer ended")


def bridge_http(
    base: str,
    api_key: str | None = None,
    timeout: float = 300.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """An async HTTP client of the bridge at `base` (no /v1). `timeout` is the longest wait
    between two pieces of a stream: a long prefill on a slow cluster."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base,
        headers=headers,
        timeout=httpx.Timeout(timeout, connect=5.0),
        transport=transport,
    )


@dataclass(frozen=True)
class StreamResult:
    """One streamed answer (its reasoning left out), timed from sending the request."""

    text: str
    completion_tokens: int
    first_token_s: float
    seconds: float


async def timed_chat(
    http: httpx.AsyncClient, prompt: str, max_tokens: int, extra: dict[str, Any] | None = None
) -> StreamResult:
    """One greedy streamed chat completion of `prompt`, with its timings."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **(extra or {}),
    }
    pieces: list[str] = []
    tokens, first = 0, 0.0
    t0 = time.perf_counter()
    async for event in read_chat_stream(http, body):
        if isinstance(event, StreamEnd):
            tokens = event.completion_tokens or 0
            continue
        first = first or time.perf_counter() - t0  # a token of reasoning is a token too
        if isinstance(event, str):
            pieces.append(event)
    return StreamResult("".join(pieces), tokens, first, time.perf_counter() - t0)


def stream_chat(
    base: str,
    prompt: str,
    max_tokens: int,
    api_key: str | None = None,
    timeout: float = 300.0,
    extra: dict[str, Any] | None = None,
) -> StreamResult:
    """`timed_chat` for a caller without an event loop (a test's thread)."""

    async def chat() -> StreamResult:
        async with bridge_http(base, api_key, timeout) as http:
            return await timed_chat(http, prompt, max_tokens, extra)

    return asyncio.run(chat())


class ServerProcess:
    """A running `edgetp serve`, a child process of this one: its process, base URL (no /v1)
    and the lines of its stderr so far (read on a thread: the caller may own the terminal)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.base = ""
        self.log: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self._ready = threading.Event()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line.rstrip("\n"))
            m = READY.search(line)
            if m and not self._ready.is_set():
                self.base = m.group(1)
                self._ready.set()

    def _wait_until_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not (self._ready.is_set() and self._healthy()):
            if self.proc.poll() is not None:
                self._failed(f"exited with code {self.proc.returncode}")
            if time.monotonic() > deadline:
                self._failed(f"did not answer /health within {timeout:.0f} s")
            time.sleep(0.05)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _failed(self, what: str) -> None:
        self.stop()
        time.sleep(0.1)  # let the reader take the last lines
        tail = "\n".join(list(self.log)[-ERROR_LINES:]) or "(it printed nothing)"
        raise BridgeError(f"edgetp serve {what}; its output:\n{tail}")

    def stop(self, timeout: float = 20.0) -> None:
        """Ctrl-C, as a person would (it stops its workers); killed after `timeout`. Safe to
        call twice."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("edgetp serve did not stop within %.0f s: killing it", timeout)
            self.proc.kill()
            self.proc.wait()


def start_server(
    serve_args: Sequence[str], verbose: bool = False, timeout: float = 600.0
) -> ServerProcess:
    """`edgetp serve SERVE_ARGS --port 0` as a child process, returned once /health answers.

    BridgeError, with the server's last lines, if it exits or is not up within `timeout` s.
    """
    args = [*(["-v"] if verbose else []), "serve", "--port", "0", *serve_args]
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgetp.tui.cli", *args],  # the `edgetp` console script's module
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    server = ServerProcess(proc)
    try:
        server._wait_until_up(timeout)
    except BaseException:  # Ctrl-C while it starts too: no server is left behind
        server.stop()
        raise
    return server
