"""Heartbeats: a peer's silence counts only the time this process was awake to hear it."""

from __future__ import annotations

import os
import time

import zmq

from node import heartbeat
from node.heartbeat import DEAD_AFTER, HeartbeatClient, HeartbeatServer
from node.security import JoinToken, Keypair


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_pause_of_this_process_is_not_its_peer_s_silence(monkeypatch):
    """A node and its master beating over real sockets; then 3 s pass in which neither
    process's heartbeat thread runs (a SIGSTOP, a suspended laptop: the clock jumps under them).
    Neither takes the other for dead for it, before its heartbeat thread has run again or after;
    a master that really goes away is still dead to the node DEAD_AFTER later."""
    context = zmq.Context()
    public, secret = zmq.curve_keypair()
    server = HeartbeatServer(context, "127.0.0.1", Keypair(public, secret))
    client = HeartbeatClient(
        context, f"tcp://127.0.0.1:{server.port}", "node-1", JoinToken(public, os.urandom(16))
    )
    try:
        _until(lambda: server.silence("node-1") < 0.5 and client.master_silence() < 0.5)
        real = time.monotonic
        monkeypatch.setattr(heartbeat.time, "monotonic", lambda: real() + 3.0)
        # At once, before either heartbeat thread has run since the jump:
        assert client.master_silence() < DEAD_AFTER, client.master_silence()
        assert server.silence("node-1") < DEAD_AFTER, server.silence("node-1")
        time.sleep(4 * heartbeat.HEARTBEAT_INTERVAL)  # they run, and beats come again
        assert client.master_silence() < DEAD_AFTER, client.master_silence()
        assert server.silence("node-1") < DEAD_AFTER, server.silence("node-1")
        server.close()  # the master goes away: that silence counts
        _until(lambda: client.master_silence() > DEAD_AFTER, timeout=DEAD_AFTER + 2)
    finally:
        client.close()
        server.close()
        context.term()
