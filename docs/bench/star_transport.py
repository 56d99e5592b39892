"""What the transport costs a star allreduce on this machine, apart from everything else.

An emulation, not edgetp: SmolLM2-sized float32 blocks (30 layers x attention and FFN
projections, decode: one row) computed by one process on every core, or split between a master
and workers on one thread each, whose partials come back to the master over ZeroMQ
(ROUTER/DEALER, spinning before poll as edgetp does) or over plain TCP sockets polled in a
busy loop. Node counts and transports alternate over rounds; medians are printed.

    .venv/bin/python docs/bench/star_transport.py [rounds]
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable

import numpy as np
import zmq
from threadpoolctl import threadpool_limits

D, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 576, 1536, 9, 3, 64, 30
TOKENS = 40
HEADER = struct.Struct("ii")  # layer, block; (-1, 0) stops a worker
MESSAGE = HEADER.size + 4 * D


def slice_weights(share: float, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    q = max(1, round(HEADS * share)) * HEAD_DIM
    kv = max(1, round(KV_HEADS * share)) * HEAD_DIM
    f = int(FFN * share)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32)

    return [
        {
            "qkv": matrix(q + 2 * kv, D),
            "o": matrix(D, q),
            "gu": matrix(2 * f, D),
            "down": matrix(D, f),
        }
        for _ in range(LAYERS)
    ]


def partial(w: dict[str, np.ndarray], block: int, h: np.ndarray) -> np.ndarray:
    if block == 0:
        return w["o"] @ (w["qkv"] @ h)[: w["o"].shape[1]]
    gu = w["gu"] @ h
    n = gu.shape[0] // 2
    return w["down"] @ (gu[:n] * gu[n:])


def spin_until(ready: Callable[[], bool]) -> None:
    end = time.perf_counter() + 0.001
    while time.perf_counter() < end and not ready():
        os.sched_yield()


def recv_exactly(sock: socket.socket, buf: bytearray) -> bool:
    """Busy-poll a non-blocking socket for one message; False when the peer closed."""
    got = 0
    while got < len(buf):
        try:
            n = sock.recv_into(memoryview(buf)[got:])
        except BlockingIOError:
            continue
        if n == 0:
            return False
        got += n
    return True


def worker(transport: str, port: int, share: float, seed: int) -> None:
    threadpool_limits(1, "blas")
    weights = slice_weights(share, seed)
    if transport == "zmq":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(b"hello")
        while True:
            spin_until(lambda: bool(sock.poll(0)))
            header, body = sock.recv_multipart()
            layer, block = HEADER.unpack(header)
            if layer < 0:
                return
            sock.send_multipart(
                [header, partial(weights[layer], block, np.frombuffer(body, np.float32))]
            )
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(MESSAGE)
        while True:
            sock.setblocking(False)
            if not recv_exactly(sock, buf):
                return
            layer, block = HEADER.unpack_from(buf)
            if layer < 0:
                return
            out = partial(weights[layer], block, np.frombuffer(buf, np.float32, D, HEADER.size))
            sock.setblocking(True)
            sock.sendall(buf[: HEADER.size] + out.tobytes())


def one_process() -> float:
    threadpool_limits(os.cpu_count() or 1, "blas")
    weights = slice_weights(1.0, 0)
    h = np.ones(D, np.float32)
    t0 = time.perf_counter()
    for _ in range(TOKENS):
        for layer in range(LAYERS):
            for block in (0, 1):
                h = h + partial(weights[layer], block, h) * 1e-3
                h /= np.abs(h).max()
    return (time.perf_counter() - t0) * 1000 / TOKENS


def star(transport: str, nodes: int) -> float:
    """ms per token of blocks, the master computing its share while the workers do theirs."""
    threadpool_limits(1, "blas")
    share = 1.0 / nodes
    weights = slice_weights(share, 0)
    spawn = multiprocessing.get_context("spawn")
    if transport == "zmq":
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
    else:
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
    procs = [
        spawn.Process(target=worker, args=(transport, port, share, k)) for k in range(1, nodes)
    ]
    for p in procs:
        p.start()
    if transport == "zmq":
        peers = [router.recv_multipart()[0] for _ in procs]

        def send(layer: int, block: int, h: np.ndarray) -> None:
            for peer in peers:
                router.send_multipart([peer, HEADER.pack(layer, block), h])

        def gather() -> np.ndarray:
            total = np.zeros(D, np.float32)
            for _ in peers:
                spin_until(lambda: bool(router.poll(0)))
                total += np.frombuffer(router.recv_multipart()[2], np.float32)
            return total

    else:
        links = [server.accept()[0] for _ in procs]
        for link in links:
            link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(MESSAGE)

        def send(layer: int, block: int, h: np.ndarray) -> None:
            for link in links:
                link.setblocking(True)
                link.sendall(HEADER.pack(layer, block) + h.tobytes())

        def gather() -> np.ndarray:
            total = np.zeros(D, np.float32)
            for link in links:
                link.setblocking(False)
                recv_exactly(link, buf)
                total += np.frombuffer(buf, np.float32, D, HEADER.size)
            return total

    h = np.ones(D, np.float32)
    warmup = 3
    for token in range(TOKENS + warmup):
        if token == warmup:
            t0 = time.perf_counter()
        for layer in range(LAYERS):
            for block in (0, 1):
                send(layer, block, h)
                mine = partial(weights[layer], block, h)
                h = h + (mine + gather()) * 1e-3
                h /= np.abs(h).max()
    ms = (time.perf_counter() - t0) * 1000 / TOKENS
    send(-1, 0, np.zeros(D, np.float32))
    for p in procs:
        p.join(timeout=10)
    if transport == "zmq":
        ctx.destroy(linger=0)
    else:
        for link in links:
            link.close()
        server.close()
    return ms


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    runs: dict[str, Callable[[], float]] = {
        "1 process, all cores": one_process,
        "2 nodes, ZeroMQ": lambda: star("zmq", 2),
        "2 nodes, plain TCP": lambda: star("tcp", 2),
        "3 nodes, ZeroMQ": lambda: star("zmq", 3),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(run())
    base = statistics.median(times["1 process, all cores"])
    print(f"SmolLM2-sized blocks, {TOKENS} tokens, medians of {rounds} alternating rounds")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<22}{median:8.2f} ms/token {median / base:6.2f}x")


if __name__ == "__main__":
    main()
