"""What a device can do, measured where it runs: its speed, its memory budget, its disk, and
what a message of a sum costs it. A node measures at start (`measure_capacity`) and tells the
master in its HELLO; it measures its speed again when the master asks (MEASURE)."""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from pathlib import Path

import torch
import zmq

from edgetp.memory.budget import device_memory_budget
from edgetp.memory.files import measure_disk_read
from edgetp.memory.pages import weight_buffer
from edgetp.models.kernels import compute_clock, cpu_quota_cores, linear
from edgetp.node.messages import Capacity
from edgetp.node.security import Keypair, secure_server

log = logging.getLogger(__name__)

PROBE_WIDTH = 1024  # the probe matrix's columns
PROBE_MIN_BYTES = 16 << 20
PROBE_MAX_BYTES = 256 << 20  # a server's L3 can pass 100 MB: the probe is a start-up cost
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def _probe_bytes() -> int:
    """Twice the largest cache of this CPU, within PROBE_MIN_BYTES and PROBE_MAX_BYTES."""
    largest = 0
    for size in CPU_CACHES.glob("index*/size"):
        with contextlib.suppress(OSError, ValueError):  # sysfs prints sizes as "32768K"
            largest = max(largest, int(size.read_text().strip().removesuffix("K")) << 10)
    return min(PROBE_MAX_BYTES, max(PROBE_MIN_BYTES, 2 * largest))


def measure_capacity(
    threads: int,
    memory_budget: int | None = None,
    window: int | None = None,
    disk_dir: Path | None = None,
    speed: float | None = None,
) -> Capacity:
    """What this device can do: its speed (`measure_speed`, unless given), its memory budget,
    what a message costs it, and, when a window or a memory limit may make it stream its slice
    from `disk_dir`, how fast it reads that disk."""
    speed = measure_speed(threads) if speed is None else speed
    limited = memory_budget is not None or window is not None
    if memory_budget is None:
        under_limit = device_memory_budget()  # 0 where the limit leaves nothing: refused
        limited = limited or under_limit is not None
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory_budget = physical if under_limit is None else under_limit
    disk = measure_disk_read(disk_dir) if limited and disk_dir is not None else None
    disk = None if disk is None else round(disk, 3)
    message_s = round(measure_message_cost(), 7)
    return Capacity(int(memory_budget), threads, speed, window, disk, message_s)


PROBE_ROUNDS = 5  # a speed probe's runs, of PROBE_SECONDS each: it gives their median
PROBE_SECONDS = 0.05


def measure_speed(
    threads: int, rounds: int = PROBE_ROUNDS, seconds: float = PROBE_SECONDS
) -> float:
    """A quick (~0.25 s) measurement of how fast this device streams weights through a matmul,
    GB/s: the median of `rounds` runs of `seconds`.

    The matrix is twice the largest CPU cache: a decode step streams its weights from memory,
    and a matrix that fits in a cache shared with other cores measures what they do with it (a
    16 MB one moved 2x between starts on a 2-core VM). Under a CPU quota the loop is timed in
    CPU seconds and scaled by the quota: wall time there measures where in the quota's period
    the loop ran and who else ran on the core, not the device. What it reads still moves with
    its host's memory traffic (two processes probing at once on a 2-core VM: 11-17 GB/s over
    eight probes, yet within 10% of each other at each): the master has every node measure
    again at the same moment before it plans (MEASURE). Even so, two identical cpu=0.5 devices
    measured up to 1.35x apart in one 0.1 s run (their ratio's standard deviation 0.09-0.11
    over 40 pairs), and a plan made on such a pair is kept for as long as no other would be
    1.5x faster: the median of five runs of 0.05 s, 0.05-0.07 and 1.16x at the furthest
    (`docs/bench/probe_pairs.py`, docs/bench/README.md).
    """
    rows = _probe_bytes() // (4 * PROBE_WIDTH)
    # In the pages weights live in (memory.pages): the probe reads memory as a decode step does.
    w = weight_buffer(rows * PROBE_WIDTH * 4).view(torch.float32).view(rows, PROBE_WIDTH)
    w.fill_(0.5)
    x = torch.randn(1, PROBE_WIDTH)
    linear(x, w)
    quota = cpu_quota_cores()
    clock = compute_clock(threads)
    speeds = []
    for _ in range(rounds):
        wall_start, start, n = time.perf_counter(), clock(), 0
        while time.perf_counter() - wall_start < seconds:
            linear(x, w)
            n += 1
        speeds.append(n * w.numel() * 4 / (clock() - start) / 1e9)
    speed = statistics.median(speeds)
    if quota is not None:
        speed *= min(quota, threads)
    return round(speed, 2)


PROBE_PAYLOAD = 4096  # bytes a probe message carries: a hidden state of 1024 floats
PROBE_ROUND_TRIPS = 300
PROBE_TIMEOUT_MS = 5000  # a probe message not through by then: no figure, not a hang


def measure_message_cost() -> float:
    """This device's time to send or to receive one message of a sum: the CPU a ZeroMQ
    message costs its two threads (the caller's and the I/O thread's), over CURVE as the
    cluster's links are, over its cores' share under a CPU quota.

    A round trip between a ROUTER and a DEALER of one context, over TCP on the loopback, is
    four such messages (two sends, two receives), all on this device. On emulated cpu=0.5
    devices this is what a node's share of the sums costs it, next to its weights: the master
    handles every worker's messages of every sum, a worker one exchange (master.cluster.plan
    `with_messages`). Taken in CPU seconds: wall time would count the link and the quota's
    throttled periods. Free, it counts both threads as if on one core: a bound, where the I/O
    thread has a core of its own. Python's calls around each message count too (a few us of
    the ~40 measured here; a decode step's messages go through C)."""
    context = zmq.Context()  # its own I/O thread, as a node has
    context.setsockopt(zmq.RCVTIMEO, PROBE_TIMEOUT_MS)
    context.setsockopt(zmq.SNDTIMEO, PROBE_TIMEOUT_MS)
    try:
        server, client = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
        keys = Keypair(*zmq.curve_keypair())
        secure_server(server, keys)
        client.curve_serverkey = keys.public
        client.curve_publickey, client.curve_secretkey = zmq.curve_keypair()
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")
        payload = bytes(PROBE_PAYLOAD)

        def round_trip() -> None:
            client.send_multipart([b"probe", payload])
            server.send_multipart(server.recv_multipart())
            client.recv_multipart()

        for _ in range(20):  # the CURVE handshake and the first buffers
            round_trip()
        start = time.process_time()
        for _ in range(PROBE_ROUND_TRIPS):
            round_trip()
        cpu = time.process_time() - start
    except zmq.ZMQError as exc:  # no loopback, say: the plan then counts no messages for it
        log.warning("could not measure what a message costs this device (%s)", exc)
        return 0.0
    finally:
        context.destroy(linger=0)
    quota = cpu_quota_cores()
    return cpu / PROBE_ROUND_TRIPS / 4 / (min(quota, 1.0) if quota is not None else 1.0)
