"""The wire format: what goes in comes out, and a malformed message is a ProtocolError."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
import torch

from node import protocol as P


def test_rows_and_tensors_round_trip_without_a_copy():
    rows = np.arange(2 * 576, dtype=np.float32).reshape(2, 576)
    prefill = torch.randn(2, 3, 576)
    frames = [bytes(f) for f in P.encode({"op": P.STEP, "layer": 4}, (rows, prefill))]
    header, (got_rows, got_prefill) = P.decode(frames)
    assert header["op"] == P.STEP and header["layer"] == 4
    np.testing.assert_array_equal(got_rows, rows)
    np.testing.assert_array_equal(got_prefill, prefill.numpy())
    assert not got_rows.flags.writeable  # a view of the message, not a copy


def _step(tensors: object, *frames: bytes) -> list[bytes]:
    return [msgpack.packb({"op": P.STEP, "tensors": tensors}), *frames]


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"\xc1"],  # not msgpack
        [msgpack.packb([1, 2])],  # not a dict with an op
        _step([["float32", [2]]]),  # a tensor listed, no frame
        _step([["float64", [1]]], bytes(8)),  # a dtype the wire does not carry
        _step([["float32", [3]]], bytes(8)),  # fewer values than the shape
        _step([["float32", [2]]], bytes(7)),  # a ragged frame
        _step([["float32", ["a"]]], bytes(4)),  # a shape that is not numbers
        _step([["float32", [-1, -1]]], bytes(4)),  # negative sizes
        _step(["float32"], bytes(4)),  # a spec that is not [dtype, shape]
        _step(7, bytes(4)),  # a tensor list that is not a list
    ],
    ids=lambda f: repr(f)[:40],
)
def test_a_malformed_message_is_a_protocol_error(frames):
    with pytest.raises(P.ProtocolError):
        P.decode(frames)


def test_only_a_process_held_to_one_core_yields_it_after_its_sends():
    cores = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cores)})
        assert P.on_one_core()
    finally:
        os.sched_setaffinity(0, cores)
    assert P.on_one_core() == (len(cores) == 1)
