"""`edgetp serve`: a cluster session behind the REST bridge, on uvicorn.

The session is a LAN master that devices join at any time, or a cluster on this machine.

The socket is bound before uvicorn starts, so `--port 0` works: the line printed on stderr
names the port taken. Ctrl-C (or SIGTERM) stops the generation loop, so running requests end at
once with a "shutting down" error, then stops accepting, and then the cluster.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import FrameType

import uvicorn

from edgetp.master.bridge.app import create_app
from edgetp.master.bridge.core import Served
from edgetp.master.bridge.models import ModelChoice, Models
from edgetp.master.cluster.session import Session
from edgetp.master.generation.batcher import Batcher
from edgetp.master.generation.params import CHUNK_STEP_S
from edgetp.master.generation.speculate import open_speculator
from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.dtypes import AUTO
from edgetp.models.errors import ModelError
from edgetp.models.source import ModelSource
from edgetp.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 2  # for responses still being written after Ctrl-C
# How long an idle kept-alive connection stays open. Longer than the clients' own (httpx, under
# the openai and anthropic clients, drops its idle connections after 5 s): at uvicorn's default,
# also 5 s, a client could send its next request on a connection the server was closing that
# moment, and it failed with "Server disconnected without sending a response" (the Responses
# API's 50 concurrent requests in tests/test_bridge_clients.py, on a busy machine).
IDLE_CONNECTION_S = 75


def serve(
    sessions: Callable[[ModelSource], contextlib.AbstractContextManager[Session]],
    models: Sequence[tuple[ModelSource, Tokenizer, str | None]],
    sock: socket.socket,
    api_key: str | None = None,
    verbose: bool = False,
    draft: tuple[str, str] = ("off", AUTO),
    cors_origins: Sequence[str] = (),
    prompt_reuse: bool = True,
    unload_after: float | None = None,
    chunk_step_s: float | None = CHUNK_STEP_S,
    resident: tuple[Callable[[ModelSource], int], int | None] = (lambda _: 0, None),
) -> None:
    """Serve `models` (each a source, its tokenizer and the name it was asked for) on `sock`
    (from `master.bridge.listen.bind`, closed here) until interrupted: the first loaded at
    start, in a session `sessions(source)` opens; a request naming another switches the cluster
    to it (master/bridge/models.py); one left idle `unload_after` s is unloaded. `resident`:
    what a model holds once loaded (bytes), and the memory the resident models share (None:
    one at a time).

    `draft` is `--draft` and `--draft-dtype` (master/generation/speculate.py), for the first
    model; `cors_origins` the pages (`--cors-origin`) a browser may call the API from;
    `prompt_reuse` off (`--no-prompt-reuse`) prefills every request whole; `chunk_step_s`
    (`--prefill-chunk-ms`) is the time a step of a long prompt's chunk aims at while other
    requests decode (None: a prompt prefills whole, the others waiting).
    """
    try:
        need, budget = resident
        choices = [
            replace(
                _choice(
                    sessions,
                    source,
                    tokenizer,
                    name,
                    draft if i == 0 else ("off", AUTO),
                    (prompt_reuse, chunk_step_s),
                ),
                need=need(source),
            )  # fmt: skip
            for i, (source, tokenizer, name) in enumerate(models)
        ]
        ids = [c.model_id for c in choices]
        if len(set(ids)) < len(ids):
            raise ModelError(f"two of the models given are one model ({', '.join(ids)}): give "
                             "each once")  # fmt: skip
        served, close = choices[0].load()
        loaded = Models(choices, (served, close), unload_after, budget)
        try:
            session = served.batcher.session
            app = create_app(loaded, api_key, cors_origins)
            config = uvicorn.Config(
                app,
                log_level="info" if verbose else "warning",
                access_log=verbose,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                timeout_keep_alive=IDLE_CONNECTION_S,
            )
            bound_host, bound_port = sock.getsockname()[:2]
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            others = f" (and on request: {', '.join(ids[1:])})" if len(ids) > 1 else ""
            print(
                f"edgetp serve: {served.model_id}{others} on {session.nodes} node(s), "
                f"{session.slots} slots, context {session.max_context}; OpenAI API at "
                f"http://{shown}:{bound_port}/v1",
                file=sys.stderr,
                flush=True,
            )
            if not api_key and not _is_loopback(bound_host):
                log.warning(
                    "listening on %s without --api-key: anyone who can reach it can use it",
                    bound_host,
                )
            _Server(config, loaded).run(sockets=[sock])
        finally:
            loaded.close()
    finally:
        sock.close()


def _choice(
    sessions: Callable[[ModelSource], contextlib.AbstractContextManager[Session]],
    source: ModelSource,
    tokenizer: Tokenizer,
    name: str | None,
    draft: tuple[str, str],
    batching: tuple[bool, float | None],
) -> ModelChoice:
    """A model the server may load: its names, and how to open its session and batcher
    (`batching`: its prompt reuse and chunk step, as `serve` takes them)."""
    aliases = tuple({name or DEFAULT_MODEL, source.path.stem} - {source.name})

    def load() -> tuple[Served, Callable[[], None]]:
        with contextlib.ExitStack() as opened:  # closed here only if loading fails
            session = opened.enter_context(sessions(source))
            speculator = open_speculator(*draft, session, tokenizer)
            batcher = Batcher(
                session,
                tokenizer,
                speculator=speculator,
                prompt_reuse=batching[0],
                chunk_step_s=batching[1],
            ).start()
            opened.callback(batcher.close)  # first, then the session
            served = Served(batcher, tokenizer, source.name, aliases, created)
            return served, opened.pop_all().close

    created = int(source.path.stat().st_mtime)
    return ModelChoice(source.name, aliases, created, load)


class _Server(uvicorn.Server):
    """Stops the generation loop first on Ctrl-C, so that running streams end at once with an
    error event ("the server is shutting down") instead of being cut after the grace time."""

    def __init__(self, config: uvicorn.Config, models: Models) -> None:
        super().__init__(config)
        self.models = models

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler must neither block nor take the batcher's lock: close on a thread.
        for served in self.models.resident:
            threading.Thread(target=served.batcher.close, daemon=True).start()
        super().handle_exit(sig, frame)


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")
