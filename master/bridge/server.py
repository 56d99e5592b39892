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
from collections.abc import Sequence
from types import FrameType

import uvicorn

from edgetp.master.bridge.app import create_app
from edgetp.master.bridge.core import Served
from edgetp.master.cluster.session import Session
from edgetp.master.generation.batcher import Batcher
from edgetp.master.generation.speculate import open_speculator
from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.dtypes import AUTO
from edgetp.models.source import ModelSource
from edgetp.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 2  # for responses still being written after Ctrl-C


def serve(
    sessions: contextlib.AbstractContextManager[Session],
    source: ModelSource,
    tokenizer: Tokenizer,
    sock: socket.socket,
    model: str | None = None,
    api_key: str | None = None,
    verbose: bool = False,
    draft: tuple[str, str] = ("off", AUTO),
    cors_origins: Sequence[str] = (),
    prompt_reuse: bool = True,
) -> None:
    """Enter `sessions` (a started session of `source`) and serve it on `sock` (from
    `master.bridge.listen.bind`, closed here) until interrupted.

    `model` is the name the model was asked for, accepted in requests besides its own;
    `draft` is `--draft` and `--draft-dtype` (master/generation/speculate.py); `cors_origins` the
    pages
    (`--cors-origin`) a browser may call the API from; `prompt_reuse` off (`--no-prompt-reuse`)
    prefills every request whole.
    """
    try:
        aliases = tuple({model or DEFAULT_MODEL, source.path.stem} - {source.name})
        created = int(source.path.stat().st_mtime)
        with sessions as session:
            speculator = open_speculator(*draft, session, tokenizer)
            batcher = Batcher(
                session, tokenizer, speculator=speculator, prompt_reuse=prompt_reuse
            ).start()
            try:
                served = Served(batcher, tokenizer, source.name, aliases, created)
                app = create_app(served, api_key, cors_origins)
                config = uvicorn.Config(
                    app,
                    log_level="info" if verbose else "warning",
                    access_log=verbose,
                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                )
                bound_host, bound_port = sock.getsockname()[:2]
                shown = f"[{bound_host}]" if ":" in bound_host else bound_host
                print(
                    f"edgetp serve: {source.name} on {session.nodes} node(s), {session.slots} "
                    f"slots, context {session.max_context}; OpenAI API at "
                    f"http://{shown}:{bound_port}/v1",
                    file=sys.stderr,
                    flush=True,
                )
                if not api_key and not _is_loopback(bound_host):
                    log.warning(
                        "listening on %s without --api-key: anyone who can reach it can use it",
                        bound_host,
                    )
                _Server(config, batcher).run(sockets=[sock])
            finally:
                batcher.close()
    finally:
        sock.close()


class _Server(uvicorn.Server):
    """Stops the generation loop first on Ctrl-C, so that running streams end at once with an
    error event ("the server is shutting down") instead of being cut after the grace time."""

    def __init__(self, config: uvicorn.Config, batcher: Batcher) -> None:
        super().__init__(config)
        self.batcher = batcher

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler must neither block nor take the batcher's lock: close on a thread.
        threading.Thread(target=self.batcher.close, daemon=True).start()
        super().handle_exit(sig, frame)


def _is_loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")
