"""Malformed messages for the wire's decoders: what a confused, buggy or hostile peer holding the
token might send. Each generator returns one message's frames; every one of them is wrong in at
least one way its reader must catch (nothing here is a valid message by accident)."""

from __future__ import annotations

import random

import msgpack
import numpy as np

from edgetp.node import protocol as P

WRONG = [None, "x", -1, 2**62, 1.5, [], {}, b"\xff", {"a": [1, {"b": None}]}]


def to_master(rng: random.Random) -> list[bytes]:
    """A message a node might send the master: random bytes, a cut header, ops with fields
    missing or of the wrong type, tensors listed but not sent."""
    capacity = {"memory_budget": 1, "cores": 1, "speed": 1.0}
    kind = rng.randrange(5)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
    if kind == 1:
        whole = msgpack.packb({"op": "hello", "capacity": capacity, "name": "cut"})
        return [whole[: rng.randrange(len(whole))]]
    if kind == 2:  # an op the master knows, its fields replaced by the wrong things
        op = rng.choice(
            ["hello", "fetch", "ready", "leave", "partial", "measured", "heartbeat", "nope", 7]
        )
        header = {"op": op, "version": P.PROTOCOL_VERSION, "name": "g", "capacity": capacity,
                  "sha256": "0" * 64, "offset": 0, "size": 1, "step": 1, "layer": 0}  # fmt: skip
        for key in rng.sample(sorted(header, key=str), rng.randrange(1, 4)):
            if rng.random() < 0.3:
                del header[key]
            else:
                header[key] = rng.choice(WRONG)
        if op == "hello" and rng.random() < 0.5:
            header["capacity"] = {k: rng.choice(WRONG) for k in capacity}
        return [msgpack.packb(header, use_bin_type=True)]
    if kind == 3:  # tensors listed that do not come, or come ragged
        header = {"op": "partial", "step": 1, "layer": 0, "block": "attn",
                  "tensors": [["float32", [2, rng.choice([3, -1, 2**40])]]]}  # fmt: skip
        return [msgpack.packb(header)] + [rng.randbytes(rng.randrange(0, 40))] * rng.randrange(2)
    return [msgpack.packb(rng.choice(WRONG + [["hello"], "hello"]), use_bin_type=True)]


def to_node(rng: random.Random, n_layers: int, hidden: int, slots: int, context: int) -> list:
    """A message a node might get from its master that it cannot act on, for a node of
    `n_layers` layers of width `hidden` with `slots` KV-cache slots of `context` positions:
    random bytes, a cut header, a STEP wrong in one or more of its layer, block, step number,
    batch or hidden state, a WELCOME without a usable plan, an op a serving node does not take,
    a STEP's frames in the wrong order, an oversized one."""
    kind = rng.randrange(8)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
    if kind == 6:  # a wrong STEP's frames reordered: its tensor first
        return list(reversed(_bad_step(rng, n_layers, hidden, slots, context)))
    if kind == 7:  # oversized: a hidden state a thousand times too wide, or a 1 MB header
        if rng.random() < 0.5:
            header = {"op": "step", "step": 1, "layer": 0, "block": P.FFN,
                      "batch": {"slots": [0], "starts": [0], "lengths": [1]}}  # fmt: skip
            return _step_frames(header, np.zeros((1, hidden * 1000), np.float32))
        return [msgpack.packb({"op": "step", "layer": "x" * (1 << 20)}, use_bin_type=True)]
    if kind == 1:
        whole = _step_frames({"op": "step", "step": 1, "layer": 0, "block": P.ATTENTION},
                             np.zeros((1, hidden), np.float32))  # fmt: skip
        return [whole[0][: rng.randrange(len(whole[0]))], *whole[1:]]
    if kind in (2, 3):
        return _bad_step(rng, n_layers, hidden, slots, context)
    if kind == 4:  # a re-plan whose plan cannot be read: never a valid config
        header = {"op": "welcome"}
        for key in ("config", "slice", "shards", "context", "slots", "window"):
            if rng.random() < 0.7:
                header[key] = rng.choice(WRONG)
        return [msgpack.packb(header, use_bin_type=True)]
    op = rng.choice(["chunk", "accepted", "refuse", "heartbeat", "hello", "partial", "nope", 7])
    if rng.random() < 0.2:
        return [msgpack.packb(rng.choice(WRONG + [["step"], "step"]), use_bin_type=True)]
    return [msgpack.packb({"op": op, "step": 1}, use_bin_type=True)]


def _bad_step(rng: random.Random, n_layers: int, hidden: int, slots: int, context: int) -> list:
    header = {"op": "step", "step": 1, "layer": rng.randrange(n_layers), "block": P.FFN,
              "batch": {"slots": [0], "starts": [0], "lengths": [1]}}  # fmt: skip
    h = np.zeros((1, hidden), np.float32)
    bad_batches = [
        {"slots": [0]},  # keys missing
        {"slots": [slots], "starts": [0], "lengths": [1]},  # no such slot
        {"slots": [0], "starts": [-1], "lengths": [1]},
        {"slots": [0], "starts": [0], "lengths": [0]},
        {"slots": [0], "starts": [context], "lengths": [1]},  # past the context
        {"slots": [0, 0], "starts": [0], "lengths": [1]},  # ragged
        {"slots": [0.5], "starts": [0], "lengths": [1]},
        {"slots": [], "starts": [], "lengths": []},
        [0, 0, 1],
        "x",  # (a null batch is no batch: a step under way has one)
    ]
    faults = rng.sample(["layer", "block", "step", "batch", "hidden", "head"], rng.randrange(1, 4))
    for fault in faults:
        if fault == "layer":
            header["layer"] = rng.choice([-1, n_layers, 2**40, "0", None, 1.5, []])
        elif fault == "block":
            header["block"] = rng.choice(["x", "", None, 7, [P.FFN]])
        elif fault == "step":
            header["step"] = rng.choice([None, "x", [], {}])
        elif fault == "batch":
            header["batch"] = rng.choice(bad_batches)
        elif fault == "head":  # the lm_head's rows: never more rows than the step has tokens
            header["block"] = P.HEAD
            header["layer"] = rng.choice([n_layers, n_layers, 0, n_layers - 1, n_layers + 1])
            h = np.zeros(rng.choice([(2, hidden), (0, hidden), (1, hidden - 1)]), np.float32)
        else:
            h = rng.choice(
                [
                    np.zeros((1, hidden + 1), np.float32),
                    np.zeros((2, hidden), np.float32),  # two rows for a batch of one
                    np.zeros((1, 1, hidden), np.float32),  # a prefill's shape in a decode step
                    np.zeros((1, hidden), np.float64),  # a dtype the wire does not carry
                    None,  # no hidden state at all
                ]
            )
    if h is None:
        return [msgpack.packb(header, use_bin_type=True)]
    frames = _step_frames(header, h)
    if rng.random() < 0.2 and frames[1]:  # the frame does not hold what the header says
        frames[1] = frames[1][: rng.randrange(len(frames[1]))]
    return frames


def _step_frames(header: dict, h: np.ndarray) -> list[bytes]:
    """The frames `M.encode` would make, for any dtype (it sends only the wire's own)."""
    spec = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64"}[h.dtype]
    header = dict(header, tensors=[[spec, list(h.shape)]])
    return [msgpack.packb(header, use_bin_type=True), h.tobytes()]
