"""The kernel check's child process: each candidate kernel held against a float64 product.

`node.device.prepare` runs the checks here, in a process of their own, so that a kernel that
crashes is a rejected kernel and not a dead node. `run` checks a job's items one by one on
random weights of each shape (`Probe`), printing a line as each begins and ends; the parent
tells a crash, and the kernel it was in, from the last line it read.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from edgetp.models import kernels
from edgetp.models.activations import rounded_rows
from edgetp.models.dtypes import BLOCK_DTYPES
from edgetp.models.kernels import Candidate, dequantize, quantize
from edgetp.models.quant import FORMATS
from edgetp.node import children

PERIOD = 1021  # rows of random weights a tall probe matrix repeats
COMPARE_COLUMNS = 4096  # outputs a check compares at a time (float64: 2 MB a block at 64 rows)
TIMING_BUDGET = 0.01  # s of calls a timing takes, unless one call takes longer
MARK = "edgetp-kernel "  # the child's result lines start with this; anything else is noise

# Rows each bucket is checked at (both ends); it is timed at the last.
CHECK_ROWS = ((1,), (2,), (3, 4), (5, 8), (9, 16), (17, 64))
# Largest allowed |error| per element, as a fraction of sum(|x| |w|) over the row: float32
# accumulates exactly enough for 1e-4; the others round the input to 8 (bf16, int8's bf16
# input) or 11 (f16) bits first. Garbage (1e13, nan) fails any of these by far.
# Of |x| |w|, per shard dtype. The block formats are held to float32's: their products use the
# stored weights exactly, in float32; an int8-activation candidate is held to the same, against
# the product of the rows as it rounds them (`Probe.rounded_case`).
TOLERANCE = {
    "f32": 1e-4,
    "f16": 1e-2,
    "bf16": 2e-2,
    "int8": 2e-2,
    **dict.fromkeys(BLOCK_DTYPES, 1e-4),
}


class Probe:
    """One stored matrix of random weights, with the float64 products of its distinct rows per
    row count: each is computed once and held against every candidate."""

    def __init__(self, dtype: str, out: int, inp: int, gen: np.random.Generator) -> None:
        # A tall matrix (an lm_head) repeats a block of PERIOD random rows: drawing, rounding
        # and multiplying 49152 of them in float64 took seconds; each output still has its row.
        period = out if out <= 4 * PERIOD else PERIOD
        block = gen.standard_normal((period, inp), dtype=np.float32) / np.float32(
            max(inp, 1) ** 0.5
        )
        self.dtype, self.out, self.inp = dtype, out, inp
        stored = quantize(torch.from_numpy(block), dtype)
        self.wd = dequantize(stored[""], stored.get(kernels.SCALE_SUFFIX)).double().numpy()
        self.tile = np.arange(out) % period
        self.stored = {k: v[self.tile].contiguous() for k, v in stored.items()}
        self.norms = np.linalg.norm(self.wd, axis=1)  # of the period's rows
        self.gen = gen
        self.cases: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.rounded: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the same for int8 rows
        self.best: dict[int, float] = {}  # bucket -> fastest time so far (s)

    def case(self, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Input rows, their float64 products with the period's rows, and their norms."""
        if rows not in self.cases:
            x = self.gen.standard_normal((rows, self.inp), dtype=np.float32)
            x64 = x.astype(np.float64)
            # On one BLAS thread: BLAS's threads spin for ~0.1 s after a product, and the
            # OpenMP kernels timed next (the block formats') then waited ~4 ms a call for a core.
            with threadpool_limits(1, user_api="blas"):
                products = x64 @ self.wd.T
            self.cases[rows] = (x, products, np.linalg.norm(x64, axis=1))
        return self.cases[rows]

    def rounded_case(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """The products and norms an int8-activation kernel is held to: of the case's rows as
        it rounds them (models/activations.py). Its error is that rounding's, which is no
        float noise (~0.5 % of a product); held to the rounded rows' product, it is again
        float32's, and a kernel that rounds another way, or not at all, fails by far."""
        if rows not in self.rounded:
            x = rounded_rows(self.case(rows)[0], FORMATS[self.dtype].block_values)
            with threadpool_limits(1, user_api="blas"):
                products = x @ self.wd.T
            self.rounded[rows] = (products, np.linalg.norm(x, axis=1))
        return self.rounded[rows]

    def error(self, got: np.ndarray, rows: int, activations: str = "exact") -> str | None:
        """Why `got` is not the product of the case of `rows` with this matrix, or None. An
        element may be off by TOLERANCE of |x| |w| (by Cauchy-Schwarz, norms bound the sum of
        |x_i w_i|). Compared COMPARE_COLUMNS outputs at a time: a tall matrix's product, its
        bound and its error in float64 at once held more than the stored matrix (the check of
        SmolLM2's q8_0 lm_head peaked at 305 MB, 153 of them beyond the interpreter's)."""
        if got.shape != (rows, self.out):
            return f"wrong shape {got.shape} at {rows} rows"
        if activations == "int8":
            products, x_norms = self.rounded_case(rows)
        else:
            _, products, x_norms = self.case(rows)
        wrong, worst = False, math.nan  # the largest error that is a number, as nanmax
        for first in range(0, self.out, COMPARE_COLUMNS):
            period_rows = self.tile[first : first + COMPARE_COLUMNS]
            want = products[:, period_rows]
            bound = TOLERANCE[self.dtype] * np.outer(x_norms, self.norms[period_rows]) + 1e-6
            error = np.abs(got[:, first : first + COMPARE_COLUMNS].astype(np.float64) - want)
            if not np.all(error <= bound):  # also false for nan
                wrong = True
                if not np.isnan(error).all():
                    worst = np.fmax(worst, float(np.nanmax(error)))
        if not wrong:
            return None
        return f"wrong: |error| up to {worst:.3g} at {rows} rows"

    def check(
        self,
        kernel: kernels.Kernel,
        bucket: int,
        clock: Callable[[], float],
        activations: str = "exact",
    ) -> tuple[str | None, float | None]:
        """(error or None, the fastest call's microseconds at the bucket's largest check rows, by
        `clock`: `kernels.compute_clock`'s)."""
        w, scale = self.stored[""], self.stored.get(kernels.SCALE_SUFFIX)
        for rows in CHECK_ROWS[bucket]:  # the last one is also the warm-up for the timing
            x = self.case(rows)[0]
            started = clock()
            got = np.asarray(kernel(x, w, scale))
            took = clock() - started
            if (error := self.error(got, rows, activations)) is not None:
                return error, None
        # The warm-up ran at the rows timed. A call longer than the timing's budget is timed by
        # it (a tall lm_head: 10-400 ms a call, at every bucket and candidate: two calls more
        # were a quarter of a check's time); a shorter one may have been a cold first call.
        # The fastest call is the kernel's time: a call another process interrupted only takes
        # longer, so on a loaded machine (the suite, a device serving) the median of a 10 ms
        # window, or a single slow first call cutting the timing short, crowned slower kernels
        # (a 16-row product timed at 13.8 ms, 90x its 0.15 ms, lost to one 6x slower).
        times = [took]
        if took < TIMING_BUDGET:
            times, began = [], time.perf_counter()
            while not times or (time.perf_counter() - began < TIMING_BUDGET and len(times) < 20):
                t = clock()
                kernel(x, w, scale)
                times.append(clock() - t)
                if len(times) >= 2 and min(times) > 3 * self.best.get(bucket, float("inf")):
                    break  # far behind the fastest in two calls: enough said
        fastest = min(times)
        self.best[bucket] = min(fastest, self.best.get(bucket, float("inf")))
        return None, fastest * 1e6


def run(job: dict[str, Any], out: str, err: str) -> None:
    """Check `job`'s items one by one, printing a line as each begins and ends to `out`: the
    parent tells a crash, and the kernel it was in, from the last one."""
    children.redirect_output(out, err)
    kernels.limit_blas(job["threads"])
    clock = kernels.compute_clock(job["threads"])
    gen = np.random.default_rng(0)
    probe: Probe | None = None
    loaded: dict[str, kernels.Kernel] = {}
    for item in job["items"]:
        dtype, rows_out, inp = item["shape"]  # (not `out`: the output file's name)
        if probe is None or (probe.dtype, probe.out, probe.inp) != (dtype, rows_out, inp):
            probe = None  # one shape's weights at a time
            probe = Probe(dtype, rows_out, inp, gen)
        if item["candidate"] not in loaded:
            loaded[item["candidate"]] = Candidate(item["candidate"], item["target"]).load()
        print(MARK + json.dumps({"begin": item["id"]}), flush=True)
        try:
            kernel, activations = loaded[item["candidate"]], item.get("activations", "exact")
            error, us = probe.check(kernel, item["bucket"], clock, activations)
        except Exception as exc:  # a kernel that raises is a rejected kernel
            error, us = f"raised {type(exc).__name__}: {exc}"[:300], None
        result = {
            "id": item["id"],
            "candidate": item["candidate"],
            "ok": error is None,
            "error": error,
            "us": us,
        }
        print(MARK + json.dumps(result), flush=True)
