"""Heartbeats on their own socket and thread, so a long matmul never looks like a dead peer.

The master runs a `HeartbeatServer` (a ROUTER on its own port); every node runs a
`HeartbeatClient` that sends a beat each `HEARTBEAT_INTERVAL` and expects one back. A peer
silent for `HEARTBEAT_LIVENESS` intervals is taken for dead by whoever is waiting on it.
"""

from __future__ import annotations

import threading
import time

import zmq

from node.protocol import HEARTBEAT, HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS, decode, encode
from node.security import JoinToken, Keypair, secure_client, secure_server

DEAD_AFTER = HEARTBEAT_INTERVAL * HEARTBEAT_LIVENESS


class HeartbeatServer:
    """The master's side: answers every beat and remembers when each node last beat."""

    def __init__(self, context: zmq.Context, host: str, keys: Keypair) -> None:
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        secure_server(self._socket, keys)
        self.port = self._socket.bind_to_random_port(f"tcp://{host}")
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            identity, *frames = self._socket.recv_multipart(copy=False)
            try:
                header, _ = decode(frames)
            except Exception:
                continue  # not ours: ignore rather than die
            name = str(header.get("name", ""))
            with self._lock:
                self._last[name] = time.monotonic()
            self._socket.send_multipart([identity, *encode({"op": HEARTBEAT})])
        self._socket.close(0)

    def silence(self, name: str) -> float:
        """Seconds since `name` last beat (infinite if it never did)."""
        with self._lock:
            last = self._last.get(name)
        return float("inf") if last is None else time.monotonic() - last

    def forget(self, name: str) -> None:
        with self._lock:
            self._last.pop(name, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class HeartbeatClient:
    """A node's side: beats to the master and notices when the master stops answering."""

    def __init__(
        self, context: zmq.Context, endpoint: str, name: str, token: JoinToken | None
    ) -> None:
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if token:
            secure_client(self._socket, token)
        self._socket.connect(endpoint)
        self._name = name
        self._last_reply = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat-client", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._socket.send_multipart(encode({"op": HEARTBEAT, "name": self._name}))
                next_beat = now + HEARTBEAT_INTERVAL
            if poller.poll(max(1, int((next_beat - now) * 1000))):
                self._socket.recv_multipart()
                self._last_reply = time.monotonic()
        self._socket.close(0)

    def master_silence(self) -> float:
        return time.monotonic() - self._last_reply

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
