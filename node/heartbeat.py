"""Heartbeats on their own socket and thread, so a long matmul never looks like a dead peer.

The master runs a `HeartbeatServer` (a ROUTER on its own port); every node runs a
`HeartbeatClient` that sends a beat each `HEARTBEAT_INTERVAL` and expects one back. A peer
silent for `HEARTBEAT_LIVENESS` intervals is taken for dead by whoever is waiting on it.

Silence counts only the time this process was awake to hear beats: a process stopped (SIGSTOP,
a suspended laptop) or starved past `PAUSED_AFTER` heard nothing because it did not run, not
because its peer went away. Without that, a node woken from a 3 s pause took its master for
dead before its heartbeat thread had run once, and exited, where the master only waited for it
(or had dropped it and told it to join again).
"""

from __future__ import annotations

import threading
import time

import zmq

from edgetp.node.messages import Heartbeat, ProtocolError, decode_heartbeat, encode
from edgetp.node.protocol import HEARTBEAT_INTERVAL, HEARTBEAT_LIVENESS
from edgetp.node.security import JoinToken, Keypair, secure_client, secure_server

DEAD_AFTER = HEARTBEAT_INTERVAL * HEARTBEAT_LIVENESS
# A node's and the master's ZeroMQ context runs two I/O threads: the data socket's messages on
# the first (AFFINITY bit 1), the heartbeats on the second (bit 2). On one I/O thread a beat
# waited behind the hidden states and partials of a long prompt, which CurveZMQ encrypts whole
# (Llama-3-8B shapes, 4,096 tokens: 67 MB a message, 3 workers), and under a half-core quota
# nodes took each other for dead before the first layer was through.
IO_THREADS = 2
DATA_IO, BEAT_IO = 1, 2

# A heartbeat thread wakes at least every HEARTBEAT_INTERVAL: one that has not run for this long
# was paused with its process (or starved), and that time is nobody's silence.
PAUSED_AFTER = 4 * HEARTBEAT_INTERVAL


def node_context() -> zmq.Context:
    """A context for a node's or the master's sockets: the data socket set to DATA_IO, the
    heartbeats (here) to BEAT_IO."""
    return zmq.Context(io_threads=IO_THREADS)


class _AwakeClock:
    """When this process last heard from its heartbeat thread, and what it slept through."""

    def __init__(self) -> None:
        self.tick = time.monotonic()

    def paused(self) -> float:
        """Seconds the heartbeat thread did not run before this pass, if it was paused; else 0.
        Its caller moves the times it last heard a peer on by them, then calls `ran`."""
        gap = time.monotonic() - self.tick
        return gap if gap > PAUSED_AFTER else 0.0

    def ran(self) -> None:
        self.tick = time.monotonic()

    def now(self) -> float:
        """The present, or, where the heartbeat thread has not run since a pause, its last pass:
        until it runs again, what it did not hear is not known to be silence."""
        tick, now = self.tick, time.monotonic()
        return tick if now - tick > PAUSED_AFTER else now


class HeartbeatServer:
    """The master's side: answers every beat and remembers when each node last beat."""

    def __init__(self, context: zmq.Context, host: str, keys: Keypair) -> None:
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.AFFINITY, BEAT_IO)
        secure_server(self._socket, keys)
        self.port = self._socket.bind_to_random_port(f"tcp://{host}")
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._awake = _AwakeClock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            paused = self._awake.paused()
            if paused:  # the nodes' silence restarts where this process woke up
                with self._lock:
                    self._last = {name: last + paused for name, last in self._last.items()}
            self._awake.ran()
            if not poller.poll(100):
                continue
            identity, *frames = self._socket.recv_multipart(copy=False)
            try:
                name = decode_heartbeat(frames[0]).name
            except (ProtocolError, IndexError):
                continue  # not ours: ignore rather than die
            with self._lock:
                self._last[name] = time.monotonic()
            self._socket.send_multipart([identity, *encode(Heartbeat())])
        self._socket.close(0)

    def silence(self, name: str) -> float:
        """Seconds since `name` last beat (infinite if it never did)."""
        with self._lock:
            last = self._last.get(name)
        return float("inf") if last is None else self._awake.now() - last

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
        self._socket.setsockopt(zmq.AFFINITY, BEAT_IO)
        if token:
            secure_client(self._socket, token)
        self._socket.connect(endpoint)
        self._name = name
        self._last_reply = time.monotonic()
        self._awake = _AwakeClock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat-client", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        next_beat = 0.0
        while not self._stop.is_set():
            self._last_reply += self._awake.paused()  # a pause of this process is not silence
            self._awake.ran()
            now = time.monotonic()
            if now >= next_beat:
                self._socket.send_multipart(encode(Heartbeat(name=self._name)))
                next_beat = now + HEARTBEAT_INTERVAL
            if poller.poll(max(1, int((next_beat - now) * 1000))):
                self._socket.recv_multipart()
                self._last_reply = time.monotonic()
        self._socket.close(0)

    def master_silence(self) -> float:
        """Seconds the master has not answered while this process was awake to hear it."""
        return self._awake.now() - self._last_reply

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
