"""A bridge app served by a real uvicorn on a free local port, in a thread of the test."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn
from waiting import wait_until

from edgetp.master.bridge.server import IDLE_CONNECTION_S

START_TIMEOUT = 60.0


@contextlib.contextmanager
def served_app(app: Any, timeout: float = START_TIMEOUT) -> Iterator[str]:
    """Serves `app` until the block ends; yields its base URL (no /v1)."""
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=IDLE_CONNECTION_S)
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), timeout, "start of uvicorn")
        assert server.started, "uvicorn ended before it started"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
