"""The key each API's clients send: OpenAI's and Ollama's as `Authorization: Bearer KEY`,
Anthropic's as `x-api-key: KEY` (its SDK's `auth_token` sends a Bearer, which is taken too)."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Depends, Request

from edgetp.master.bridge.errors import APIError


def _bearer(request: Request) -> str:
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else ""


def guard(api_key: str | None, x_api_key: bool = False) -> list[Any]:
    """The route dependencies that require `api_key` (none without one): as a Bearer, or also
    as `x-api-key` where `x_api_key`."""
    if not api_key:
        return []
    expected = api_key.encode()
    said = "'x-api-key: KEY'" if x_api_key else "'Authorization: Bearer KEY'"

    async def check(request: Request) -> None:
        given = [_bearer(request)]
        if x_api_key:
            given.append(request.headers.get("x-api-key", ""))
        if not any(hmac.compare_digest(g.encode(), expected) for g in given if g):
            raise APIError(
                401,
                f"missing or wrong API key: send the key given to `edgetp serve --api-key` as "
                f"the header {said}",
                type="authentication_error",
                code="invalid_api_key",
            )

    return [Depends(check)]
