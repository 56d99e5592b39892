"""The chat app's link to a master: its REST bridge, over real HTTP.

`BridgeClient` speaks the bridge's OpenAI-compatible API: a streamed chat completion read as
server-sent events, and the live figures at /v1/cluster. `LocalBridge` starts `edgetp serve` as
a child process on a free port for the app to talk to, and stops it when the app closes.
"""

from __future__ import annotations

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

from master.bridge.schema import ClusterFigures

log = logging.getLogger(__name__)

READY = re.compile(r"OpenAI API at (http://\S+)/v1")
CONNECT_S = 5.0  # to open a connection to the bridge
READ_S = 300.0  # between two pieces of a stream: a long prefill on a slow cluster
STDERR_LINES = 40  # of a local bridge's stderr, kept for error messages


class BridgeError(Exception):
    """The bridge refused a request, failed mid-answer, or could not be reached."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code  # the bridge's error code (e.g. "cluster_down"), if it sent one


@dataclass(frozen=True)
class Sampling:
    """The sampling settings the app sends with every request."""

    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 512

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in 0..2, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max tokens must be at least 1, got {self.max_tokens}")

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sampling:
        unknown = set(data) - {"temperature", "top_p", "max_tokens"}
        if unknown:
            raise ValueError(f"unknown sampling settings: {', '.join(sorted(unknown))}")
        return cls(**data)


@dataclass(frozen=True)
class Finished:
    """The last event of a streamed answer."""

    finish_reason: str  # "stop" | "length"
    completion_tokens: int | None


class BridgeClient:
    """An async client of one REST bridge (`edgetp serve`) at `base_url` (no /v1)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._http: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        # Made on first use, so it belongs to the event loop that runs the app.
        if self._http is None:
            self._http = httpx.AsyncClient(
                base_url=self.base_url,
                headers=self._headers,
                timeout=httpx.Timeout(READ_S, connect=CONNECT_S),
                transport=self._transport,
            )
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _get(self, path: str) -> Any:
        try:
            resp = await self._client().get(path, timeout=httpx.Timeout(10.0, connect=CONNECT_S))
        except httpx.HTTPError as exc:
            raise BridgeError(f"cannot reach the bridge at {self.base_url}: {_why(exc)}") from exc
        if resp.status_code != 200:
            raise BridgeError(*_error(resp.status_code, resp.content))
        return resp.json()

    async def model(self) -> str:
        """The id of the model the bridge serves."""
        return str((await self._get("/v1/models"))["data"][0]["id"])

    async def cluster(self) -> ClusterFigures:
        """The nodes and their live figures."""
        return ClusterFigures.model_validate(await self._get("/v1/cluster"))

    async def stream_chat(
        self, messages: Sequence[dict[str, str]], sampling: Sampling
    ) -> AsyncIterator[str | Finished]:
        """The answer to `messages`, piece by piece, then one `Finished`.

        The bridge renders the whole list with the model's chat template. Raises BridgeError
        when the request is refused or generation fails; closing the iterator early (the app's
        Stop) closes the connection, which makes the bridge drop the request.
        """
        body = {
            "messages": list(messages),
            **sampling.to_dict(),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        finish: str | None = None
        tokens: int | None = None
        try:
            async with self._client().stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise BridgeError(*_error(resp.status_code, await resp.aread()))
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        yield Finished(finish or "stop", tokens)
                        return
                    try:
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = chunk["error"]
                            raise BridgeError(error["message"], error.get("code"))
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                        choices = [
                            (c["delta"].get("content"), c.get("finish_reason"))
                            for c in chunk["choices"]
                        ]
                    except (ValueError, KeyError, TypeError, AttributeError) as exc:
                        raise BridgeError(
                            f"{self.base_url} sent an event that is not an OpenAI chat chunk "
                            f"({type(exc).__name__}: {exc}): {line[:120]!r}"
                        ) from exc
                    for piece, reason in choices:
                        if piece:
                            yield piece
                        finish = reason or finish
        except httpx.HTTPError as exc:
            raise BridgeError(f"lost the bridge at {self.base_url}: {_why(exc)}") from exc
        raise BridgeError("the bridge closed the stream before the answer ended")


def _why(exc: httpx.HTTPError) -> str:
    return str(exc) or type(exc).__name__


def _error(status: int, content: bytes) -> tuple[str, str | None]:
    """The message and code of an OpenAI-shaped error body, else the status and body's start."""
    try:
        error = json.loads(content)["error"]
        return f"{error['message']} (HTTP {status})", error.get("code")
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {content[:200].decode(errors='replace')}", None


def check_bridge(base_url: str, api_key: str | None) -> None:
    """Fail (BridgeError) if the bridge cannot be reached or refuses the key."""
    url = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise BridgeError(f"cannot reach edgetp serve at {url}: {_why(exc)}") from exc
    if resp.status_code != 200:
        message, code = _error(resp.status_code, resp.content)
        raise BridgeError(f"edgetp serve at {url} refused: {message}", code)


class LocalBridge:
    """`edgetp serve` as a child process on a free port, for as long as the app runs.

    Its stderr is read on a thread (the app owns the terminal); the last lines go into the
    error raised when it fails to start, and are kept for the app to show later.
    """

    def __init__(self, serve_args: Sequence[str], verbose: bool = False) -> None:
        self.args = [*(["-v"] if verbose else []), "serve", "--port", "0", *serve_args]
        self.log: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self.proc: subprocess.Popen[str] | None = None
        self.base_url = ""
        self._found = threading.Event()

    def start(self, timeout: float = 600.0) -> str:
        """Start it and return its base URL once /health answers; BridgeError if it fails."""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tui.cli", *self.args],
            stdin=subprocess.DEVNULL,  # the app owns the terminal
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ,
        )
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._found.wait(0.05):
            if self.proc.poll() is not None:
                self._failed(f"exited with code {self.proc.returncode}")
            if time.monotonic() > deadline:
                self._failed(f"did not start within {timeout:.0f} s")
        while not self._healthy():
            if self.proc.poll() is not None:
                self._failed(f"exited with code {self.proc.returncode}")
            if time.monotonic() > deadline:
                self._failed(f"did not answer /health within {timeout:.0f} s")
            time.sleep(0.05)
        return self.base_url

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.log.append(line.rstrip("\n"))
            m = READY.search(line)
            if m and not self._found.is_set():
                self.base_url = m.group(1)
                self._found.set()

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _failed(self, what: str) -> None:
        self.stop()
        time.sleep(0.1)  # let the reader take the last lines
        tail = "\n".join(self.log) or "(it printed nothing)"
        raise BridgeError(f"the local cluster (edgetp serve) {what}; its output:\n{tail}")

    def stop(self, timeout: float = 20.0) -> None:
        """Ctrl-C, as a person would (it stops its workers); killed after `timeout`."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("edgetp serve did not stop within %.0f s: killing it", timeout)
            proc.kill()
            proc.wait()

    def __enter__(self) -> LocalBridge:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
