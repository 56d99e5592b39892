"""The chat app's link to a master: its REST bridge, over real HTTP.

`BridgeClient` speaks the bridge's OpenAI-compatible API: a streamed chat completion (read by
`master.bridge.client.read_chat_stream`) and the live figures at /v1/cluster. A local bridge is
started with `master.bridge.client.start_server`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx

from edgetp.master.bridge.client import (
    BridgeError,
    Reasoning,
    StreamEnd,
    bridge_http,
    http_failure,
    read_chat_stream,
    response_error,
)
from edgetp.master.bridge.schema import ClusterFigures
from edgetp.master.generation.params import TEMPERATURE_MAX


@dataclass(frozen=True)
class Sampling:
    """The sampling settings the app sends with every request."""

    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 512

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= TEMPERATURE_MAX:
            raise ValueError(
                f"temperature must be in 0..{TEMPERATURE_MAX:g}, got {self.temperature}"
            )
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


class BridgeClient:
    """An async client of one REST bridge (`edgetp serve`) at `base_url` (no /v1)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self._api_key = api_key
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop its connections are on

    def _client(self) -> httpx.AsyncClient:
        # Made on first use, so it belongs to the event loop that runs the app. Its connections
        # are that loop's: a later loop (the app run again) gets a client of its own.
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            self._http = bridge_http(self.base_url, self._api_key, transport=self._transport)
            self._loop = loop
        return self._http

    async def aclose(self) -> None:
        """Close the connections. Those of a loop that has ended went with it: closing them
        from another loop would schedule work on the ended one."""
        http, self._http = self._http, None
        if http is not None and self._loop is asyncio.get_running_loop():
            await http.aclose()

    async def _get(self, path: str) -> Any:
        try:
            resp = await self._client().get(path, timeout=httpx.Timeout(10.0, connect=5.0))
        except httpx.HTTPError as exc:
            raise BridgeError(
                f"cannot reach the bridge at {self.base_url}: {http_failure(exc)}"
            ) from exc
        if resp.status_code != 200:
            raise response_error(resp.status_code, resp.content)
        return resp.json()

    async def model(self) -> str:
        """The id of the model the bridge serves."""
        return str((await self._get("/v1/models"))["data"][0]["id"])

    async def cluster(self) -> ClusterFigures:
        """The nodes and their live figures."""
        return ClusterFigures.model_validate(await self._get("/v1/cluster"))

    def stream_chat(
        self, messages: Sequence[dict[str, str]], sampling: Sampling
    ) -> AsyncIterator[str | Reasoning | StreamEnd]:
        """The answer to `messages`, piece by piece (a thinking model's reasoning first, as
        `Reasoning` pieces), then one `StreamEnd`.

        The bridge renders the whole list with the model's chat template. Raises BridgeError
        when the request is refused or generation fails; closing the iterator early (the app's
        Stop) closes the connection, which makes the bridge drop the request.
        """
        body = {"messages": list(messages), **sampling.to_dict()}
        return read_chat_stream(self._client(), body)


def check_bridge(base_url: str, api_key: str | None) -> None:
    """Fail (BridgeError) if the bridge cannot be reached or refuses the key."""
    url = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise BridgeError(f"cannot reach edgetp serve at {url}: {http_failure(exc)}") from exc
    if resp.status_code != 200:
        error = response_error(resp.status_code, resp.content)
        raise BridgeError(f"edgetp serve at {url} refused: {error}", error.code)
