"""The wire protocol's constants and socket habits, in one place; its messages are node/messages.py.

node -> master: HELLO, FETCH, READY, PARTIAL, MEASURED, ECHOED, LEAVE, ERROR
master -> node: WELCOME, REFUSE, ACCEPTED, CHUNK, STEP, STANDBY, MEASURE, ECHO, BYE
both ways, on the heartbeat sockets: HEARTBEAT
"""

from __future__ import annotations

import os
import time
from typing import Final, Literal

import zmq

# 2: a decode step's hidden state travels as rows (B, D); 3: HEAD; 4: MEASURE, ECHO; 5: STANDBY;
# 6: typed messages (node/messages.py): the lm_head's shard nested in WELCOME, BYE's rejoin;
# 7: a mixture of experts: STEP's experts and expert_weights for an FFN block, the config's
# n_experts, n_experts_used, norm_topk_prob in WELCOME; 8: the config's unrotated_layers
# (SmolLM3), n_shared (Qwen2-MoE), its gated DeltaNet fields (Qwen3.5, Qwen3-Next) and Gemma
# 4's: a node of 7 would stop at the keys it does not know; 9: SPLIT and SPLIT-DONE (a worker
# splits its own share of a model it reads by byte ranges); 11: STEP's batch names the slots
# whose first positions a sequence copies (`StepBatch.sources`): a node of 10 would not copy them;
# 12: a block's STEP and PARTIAL may carry float16 (`WIRES`), which a node of 11 refuses
PROTOCOL_VERSION = 12
DEFAULT_PORT = 7470

# What a STEP asks a node to compute: the two blocks (two sums) of a layer, or its rows of the
# lm_head after the last layer.
Block = Literal["attn", "ffn", "head"]
ATTENTION: Final = "attn"
FFN: Final = "ffn"
HEAD: Final = "head"
# What a block's hidden state and the partials back travel as (`MemoryOptions.wire`): float32, or
# float16 at half the bytes; the lm_head's rows and logits are float32 always.
WIRES = ("float32", "float16")

HEARTBEAT_INTERVAL = 0.25  # seconds between heartbeats, each way
HEARTBEAT_LIVENESS = 8  # missed heartbeats before a peer is taken for dead (2 s)
CHUNK_SIZE = 1 << 20  # shard transfer chunk
# Mid-step, an answer is usually a fraction of a millisecond away: checking for it in a loop
# this long before sleeping in poll() saves the wake-up, which costs more than the hop itself
# (measured on loopback: 157 us -> 85 us per round trip beyond compute).
SPIN_SECONDS = 0.001


def spin_seconds() -> float:
    """How long this process checks for an answer in a loop before sleeping: SPIN_SECONDS, or
    none under a CPU quota (a container, an emulated device), where the loop would spend the
    quota the compute needs and the throttling it brings costs more than a wake-up. Read when a
    socket's owner starts: the master of a local cluster enters its device's cgroup first."""
    from edgetp.models.kernels import (
        cgroup_cpu_quota,  # torch-free callers of this module never ask
    )

    return SPIN_SECONDS if cgroup_cpu_quota() == "none" else 0.0


def on_one_core() -> bool:
    """Whether this process may run on one core only (an emulated device's cpuset, a one-core
    machine), where ZeroMQ's I/O thread takes turns with the thread that hands it messages. Such
    a sender yields the core after a block's sends, or the STEPs could wait out its own compute.
    Read when a socket's owner starts, as `spin_seconds` is."""
    return len(os.sched_getaffinity(0)) == 1


def wait_readable(sock: zmq.Socket, timeout_ms: int, spin: float) -> bool:
    """True when `sock` has a message within `timeout_ms`; check in a loop for `spin` seconds
    first (`spin_seconds()`, or 0 for none)."""
    end = time.perf_counter() + spin
    readable = [(sock, zmq.POLLIN)]  # zmq_poll itself: sock.poll builds a Poller each call
    while time.perf_counter() < end:
        if zmq.zmq_poll(readable, 0):
            return True
        os.sched_yield()  # a process with work to do on this core goes first
    return bool(zmq.zmq_poll(readable, timeout_ms))
