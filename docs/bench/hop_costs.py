"""What one hop costs on this machine, apart from edgetp: round trips between two processes
pinned to one core or to two, over a pipe and over ZeroMQ (ROUTER/DEALER on TCP, as the hub
and its workers use it), with and without Curve, each with a 2,304-byte message (SmolLM2's
hidden state). Prints medians and the context switches per round trip.

    .venv/bin/python docs/bench/hop_costs.py [round trips]
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time

import zmq

PAYLOAD = b"x" * 2304


def _switches() -> int:
    """Context switches of every thread of this process so far (ZeroMQ's I/O threads too)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/status") as f:
            total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
    return total


def _pipe_echo(core: int, inbox: int, outbox: int, n: int) -> None:
    os.sched_setaffinity(0, {core})
    for _ in range(n):
        os.write(outbox, os.read(inbox, 1))


def pipe_round_trips(cores: tuple[int, int], n: int) -> tuple[float, float]:
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    child = multiprocessing.Process(target=_pipe_echo, args=(cores[1], to_child, from_child, n))
    child.start()
    os.sched_setaffinity(0, {cores[0]})
    times, before = [], _switches()
    for _ in range(n):
        t = time.perf_counter()
        os.write(from_parent, b"x")
        os.read(to_parent, 1)
        times.append(time.perf_counter() - t)
    switches = (_switches() - before) / n
    child.join()
    for fd in (to_child, from_parent, to_parent, from_child):
        os.close(fd)
    return statistics.median(times) * 1e6, switches


def _zmq_echo(core: int, port: int, server_key: bytes | None, n: int) -> None:
    os.sched_setaffinity(0, {core})  # before the context: its I/O thread inherits the core
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    if server_key is not None:
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = server_key
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(b"hello")
    for _ in range(n):
        sock.send_multipart(sock.recv_multipart())
    sock.close(linger=1000)
    context.term()


def zmq_round_trips(cores: tuple[int, int], curve: bool, n: int) -> tuple[float, float]:
    os.sched_setaffinity(0, {cores[0]})
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    server_key = None
    if curve:
        server_key, secret = zmq.curve_keypair()
        sock.curve_server, sock.curve_publickey, sock.curve_secretkey = True, server_key, secret
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    child = multiprocessing.Process(target=_zmq_echo, args=(cores[1], port, server_key, n))
    child.start()
    identity, _ = sock.recv_multipart()
    times, before = [], _switches()
    for _ in range(n):
        t = time.perf_counter()
        sock.send_multipart([identity, PAYLOAD])
        sock.recv_multipart()
        times.append(time.perf_counter() - t)
        time.sleep(0.0002)  # as between a layer's sums: the other side goes back to sleep
    switches = (_switches() - before) / n  # this process's threads, its I/O threads included
    child.join()
    sock.close(0)
    context.term()
    return statistics.median(times) * 1e6, switches


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    multiprocessing.set_start_method("fork")
    print(f"round trips, median of {n}; context switches of the first process per round trip")
    for cores in ((0, 0), (0, 1)):
        where = "one core" if cores[0] == cores[1] else "two cores"
        us, sw = pipe_round_trips(cores, n)
        print(f"  pipe, 1 byte,           {where:<9} {us:7.1f} us  {sw:4.1f} switches")
        for curve in (False, True):
            us, sw = zmq_round_trips(cores, curve, n)
            name = "ZeroMQ + Curve" if curve else "ZeroMQ        "
            print(f"  {name}, 2304 B, {where:<9} {us:7.1f} us  {sw:4.1f} switches")


if __name__ == "__main__":
    main()
