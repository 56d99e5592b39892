"""CurveZMQ links: only holders of the current join token get in, and the wire is encrypted."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading

import pytest
import torch
import zmq
from cluster_threads import master_threads
from waiting import wait_until

from edgetp.master.cluster.hub import Hub
from edgetp.master.cluster.local import LocalWorkers
from edgetp.master.cluster.session import Session
from edgetp.master.cluster.transport import ClusterError
from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import SamplingParams
from edgetp.memory.budget import FILE_TYPES
from edgetp.models.kernels import embed
from edgetp.node import messages as M
from edgetp.node import protocol as P
from edgetp.node.messages import Capacity
from edgetp.node.security import (
    TOKEN_ENV,
    JoinToken,
    TokenError,
    master_keys,
    master_token,
    secure_client,
)


def test_token_round_trip_and_bad_tokens(tmp_path):
    keys = master_keys(tmp_path)
    token = master_token(tmp_path, keys)
    assert JoinToken.parse(str(token)) == token
    assert master_keys(tmp_path) == keys  # persists
    assert master_token(tmp_path, keys) == token
    assert oct((tmp_path / "keys" / "master.key").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "keys").stat().st_mode & 0o777) == "0o700"
    rotated = master_token(tmp_path, keys, rotate=True)
    assert rotated != token and rotated.master_public == token.master_public
    for bad in ["hello", "etp1-!!!", "etp1-abcd"]:
        with pytest.raises(TokenError):
            JoinToken.parse(bad)


def _join(port: int, state, token: str | None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    if token:
        env[TOKEN_ENV] = token
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgetp.tui.cli",
            "join",
            f"127.0.0.1:{port}",
            "--state-dir",
            str(state),
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _pump(hub: Hub, seconds: float, until_exited: tuple[subprocess.Popen, ...] = ()) -> None:
    """Answer what comes to `hub` for `seconds`, or until every one of `until_exited` has."""

    def exited() -> None:
        if until_exited and all(p.poll() is not None for p in until_exited):
            raise ClusterError("they exited")

    try:
        hub.wait_for_workers(1, timeout=seconds, check=exited)
    except ClusterError:
        pass


def test_wrong_missing_and_rotated_tokens_are_refused(tmp_path, caplog):
    keys = master_keys(tmp_path / "master")
    old = master_token(tmp_path / "master", keys)
    current = master_token(tmp_path / "master", keys, rotate=True)
    wrong = JoinToken(keys.public, os.urandom(16))
    hub = Hub("127.0.0.1", 0, keys=keys, token=current)
    cases = {
        "none": (None, "requires a join token"),
        "wrong": (str(wrong), "refused this node's join token"),
        "rotated": (str(old), "refused this node's join token"),
    }
    try:
        with caplog.at_level(logging.WARNING):
            procs = {k: _join(hub.port, tmp_path / k, t) for k, (t, _) in cases.items()}
            _pump(hub, 60, until_exited=tuple(procs.values()))
            outputs = {k: p.communicate(timeout=60) for k, p in procs.items()}
        assert hub.nodes == []  # nobody got in
    finally:
        hub.close()
    for name, (_, message) in cases.items():
        proc, (_, err) = procs[name], outputs[name]
        assert proc.returncode == 1, (name, err)
        last = err.strip().splitlines()[-1]
        assert last.startswith("edgetp: error: ") and message in last, (name, last)
    logged = [r.getMessage() for r in caplog.records]
    # no token: libzmq reports the NULL-vs-CURVE mismatch as PROTOCOL or, when the peer hangs up
    # first, as NO_DETAIL; either way the master must log the refusal
    assert any("handshake failed" in m for m in logged), logged
    assert sum("does not come from the current join token" in m for m in logged) >= 2, logged


def test_plain_socket_gets_nothing_and_breaks_nothing(tmp_path):
    hub = Hub("127.0.0.1", 0)
    ctx = zmq.Context.instance()
    plain = ctx.socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    # The master may refuse the plain handshake before the send: a DEALER left with no peer
    # then waits for one (on CI, until the suite's timeout), so it waits a second at most.
    plain.setsockopt(zmq.SNDTIMEO, 1000)
    plain.connect(f"tcp://127.0.0.1:{hub.port}")
    hello = M.Hello(P.PROTOCOL_VERSION, "x", Capacity(1, 1, 1.0))
    try:
        with contextlib.suppress(zmq.Again):
            plain.send_multipart(M.encode(hello))
        _pump(hub, 1.0)
        assert not plain.poll(500)  # nothing comes back
        assert hub.nodes == []
        # The master still serves a node that holds the token.
        good = ctx.socket(zmq.DEALER)
        good.setsockopt(zmq.LINGER, 0)
        secure_client(good, hub.token)
        good.connect(f"tcp://127.0.0.1:{hub.port}")
        good.send_multipart(M.encode(hello))
        _pump(hub, 30.0)  # until it has joined (a deadline against a hang)
        assert [m.name for m in hub.nodes] == ["x"]
        good.close()
    finally:
        plain.close()
        hub.close()


class Sniffer:
    """Every TCP payload seen on the loopback interface (needs root: AF_PACKET)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.1)
        self.captured = bytearray()
        self.packets = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self.sock.recv(65535)
            except TimeoutError:
                continue
            self.captured += frame
            self.packets += 1

    def caught_up(self) -> None:
        """Return once the capture has come past every packet sent on loopback before the
        call: a marker datagram is sent after them, and loopback delivers in order. It is sent
        again at each look, as a capture that lags behind (a busy machine) has its buffer full
        and the kernel drops what comes meanwhile."""
        marker = os.urandom(16)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:

            def seen() -> bool:
                if marker in self.captured:
                    return True
                udp.sendto(marker, ("127.0.0.1", 9))  # the discard port: nobody reads it
                return False

            wait_until(seen, 60, "capture of the marker datagram")

    def stop(self) -> bytes:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        return bytes(self.captured)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="capturing packets needs root")
