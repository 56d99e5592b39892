"""Heartbeats: a peer's silence counts only the time this process was awake to hear it."""

from __future__ import annotations

import gc
import os
import time

import zmq
from waiting import wait_until

from edgetp.master.cluster.session import Session
from edgetp.master.cluster.transport import Transport
from edgetp.node import heartbeat
from edgetp.node.heartbeat import DEAD_AFTER, HeartbeatClient, HeartbeatServer
from edgetp.node.security import JoinToken, Keypair


def test_a_pause_of_this_process_is_not_its_peer_s_silence(monkeypatch):
    """A node and its master beating over real sockets; then 3 s pass in which neither
    process's heartbeat thread runs (a SIGSTOP, a suspended laptop: the clock jumps under them).
    Neither takes the other for dead for it, before its heartbeat thread has run again or after;
    a master that really goes away is still dead to the node DEAD_AFTER later."""
    context = heartbeat.node_context()
    public, secret = zmq.curve_keypair()
    server = HeartbeatServer(context, "127.0.0.1", Keypair(public, secret))
    client = HeartbeatClient(
        context, f"tcp://127.0.0.1:{server.port}", "node-1", JoinToken(public, os.urandom(16))
    )
    try:
        wait_until(
            lambda: server.silence("node-1") < 0.5 and client.master_silence() < 0.5,
            30,
            "beats both ways",
        )
        real = time.monotonic
        monkeypatch.setattr(heartbeat.time, "monotonic", lambda: real() + 3.0)
        jumped = time.monotonic()  # the clock as both heartbeat threads read it from now on
        # At once, before either heartbeat thread has run since the jump:
        assert client.master_silence() < DEAD_AFTER, client.master_silence()
        assert server.silence("node-1") < DEAD_AFTER, server.silence("node-1")

        def ran_and_beat() -> bool:
            """Both threads have run since the jump, and a beat has come each way since."""
            with server._lock:
                heard_node = server._last.get("node-1", 0.0) > jumped
            return (
                client._awake.tick > jumped
                and server._awake.tick > jumped
                and client._last_reply > jumped
                and heard_node
            )

        wait_until(ran_and_beat, 30, "run of both heartbeat threads, and beats, since the jump")
        assert client.master_silence() < DEAD_AFTER, client.master_silence()
        assert server.silence("node-1") < DEAD_AFTER, server.silence("node-1")
        server.close()  # the master goes away: that silence counts
        wait_until(lambda: client.master_silence() > DEAD_AFTER, 30, "death of the master")
    finally:
        client.close()
        server.close()
        context.term()


def test_a_session_keeps_what_its_process_held_out_of_its_re_plans_collections(smollm2):
    """A re-plan's collection (`return_freed_memory`) holds the GIL, and with it the heartbeat
    threads, for as long as it walks the objects the collector tracks: 0.9-3.5 s over those
    torch's import leaves at a load of 15 on 2 cores, past DEAD_AFTER, and a node waiting for
    its plan took its master for dead. A Session leaves what the process held when it started
    out of that walk, and puts it back in when it closes (its garbage is collected again)."""
    frozen = gc.get_freeze_count()
    walked = len(gc.get_objects())  # what a full collection walks
    session = Session(smollm2)
    try:
        assert gc.get_freeze_count() >= frozen + walked
        assert len(gc.get_objects()) < walked / 10, (len(gc.get_objects()), walked)
    finally:
        session.close()
    assert gc.get_freeze_count() == 0
    assert len(gc.get_objects()) >= walked


def test_the_master_s_beats_have_an_io_thread_of_their_own():
    """The master's heartbeats and its data go through different I/O threads of its context:
    on one, a beat waited behind a long prompt's encrypted hidden states and partials, and 4
    half-core devices took each other for dead in the first layer of a 4,096-token prompt
    (docs/bench/README.md, Agent-sized prompts). The workers' sockets are made alike
    (node/worker.py)."""
    transport = Transport()
    try:
        assert transport.context.get(zmq.IO_THREADS) == heartbeat.IO_THREADS == 2
        assert transport.sock.getsockopt(zmq.AFFINITY) == heartbeat.DATA_IO
        assert transport.heartbeat._socket.getsockopt(zmq.AFFINITY) == heartbeat.BEAT_IO
        assert heartbeat.DATA_IO & heartbeat.BEAT_IO == 0
    finally:
        transport.close()
