"""Int8 activations (models/activations.py): each integer kernel computes the NumPy reference's
arithmetic, the kernel check refuses an int8 candidate that rounds another way, and a cluster
with int8 activations answers the same greedy tokens on any node count."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
import torch

from edgetp.master.cluster.local import local_engine
from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import SamplingParams
from edgetp.memory.budget import MemoryOptions
from edgetp.models import kernels, native
from edgetp.models.activations import quantize_rows, rounded_rows
from edgetp.models.kernels import INT8_TUNED, PORTABLE
from edgetp.models.quant import FORMATS, random_blocks
from edgetp.node.kernel_probe import Probe

# (out, in, rows): one row (a decode step), a few, a prompt's many (4-row tiles and the rest)
SHAPES = ((7, 64, 1), (33, 640, 3), (8, 576, 4), (5, 160, 9), (9, 96, 2))
KERNELS = [("avx2", f) for f in INT8_TUNED] + [("portable", f) for f in PORTABLE]


def test_the_c_rounding_gives_the_reference_s_bytes():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 640), dtype=np.float32) * 3
    x[1, :32] = 0  # a block of zeros: d = 0, q = 0
    q = np.empty((5, 640), np.int8)
    d, s = np.empty((5, 20), np.float32), np.empty((5, 20), np.float32)
    fn = native.load("avx2").quantize_rows_q8
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3
    fn(x.ctypes.data, 5, 640, q.ctypes.data, d.ctypes.data, s.ctypes.data)
    want_q, want_d, want_s = quantize_rows(x)
    assert np.array_equal(q, want_q) and np.array_equal(d, want_d) and np.array_equal(s, want_s)
    assert np.abs(q).max() == 127 and not q[1, :32].any()


@pytest.mark.parametrize(("build", "fmt"), KERNELS)
def test_each_integer_kernel_equals_the_integer_reference(build, fmt):
    """The same rounded rows times the stored weights: each block's integer sum is exact, so
    only the float sum over blocks may differ (1e-5 of |x| |w|, a hundred times float32's)."""
    product = native.int8_activations if build == "avx2" else native.portable_int8_activations
    rng = np.random.default_rng(len(fmt))
    for out, inp, rows in SHAPES:
        w = random_blocks(FORMATS[fmt], out, inp, rng)
        x = rng.standard_normal((rows, inp), dtype=np.float32)
        exact = FORMATS[fmt].dequantize(w).double().numpy()
        rounded = rounded_rows(x)
        want = rounded @ exact.T
        bound = 1e-5 * np.outer(np.linalg.norm(rounded, axis=1), np.linalg.norm(exact, axis=1))
        assert (np.abs(product(x, w) - want) <= bound).all(), (fmt, out, inp, rows)


def per_row(x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None) -> np.ndarray:
    """Wrong: rounds each row to int8 with one scale for the whole row, not one a block."""
    d = np.abs(x).max(axis=1, keepdims=True) / 127
    return kernels.reference(np.rint(x / d).astype(np.float32) * d, w)


def test_the_check_refuses_an_int8_candidate_that_rounds_otherwise():
    """Held to the product of the rows as the int8 kernels round them, the exact product fails
    (the rounding's error is far beyond float32's) and so does a coarser rounding; the real
    integer kernel passes."""
    probe = Probe("q4_1", 64, 576, np.random.default_rng(0))
    for bucket in (0, 4):
        assert probe.check(native.int8_activations, bucket, time.perf_counter, "int8")[0] is None
        assert probe.check(native.f32_activations, bucket, time.perf_counter)[0] is None
        for wrong in (native.f32_activations, per_row):
            error, us = probe.check(wrong, bucket, time.perf_counter, "int8")
            assert error is not None and error.startswith("wrong") and us is None, wrong


@pytest.fixture
def int8_activations():
    """Int8 from a table of no choices (what earlier tests installed stays otherwise, and
    `kernel_set` names it)."""
    kernels.uninstall()
    kernels.set_activations("int8")
    yield
    kernels.set_activations("exact")
    kernels.uninstall()


def test_int8_greedy_tokens_are_the_same_on_every_node_count(
    smollm2, smollm2_tokenizer, shared_state, int8_activations
):
    """SmolLM2's Q4_1 file with int8 activations: each node rounds its rows alike (the blocks
    of 32 a split never cuts), so 1 and 3 nodes answer the same tokens."""
    prompt = smollm2_tokenizer.encode("The three primary colours are")
    answers = []
    for nodes in (1, 3):
        with local_engine(
            smollm2, nodes, state_dir=shared_state, context=96, memory=MemoryOptions(dtype="auto")
        ) as engine:
            seqs = start(engine, [prompt], [SamplingParams(max_tokens=24, ignore_eos=True)])
            for _ in stream(engine, smollm2_tokenizer, seqs):
                pass
            members = engine.remote.members if engine.remote else []
            figures = [engine.figures, *(m.figures for m in members)]
            answers.append(seqs[0].tokens)
        assert len(figures) == nodes
        chosen = [(f["activations"], f["kernels"]) for f in figures]
        assert all(a == "int8" and "c-int8" in k and "c-f32" not in k for a, k in chosen), chosen
    assert answers[0] == answers[1], answers
