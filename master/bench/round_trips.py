"""Raw round trips to another process on this machine: the floor an allreduce can reach.

`edgetp bench --local-nodes` prints these next to the measured allreduce, so a slow sum can be
told apart from a slow machine.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import time

import torch
import zmq

from edgetp.master.emulate.relay import start_relay, stop_relay
from edgetp.node import messages as M
from edgetp.node import protocol as P


def zmq_echo(endpoint: str) -> None:
    """A peer that sends every message straight back (runs in its own process)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(b"hello")  # lets the ROUTER learn this peer's identity
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 1:
            break
        sock.send_multipart(frames, copy=False)
    sock.close(0)
    ctx.term()


def raw_round_trips(shape: tuple[int, ...], n: int) -> list[float]:
    """Seconds per ROUTER->DEALER->ROUTER round trip of a header and an f32 tensor of `shape`,
    to another process on this machine: the floor an allreduce hop pair can reach."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    peer = multiprocessing.get_context("spawn").Process(
        target=zmq_echo, args=(f"tcp://127.0.0.1:{port}",), daemon=True
    )
    peer.start()
    identity = sock.recv_multipart()[0] if sock.poll(30_000) else None
    if identity is None:
        raise RuntimeError("the echo process did not start")
    payload = torch.zeros(shape)
    step = M.Step(step=0, layer=0, block=P.ATTENTION)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send_multipart([identity, *M.encode(step, (payload,))], copy=False)
        sock.recv_multipart(copy=False)
        times.append(time.perf_counter() - t0)
    sock.send_multipart([identity, b"stop"])
    peer.join(timeout=5)
    sock.close(0)
    ctx.term()
    return times


def _tcp_echo(host: str, port: int) -> None:
    """A peer that sends every byte straight back over a plain TCP socket."""
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := sock.recv(1 << 16):
            sock.sendall(data)


def raw_tcp_round_trips(size: int, n: int, relay_half_us: int | None = None) -> list[float]:
    """Seconds per round trip of `size` bytes over a plain TCP socket to another process: what
    the machine's loopback costs without ZeroMQ's I/O threads in the way. With `relay_half_us`,
    through an emulated link's relay holding each byte that long each way: what it adds."""
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        port, host = server.getsockname()[1], "127.0.0.1"
        if relay_half_us is not None:  # the relay listens on another loopback address
            host = "127.0.0.2"
            stack.callback(stop_relay, start_relay(relay_half_us, host, "127.0.0.1", [port]))
        peer = multiprocessing.get_context("spawn").Process(
            target=_tcp_echo, args=(host, port), daemon=True
        )
        peer.start()
        server.settimeout(30)
        sock = stack.enter_context(server.accept()[0])
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload, times = bytes(size), []
        for _ in range(n):
            t0 = time.perf_counter()
            sock.sendall(payload)
            got = 0
            while got < size:
                got += len(sock.recv(1 << 16))
            times.append(time.perf_counter() - t0)
    peer.join(timeout=5)  # the socket's close reached it: it has returned
    return times