@master_threads(2)
def test_traffic_between_master_and_worker_is_encrypted(smollm2, smollm2_tokenizer, shared_state):
    prompt = "The secret password is swordfish. Repeat the secret password:"
    ids = smollm2_tokenizer.encode(prompt)
    hub = Hub("127.0.0.1", 0, model_names=(smollm2.name,))
    # The file's own blocks, as `edgetp serve` runs them, from the run's state folder: the
    # shards of this split and the kernel checks are those of every 2-node local cluster, and
    # the worker reads the master's store (nothing of them crosses the wire either way).
    session = Session(smollm2, hub, shared_state, 128, 1, FILE_TYPES, equal_shares=True)
    workers = LocalWorkers(1, hub.port, 1, shared_state, False, hub.token, memory=FILE_TYPES)
    try:
        engine = session.start(workers=1, timeout=120)
        sniffer = Sniffer()
        (g,) = start(engine, [ids], [SamplingParams(max_tokens=16)])
        answer = "".join(text for _, text in stream(engine, smollm2_tokenizer, [g]))
        sniffer.caught_up()
        wire = sniffer.stop()
        packets = sniffer.packets
        # Positive control: the same message on a plain socket is seen in the clear.
        control = Sniffer()
        ctx = zmq.Context.instance()
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        port = a.bind_to_random_port("tcp://127.0.0.1")
        b.connect(f"tcp://127.0.0.1:{port}")
        h0 = embed(torch.tensor([ids]), engine.embedding, engine.embedding_scale)
        b.send_multipart(M.encode(M.Step(step=1, layer=0, block=P.ATTENTION), (h0,)))
        a.recv_multipart()
        control.caught_up()
        clear = control.stop()
        a.close(0)
        b.close(0)
    finally:
        session.close()
        workers.stop()
    hidden_bytes = h0.numpy().tobytes()[:64]  # the start of what layer 0 sends each worker
    step_header = b"\xa2op\xa4step"  # msgpack for {"op": "step", ...}
    assert hidden_bytes in clear and step_header in clear  # the sniffer does see plaintext
    print(f"captured {packets} packets, {len(wire)} bytes on loopback during the answer")
    assert packets > 100
    assert hidden_bytes not in wire and step_header not in wire
    assert answer.strip() and answer.encode() not in wire
    assert b"swordfish" not in wire and prompt.encode() not in wire
