"""The floor under N emulated devices' ms/token on this machine: what a token would take at
cpu=q if nothing but the compute and ZeroMQ's own work were left, every device busy all the time.

Three measured parts, each devices' placement as the emulator makes it (node k on core k mod 2):
- compute: each slice of SmolLM2's equal N-way plan, warm, in its own process pinned to its
  core, one BLAS thread, for the same seconds as another slice streams on the other core (as a
  device's neighbour does in a run); the lm_head once. CPU time (time.thread_time).
- ZeroMQ: a hub (ROUTER) sends each of N-1 peers (DEALER, echoing) a STEP-sized message and
  waits for all answers, sleeping between sums as a device does while the others compute. CPU
  time of every thread of each process (/proc/<pid>/task/*/schedstat) per sum: the I/O threads
  (which no code of ours can avoid: libzmq hands every message to one) apart from the main one.
- a round trip through the emulator's link relay at rtt=2ms: what a sum costs beyond the rtt.

Twice over: as the emulator places the devices, and without two things of this host that a
cluster of separate devices does not have: one memory bus that all cores stream from (each slice
is then timed alone), and a peer's wake-up on another core of a VM (the peers then run on the
hub's core, so a message wakes its reader where it is, as a device's own interrupt does).

A token's floor at N devices is the sum of the devices' CPU per token (compute plus 60 sums of
ZeroMQ I/O-thread time) over N q: no plan can keep devices busier than all the time. A second
floor adds the main threads' ZeroMQ calls as the echo makes them (pyzmq, nothing else per
message): a sum's path in native code would pay their system calls, if less of the rest.

    .venv/bin/python docs/bench/n_device_floor.py ONE_DEVICE_MS [q]

ONE_DEVICE_MS: the 1-device ms/token at cpu=q of an `edgetp bench --device cpu=q` run the same hour.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import zmq

from edgetp.master.bench.round_trips import zmq_echo
from edgetp.master.cluster.engine import Engine
from edgetp.master.emulate.relay import start_relay, stop_relay
from edgetp.models.layers import StepBatch
from edgetp.models.source import open_model
from edgetp.node import messages as M
from edgetp.node import protocol as P

SECONDS = 4.0  # each timed compute loop
SUMS = 3000
GAP_S = 0.0005  # between sums, as while the devices compute


def _compute(
    capacities: tuple[float, ...], k: int, core: int, head: bool, start: Any, out: Any
) -> None:
    """us of CPU per layer of slice k (and per lm_head when `head`), looping for SECONDS."""
    os.sched_setaffinity(0, {core})  # first: the engine's executors size BLAS to this core
    engine = Engine.local(open_model(None), capacities=capacities, max_context=256)
    config = engine.config
    engine.forward([list(range(100, 140))], StepBatch((0,), (0,), (40,)))
    h = np.random.default_rng(0).standard_normal((1, config.hidden), dtype=np.float32)
    batch = StepBatch((0,), (40,), (1,))
    executor = engine.executors[k]
    executor.begin_step(batch)
    for i in range(config.n_layers):  # warm
        executor.attention(i, h)
        executor.ffn(i, h)
    start.wait()
    layers, heads, layer_cpu, head_cpu = 0, 0, 0.0, 0.0
    end = time.perf_counter() + SECONDS
    while time.perf_counter() < end:
        t = time.thread_time()
        i = layers % config.n_layers
        executor.attention(i, h)
        executor.ffn(i, h)
        layer_cpu += time.thread_time() - t
        layers += 1
        if head and i == config.n_layers - 1:
            t = time.thread_time()
            engine._head(h, batch, False)
            head_cpu += time.thread_time() - t
            heads += 1
    out.put((k, layer_cpu / layers * 1e6, head_cpu / heads * 1e6 if heads else 0.0))


def compute_costs(n: int, alone: bool = False) -> dict[int, tuple[float, float]]:
    """Slice k of the equal n-way plan: (us per layer, us per lm_head) with its neighbour core
    busy streaming another slice (for n = 1, or `alone`: with no neighbour)."""
    ctx = multiprocessing.get_context("spawn")
    capacities = (1.0,) * n
    results: dict[int, tuple[float, float]] = {}
    # (slice on core 0, slice on core 1) run at once; node 2 of three shares core 0 with node 0
    pairs = {1: [(0,)], 2: [(0, 1)], 3: [(0, 1), (2, 1)]}[n]
    if alone:
        pairs = [(k,) if k % 2 == 0 else (None, k) for k in range(n)]
    for pair in pairs:
        start, out = ctx.Barrier(sum(k is not None for k in pair)), ctx.Queue()
        procs = [
            ctx.Process(target=_compute, args=(capacities, k, core, k == 0, start, out))
            for core, k in enumerate(pair)
            if k is not None
        ]
        for p in procs:
            p.start()
        for _ in procs:
            k, layer_us, head_us = out.get(timeout=300)
            results.setdefault(k, (layer_us, head_us))
        for p in procs:
            p.join()
    return results


def _thread_cpu(pid: int) -> tuple[float, float]:
    """(main thread, other threads) CPU seconds of process `pid` so far."""
    main = others = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            ns = int(f.read().split()[0])
        if int(tid) == pid:
            main += ns / 1e9
        else:
            others += ns / 1e9
    return main, others


def _peer(core: int, endpoint: str) -> None:
    os.sched_setaffinity(0, {core})  # before the context: its I/O thread inherits the core
    zmq_echo(endpoint)


def zmq_costs(
    n: int, hidden: int, relay_half_us: int | None = None, same_core: bool = False
) -> dict[str, float]:
    """Per sum, us: each process's main and I/O-thread CPU, and the sum's median wall time;
    peer k on core k mod 2 (`same_core`: on the hub's)."""
    os.sched_setaffinity(0, {0})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    relay = None
    host = "127.0.0.1"
    if relay_half_us is not None:
        host = "127.0.0.2"
        relay = start_relay(relay_half_us, host, "127.0.0.1", [port])
    mp = multiprocessing.get_context("spawn")
    peers = [
        mp.Process(
            target=_peer, args=(0 if same_core else k % 2, f"tcp://{host}:{port}"), daemon=True
        )
        for k in range(1, n)
    ]
    for p in peers:
        p.start()
    identities = []
    for _ in peers:
        if not sock.poll(30_000):
            raise RuntimeError("an echo process did not start")
        identities.append(sock.recv_multipart()[0])
    step = M.Step(step=0, layer=0, block=P.ATTENTION)
    frames = M.encode(step, (np.zeros((1, hidden), dtype=np.float32),))
    pids = [os.getpid(), *(p.pid for p in peers)]
    times = []
    for r in range(SUMS + 200):
        if r == 200:  # warm: now count
            before = [_thread_cpu(pid) for pid in pids]
        t = time.perf_counter()
        for identity in identities:
            sock.send_multipart([identity, *frames], copy=False)
        for _ in identities:
            sock.recv_multipart(copy=False)
        times.append(time.perf_counter() - t)
        time.sleep(GAP_S)
    after = [_thread_cpu(pid) for pid in pids]
    for identity in identities:
        sock.send_multipart([identity, b"stop"])
    for p in peers:
        p.join(timeout=5)
    if relay is not None:
        stop_relay(relay)
    sock.close(0)
    ctx.term()
    costs = {"sum_median_us": statistics.median(times[200:]) * 1e6}
    for k, (b, a) in enumerate(zip(before, after, strict=True)):
        costs[f"node{k}_main_us"] = (a[0] - b[0]) / SUMS * 1e6
        costs[f"node{k}_io_us"] = (a[1] - b[1]) / SUMS * 1e6
    return costs


def _floor(
    n: int,
    q: float,
    compute: dict[int, tuple[float, float]],
    hops: dict[str, float],
    one_device_ms: float,
    bar: float,
    n_layers: int,
    sums: int,
) -> None:
    head_us = compute[0][1]
    cpu_ms, io_ms, main_ms = [], [], []
    for k in range(n):
        layer_us = compute[k][0]
        io_us, main_us = hops[f"node{k}_io_us"], hops[f"node{k}_main_us"]
        cpu_ms.append((n_layers * layer_us + (head_us if k == 0 else 0.0) + sums * io_us) / 1e3)
        io_ms.append(sums * io_us / 1e3)
        main_ms.append(sums * main_us / 1e3)
        print(
            f"  {n} devices, node {k}: {layer_us:.0f} us a layer"
            + (f" + lm_head {head_us:.0f}" if k == 0 else "")
            + f"; ZeroMQ a sum: main thread {main_us:.0f} us, I/O thread {io_us:.0f} us"
        )
    floor_ms = sum(cpu_ms) / (n * q)
    with_calls_ms = (sum(cpu_ms) + sum(main_ms)) / (n * q)
    print(
        f"  {n} devices: CPU a token {' + '.join(f'{c:.2f}' for c in cpu_ms)} ms "
        f"(ZeroMQ I/O threads {sum(io_ms):.2f}); round trip {hops['sum_median_us']:.0f} us "
        f"median\n  floor {floor_ms:.2f} ms/token = {floor_ms / one_device_ms:.2f}x of one "
        f"device; with the send and receive calls ({sum(main_ms):.2f} ms) "
        f"{with_calls_ms:.2f} = {with_calls_ms / one_device_ms:.2f}x (bar {bar}x)"
    )


def main() -> None:
    one_device_ms = float(sys.argv[1])
    q = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
    bars = {2: 0.65, 3: 0.5}
    config = open_model(None).config
    n_layers, sums = config.n_layers, 2 * config.n_layers  # two sums a layer
    print(f"1 device at cpu={q}, measured by the bench: {one_device_ms:.2f} ms/token")
    whole = compute_costs(1)[0]
    print(
        f"1 device, warm: {whole[0]:.0f} us a layer, lm_head {whole[1]:.0f} us: "
        f"{(n_layers * whole[0] + whole[1]) / 1e3:.2f} ms of CPU a token"
    )
    for n in (2, 3):
        for placed in (True, False):
            compute = compute_costs(n, alone=not placed)
            hops = zmq_costs(n, config.hidden, same_core=not placed)
            print(
                "as the emulator places them:"
                if placed
                else "without the shared memory bus "
                "and the wake-ups across cores (each slice alone, the peers on one core):"
            )
            _floor(n, q, compute, hops, one_device_ms, bars[n], n_layers, sums)
    relayed = zmq_costs(2, config.hidden, relay_half_us=1000)
    print(
        f"rtt=2ms through the relay: a round trip {relayed['sum_median_us']:.0f} us median, "
        f"{relayed['sum_median_us'] - 2000:.0f} us beyond the rtt (bar 150)"
    )


if __name__ == "__main__":
    main()
