"""The REST bridge's errors: one `APIError` whatever the API, sent in the shape of the API the
request came by: OpenAI's `{"error": {"message", "type", "param", "code"}}` (chat completions,
completions, Responses), Anthropic's `{"type": "error", "error": {"type", "message"}}` (under
/v1/messages), Ollama's `{"error": "message"}` (under /api/).

Every failure ends here as one such body with a message that says what to change: a request the
schema refuses, a request the handlers refuse, a generation that failed, or a bug.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgetp.master.bridge.request import REQUESTS, declared, narrowed
from edgetp.master.bridge.schema import ErrorBody, ErrorResponse
from edgetp.master.cluster.transport import ClusterError
from edgetp.master.generation.batcher import Failed, NodeLost, ShuttingDown

log = logging.getLogger(__name__)

_STATUS_WORDS = {
    400: "the request is invalid; the message says what to change",
    401: "missing or wrong API key",
    404: "no such model",
    429: "every slot is busy and the waiting line is full",
    503: "the cluster is down or the server is shutting down",
}


class APIError(Exception):
    """An error to send in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(
            error=ErrorBody(message=message, type=type, param=param, code=code)
        )

    def response(self, path: str = "") -> JSONResponse:
        """The error in the shape of the API that `path` belongs to."""
        return JSONResponse(self.shaped(path), status_code=self.status)

    def shaped(self, path: str = "") -> dict[str, Any]:
        error = self.body.error
        if path.startswith("/v1/messages"):
            kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": error.message}}
        if path.startswith("/api/"):
            return {"error": error.message}
        return self.body.model_dump()


# Anthropic's error types by status (its errors page).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
# The request models of routes other than request.py's, for what a 400 says of a field.
ROUTE_REQUESTS: dict[str, type[BaseModel]] = {}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` entries for these error statuses."""
    return {s: {"model": ErrorResponse, "description": _STATUS_WORDS[s]} for s in statuses}


def install_handlers(app: FastAPI) -> None:
    """Answer every error, FastAPI's own included, in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        path = request.url.path
        model = REQUESTS.get(path) or ROUTE_REQUESTS.get(path)
        return validation_error(exc.errors(), model, exc.body).response(path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 400:  # FastAPI could not read the body at all (not UTF-8 JSON)
            message = "the request body is not UTF-8 JSON: send one JSON object"
            return APIError(400, message, code="invalid_json").response(path)
        kind = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=kind).response(path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        error = APIError(500, f"internal error: {exc}", type="server_error")
        return error.response(request.url.path)


def failure(event: Failed) -> APIError:
    """The error for a generation that failed."""
    if isinstance(event.error, ShuttingDown):
        return APIError(503, str(event.error), type="server_error", code="shutting_down")
    if isinstance(event.error, NodeLost):  # this request is lost; the next ones are served
        return APIError(503, str(event.error), type="server_error", code="node_lost")
    if isinstance(event.error, ClusterError):
        return APIError(503, str(event.error), type="server_error", code="cluster_down")
    return APIError(500, f"generation failed: {event.error}", type="server_error")


_EXPECTED = {
    "stop": "a string or a list of strings",
    "prompt": "a string, a list of token ids, or a list of one of either",
    "content": "a string or a list of {'type': 'text', 'text': ...} parts (edgetp's models "
    "read text only)",
}


def validation_error(
    errors: Any, model: type[BaseModel] | None = None, body: Any = None
) -> APIError:
    """One 400 for pydantic's errors in a request for `model`: the first field at fault, what it
    got, what it takes."""
    errors = list(errors)
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(
            400,
            f"the request body is not valid JSON ({detail}): send one JSON object",
            code="invalid_json",
        )
    loc = [str(x) for x in first["loc"]][1:]  # ("body", field, ...)
    if not loc:
        return APIError(
            400,
            "the request body must be a JSON object (Content-Type: application/json), "
            f"got {_show(first.get('input'))}",
            code="invalid_body",
        )
    # A union reports one error per branch; name the field once, with what it accepts.
    field_path = _field_path(loc)
    param = ".".join(field_path)
    if first["type"] == "extra_forbidden":
        return APIError(
            400,
            f"unknown field {param!r}: edgetp does not serve it; remove it",
            param=param,
            code="unknown_field",
        )
    if first["type"] == "missing":
        return APIError(400, f"{param} is required", param=param, code="missing_field")
    if any(e["type"] == "string_unicode" for e in errors):
        return APIError(
            400,
            f"{param} is not valid Unicode (a lone UTF-16 surrogate such as \\udfff?): send "
            f"valid UTF-8 text",
            param=param,
            code="invalid_value",
        )
    narrow = _narrowed_field(model, field_path) if model else None
    if model and narrow:  # maybe a value OpenAI takes: say what edgetp serves instead
        info = declared(model, narrow)
        param = ".".join(narrow)
        value = _value_at(body, narrow, first.get("input"))
        return APIError(
            400,
            f"{param}: {_show(value)} is not supported; {info.description if info else ''}",
            param=param,
            code="unsupported_value",
        )
    same = [e for e in errors if _field_path([str(x) for x in e["loc"]][1:]) == field_path]
    if len(same) > 1 and field_path[-1] in _EXPECTED:
        msg = f"{param} must be {_EXPECTED[field_path[-1]]}"
    else:
        msg = f"{param}: {first['msg']}"
    msg += f"; got {_show(first.get('input'))}"
    info = declared(model, field_path) if model else None
    hint = info.description if info else None
    if hint:
        msg += f" ({param}: {hint})"
    return APIError(400, msg, param=param, code="invalid_value")


_BRANCH_TAGS = {"str", "int", "float", "bool", "TextPart"}


def _narrowed_field(model: type[BaseModel], path: list[str]) -> list[str] | None:
    """The start of `path` that names a field edgetp takes at fewer values than OpenAI does."""
    for end in range(1, len(path) + 1):
        if narrowed(declared(model, path[:end])):
            return path[:end]
    return None


def _value_at(body: Any, path: list[str], default: Any) -> Any:
    """The value at `path` in the request's JSON body, else `default`."""
    value = body
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return default
    return value


def _field_path(loc: list[str]) -> list[str]:
    """The field names and list indexes in `loc` up to the first union branch tag.

    Pydantic names the branch a union error came from ('str', 'list[str]'); errors from the
    branches of one field then share this path.
    """
    out = []
    for part in loc:
        if part in _BRANCH_TAGS or "[" in part or "-" in part:  # e.g. 'constrained-str'
            break
        out.append(part)
    return out


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value) if isinstance(value, bytes) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
