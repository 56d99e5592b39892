"""This device: its state folder, and the kernels it admitted for the shapes it computes.

A kernel that is fast on one CPU can be silently wrong on another (torch's int8 kernel returns
garbage at some widths on one x86 vendor and crashes at others on the second). So before a node
multiplies anything, `prepare` makes sure every candidate kernel for every (dtype, rows, out, in)
it will use has been, on this device:

1. checked against a float64 product of the same stored weights, in a child process, so that a
   kernel that crashes is a rejected kernel and not a dead node (a kernel that crashes once is
   never used on this device again; one that disagrees is rejected for that shape and rows);
2. timed, if it passed, with the BLAS threads the node computes with (in CPU seconds under a CPU
   quota, `models.kernels.compute_clock`);

and installs the fastest that passed (`models.kernels.install`). The results are cached in the
state folder under a key of the CPU (model, flags and cgroup quota), Python, torch, NumPy and
the kernels' source, so a second start costs a file read. `edgetp kernels` shows the table.

The file is long (about 470 lines) because both halves of the check live here, the parent that
plans, caches and installs and the child that probes: they share one job format and one table.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from memory.files import atomic_write, default_state_dir
from models import kernels, quant
from models.dtypes import BLOCK_DTYPES, SHARD_DTYPES
from models.errors import ModelError
from models.kernels import CANDIDATES, ROW_BUCKETS, Candidate, dequantize, quantize
from models.layers import Slice, full_layer_shapes, slice_dtypes, slice_layer, slice_parts
from models.quant import FORMATS, random_blocks, stored_format, stored_size
from node import children

if TYPE_CHECKING:
    from models.source import ModelSource

log = logging.getLogger(__name__)

CHILD_TIMEOUT = 300.0  # s for one child's whole job: a kernel that hangs is a rejected kernel
PERIOD = 1021  # rows of random weights a tall probe matrix repeats
COMPARE_COLUMNS = 4096  # outputs a check compares at a time (float64: 2 MB a block at 64 rows)
TIMING_BUDGET = 0.01  # s of calls a timing takes, unless one call takes longer
CHECK_FOLDER = "edgetp-kernel-check-"  # + the caller's pid: a temporary folder for a check's output
MARK = "edgetp-kernel "  # the child's result lines start with this; anything else is noise

# Rows each bucket is checked at (both ends); it is timed at the last.
CHECK_ROWS = ((1,), (2,), (3, 4), (5, 8), (9, 64))
# Largest allowed |error| per element, as a fraction of sum(|x| |w|) over the row: float32
# accumulates exactly enough for 1e-4; the others round the input to 8 (bf16, int8's bf16
# input) or 11 (f16) bits first. Garbage (1e13, nan) fails any of these by far.
# Of |x| |w|, per shard dtype. The block formats are held to float32's: their products use the
# stored weights exactly, in float32 (rounding the input to 8 bits moved the top token; see
# models/csrc/blocks.c).
TOLERANCE = {
    "f32": 1e-4,
    "f16": 1e-2,
    "bf16": 2e-2,
    "int8": 2e-2,
    **dict.fromkeys(BLOCK_DTYPES, 1e-4),
}

Shape = tuple[str, int, int]  # (dtype name, out, in): one stored matrix


class KernelError(ModelError):
    """No candidate computes a shape right on this device."""


def fingerprint() -> dict[str, str]:
    """What a kernel's correctness and speed depend on, besides the shape."""
    cpu, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and cpu == platform.machine():
                    cpu = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_quota": kernels.cgroup_cpu_quota(),
        "flags": hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16],
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "code": _code_fingerprint(),
    }


def _code_fingerprint() -> str:
    """The source of the candidates and of their check: a cached verdict (a kernel rejected, a
    time) is about the code that earned it, so a new version of either checks again."""
    digest = hashlib.sha256()
    models = Path(kernels.__file__).parent
    sources = [models / "native.py", *sorted((models / "csrc").glob("*.c"))]
    for path in [Path(m.__file__) for m in (kernels, quant, sys.modules[__name__])] + sources:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _cache_path(cache_dir: Path, device: dict[str, str]) -> Path:
    key = hashlib.sha256(json.dumps(device, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / f"{key}.json"


def entry_key(shape: Shape, bucket: int, threads: int) -> str:
    dtype, out, inp = shape
    low, high = ROW_BUCKETS[bucket]
    rows = (
        str(low)
        if low == high
        else f"{low}+"
        if bucket == len(ROW_BUCKETS) - 1
        else f"{low}-{high}"
    )
    return f"{dtype} {out}x{inp} rows {rows} threads {threads}"


@dataclass
class Table:
    """Every measured (shape, rows, threads): each candidate's verdict and time."""

    device: dict[str, str]
    results: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    crashed: dict[str, str] = field(default_factory=dict)  # candidate -> what happened

    def chosen(self, key: str, among: Iterable[str] | None = None) -> str | None:
        """The fastest candidate that passed (of `among`, when given)."""
        allowed = None if among is None else set(among)
        timed = [
            (r["us"], name)
            for name, r in self.results.get(key, {}).items()
            if r["ok"] and name not in self.crashed and (allowed is None or name in allowed)
        ]
        return min(timed)[1] if timed else None


@dataclass
class Prepared:
    """What `prepare` did: the table, how many (candidate, shape, rows) it checked now (0 when
    all was cached), and how long the call took."""

    table: Table
    checked: int
    seconds: float


def prepare(
    shapes: Iterable[Shape],
    cache_dir: Path | None = None,
    candidates: dict[str, Sequence[Candidate]] | None = None,
    install: bool = True,
) -> Prepared:
    """Check and time what is missing for `shapes` at the BLAS threads in force, then install
    the fastest admitted kernel for each (shape, rows). Several processes of one device may
    call this at once: the first checks, the others wait and read its results."""
    started = time.perf_counter()
    candidates = candidates or CANDIDATES
    threads = kernels.blas_threads()
    cache_dir = cache_dir or default_state_dir() / "kernels"
    device = fingerprint()  # /proc and cgroup files: read once per call
    path = _cache_path(cache_dir, device)
    wanted = sorted({s for s in shapes if s[0] in candidates})
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = open(cache_dir / ".lock", "w")  # closed by the with below
    except OSError as exc:
        raise KernelError(
            f"cannot keep this device's kernel table in {cache_dir} ({exc.strerror}): "
            "set EDGETP_HOME to a folder you can write"
        ) from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        table = _read(path, device)
        todo = _unchecked(table, wanted, candidates, threads, fallbacks=False)
        try:
            if todo:
                _run_checks(todo, threads, table)
            # A fallback expands the weights at every product (a q4_1 lm_head's took 6.7 of its
            # 7.6 s of checks): it is checked only where every other kernel failed.
            last_resort = _unchecked(table, wanted, candidates, threads, fallbacks=True)
            todo += last_resort
            if last_resort:
                _run_checks(last_resort, threads, table)
        finally:  # what was checked is kept, also where a check was killed from outside
            if todo:
                atomic_write(path, json.dumps(vars(table), indent=1).encode())
        if todo:
            _log_disagreements(todo, table)
    choices = {}
    allow_fallback = os.environ.get(kernels.ALLOW_FALLBACK_ENV) == "1"
    for s in wanted:
        for b in range(len(ROW_BUCKETS)):
            key = entry_key(s, b, threads)
            chosen = _pick(table, key, candidates[s[0]])
            if chosen is None or (chosen.fallback and not allow_fallback):
                names = [c.name for c in candidates[s[0]]]
                raise KernelError(_unservable(s[0], key, table, names, chosen))
            choices[(s[0], b, s[1], s[2])] = chosen
    if install:
        kernels.install(choices)
    seconds = time.perf_counter() - started
    how = f"checked and timed {len(todo)}" if todo else "read from the cache"
    log.info("kernels for %d matrices %s in %.3f s", len(wanted), how, seconds)
    return Prepared(table, len(todo), seconds)


def _unchecked(
    table: Table,
    wanted: Sequence[Shape],
    candidates: dict[str, Sequence[Candidate]],
    threads: int,
    fallbacks: bool,
) -> list[dict[str, Any]]:
    """The checks `table` lacks for `wanted`: of the fallbacks (only where no other candidate
    passed) or of the others."""
    todo = []
    for s in wanted:
        others = [c.name for c in candidates[s[0]] if not c.fallback]
        for b in range(len(ROW_BUCKETS)):
            key = entry_key(s, b, threads)
            if fallbacks and table.chosen(key, others):
                continue
            todo += [
                {"candidate": c.name, "target": c.target, "shape": list(s), "bucket": b}
                for c in candidates[s[0]]
                if c.fallback == fallbacks
                and c.name not in table.crashed
                and (c.max_rows is None or ROW_BUCKETS[b][0] <= c.max_rows)
                and ROW_BUCKETS[b][1] >= c.min_rows
                and c.name not in table.results.get(key, {})
            ]
    return todo


def _pick(table: Table, key: str, candidates: Sequence[Candidate]) -> Candidate | None:
    """The fastest candidate that passed; a fallback only when no other did (never the fastest
    by a fluke of timing)."""
    name = table.chosen(key, (c.name for c in candidates if not c.fallback)) or table.chosen(key)
    return next((c for c in candidates if c.name == name), None)


def _unservable(
    dtype: str, key: str, table: Table, names: list[str], fallback: Candidate | None
) -> str:
    """Why `dtype` cannot run here (each candidate's verdict), and what the user can do."""
    results = table.results.get(key, {})
    verdicts = "; ".join(
        f"{n}: {table.crashed.get(n) or results[n]['error']}"
        for n in names
        if n in table.crashed or (n in results and not results[n]["ok"])
    )
    # A crash bans its kernel for good; one that was not the kernel's doing can be undone.
    recheck = (
        "; a crashed check counts for good: if something else ended it (memory full, a signal "
        "sent to it), run edgetp kernels --recheck"
        if any(n in table.crashed for n in names)
        else ""
    )
    if fallback is None:
        return (
            f"no kernel computes {key} right on this device ({verdicts}); try another --dtype"
            + recheck
        )
    return (
        f"--dtype {dtype} has no working kernel on this device ({verdicts}); choose another "
        f"--dtype (f32, f16, bf16 or int8), or set {kernels.ALLOW_FALLBACK_ENV}=1 to run it "
        f"on {fallback.name}, which expands the weights to float32 at every product (tens of "
        "times slower)" + recheck
    )


def _log_disagreements(checked: list[dict[str, Any]], table: Table) -> None:
    """One warning per candidate that gave wrong numbers somewhere (crashes are logged as
    they happen), naming the first shape where it did."""
    wrong: dict[str, list[str]] = {}
    for item in checked:
        key = item["id"].split("|", 1)[1]
        r = table.results.get(key, {}).get(item["candidate"])
        if r is not None and not r["ok"] and item["candidate"] not in table.crashed:
            wrong.setdefault(item["candidate"], []).append(f"{key}: {r['error']}")
    for name, where in wrong.items():
        log.warning(
            "kernel %s rejected on this device for %d of %d (shape, rows) checked, e.g. %s",
            name,
            len(where),
            sum(i["candidate"] == name for i in checked),
            where[0],
        )


def _read(path: Path, device: dict[str, str]) -> Table:
    try:
        d = json.loads(path.read_text())
        if d.get("device") == device:
            return Table(device, d["results"], d["crashed"])
    except (OSError, ValueError, KeyError):
        pass  # absent or unreadable: check again
    return Table(device)


def _run_checks(todo: list[dict[str, Any]], threads: int, table: Table) -> None:
    """Run the checks in child processes; a child that dies rejects the kernel it was in."""
    for item in todo:
        item["id"] = (
            f"{item['candidate']}|{entry_key(tuple(item['shape']), item['bucket'], threads)}"
        )
    pending = [t for t in todo if t["candidate"] not in table.crashed]
    while pending:
        stdout, code, stderr = _check_in_child({"threads": threads, "items": pending})
        begun = None
        for line in stdout.splitlines():
            if not line.startswith(MARK):
                continue
            msg = json.loads(line[len(MARK) :])
            if "begin" in msg:
                begun = msg["begin"]
                continue
            begun = None
            key = msg["id"].split("|", 1)[1]
            table.results.setdefault(key, {})[msg["candidate"]] = {
                "ok": msg["ok"],
                "error": msg["error"],
                "us": msg["us"],
            }
        finished = {
            t["id"]
            for t in pending
            if t["candidate"] in table.results.get(t["id"].split("|", 1)[1], {})
        }
        if code == 0 and len(finished) == len(pending):
            return
        crashed = next((t for t in pending if t["id"] == begun), None)
        if code == -signal.SIGKILL:  # no kernel dies so: the OOM killer or a user did it
            where = "the kernel check"
            if crashed is not None:
                candidate, key = crashed["id"].split("|", 1)
                where = f"the check of kernel {candidate} on {key}"
            raise KernelError(
                f"{where} was killed from outside (SIGKILL), most likely by the out-of-memory "
                "killer: the check needs 200-300 MB of its own (a new interpreter, its test "
                "matrices). Nothing was held against any kernel: start again with that much more "
                "memory free (or a memory limit that leaves it), and the start checks what is left"
            )
        if crashed is None:  # died before any check: the child itself is broken
            raise KernelError(f"the kernel check could not run on this device: {stderr.strip()}")
        key = crashed["id"].split("|", 1)[1]
        how = _death(code, stderr)
        what = f"{how} on {key}"
        log.warning("kernel %s rejected on this device: %s", crashed["candidate"], what)
        table.crashed[crashed["candidate"]] = what
        table.results.setdefault(key, {})[crashed["candidate"]] = {
            "ok": False,
            "error": how,
            "us": None,
        }
        pending = [
            t for t in pending if t["id"] not in finished and t["candidate"] not in table.crashed
        ]


def _check_in_child(job: dict[str, Any]) -> tuple[str, int | None, str]:
    """`job` checked in a child process: what it printed, its exit code (None: killed for
    taking longer than CHILD_TIMEOUT) and its error output."""
    # A caller killed mid-check leaves its folder: removed once its pid is gone and it is older
    # than any check lasts (a /tmp shared with another pid namespace names pids this one cannot
    # see).
    for stale in Path(tempfile.gettempdir()).glob(f"{CHECK_FOLDER}*-*"):
        pid = stale.name[len(CHECK_FOLDER) :].split("-", 1)[0]
        with contextlib.suppress(OSError):
            old = time.time() - stale.stat().st_mtime > 2 * CHILD_TIMEOUT
            if old and pid.isdigit() and not children.alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"{CHECK_FOLDER}{os.getpid()}-") as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        # Where the check does not fit beside its node, it is the one killed, and the node
        # says so (`_run_checks`).
        job_args = (job, str(out), str(err))
        child = children.start(_child, job_args, "edgetp-kernels", oom_score_adj=children.OOM_CHECK)
        try:
            code: int | None = child.wait(CHILD_TIMEOUT)
            stderr = err.read_text(errors="replace") if err.exists() else ""
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            code, stderr = None, f"no answer within {CHILD_TIMEOUT:.0f} s"
        return (out.read_text(errors="replace") if out.exists() else ""), code, stderr


def _death(code: int | None, stderr: str) -> str:
    if code is None:
        return stderr
    if code < 0:
        try:
            return f"crashed ({signal.Signals(-code).name})"
        except ValueError:
            return f"crashed (signal {-code})"
    tail = stderr.strip().splitlines()[-1:] or [""]
    return f"crashed (exit {code}: {tail[0][:200]})"


# -- the child -----------------------------------------------------------------------------------


class _Probe:
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
        fmt = FORMATS.get(dtype)
        if fmt is not None and not fmt.can_quantize:  # Q2_K, Q3_K, IQ4_XS: random blocks
            stored = {"": random_blocks(fmt, period, inp, gen)}
        else:
            stored = quantize(torch.from_numpy(block), dtype)
        self.wd = dequantize(stored[""], stored.get(kernels.SCALE_SUFFIX)).double().numpy()
        self.tile = np.arange(out) % period
        self.stored = {k: v[self.tile].contiguous() for k, v in stored.items()}
        self.norms = np.linalg.norm(self.wd, axis=1)  # of the period's rows
        self.gen = gen
        self.cases: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
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

    def error(self, got: np.ndarray, rows: int) -> str | None:
        """Why `got` is not the product of the case of `rows` with this matrix, or None. An
        element may be off by TOLERANCE of |x| |w| (by Cauchy-Schwarz, norms bound the sum of
        |x_i w_i|). Compared COMPARE_COLUMNS outputs at a time: a tall matrix's product, its
        bound and its error in float64 at once held more than the stored matrix (the check of
        SmolLM2's q8_0 lm_head peaked at 305 MB, 153 of them beyond the interpreter's)."""
        if got.shape != (rows, self.out):
            return f"wrong shape {got.shape} at {rows} rows"
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
        self, kernel: kernels.Kernel, bucket: int, clock: Callable[[], float]
    ) -> tuple[str | None, float | None]:
        """(error or None, median microseconds per call at the bucket's largest check rows, by
        `clock`: `kernels.compute_clock`'s)."""
        w, scale = self.stored[""], self.stored.get(kernels.SCALE_SUFFIX)
        for rows in CHECK_ROWS[bucket]:  # the last one is also the warm-up for the timing
            x = self.case(rows)[0]
            started = clock()
            got = np.asarray(kernel(x, w, scale))
            took = clock() - started
            if (error := self.error(got, rows)) is not None:
                return error, None
        # The warm-up ran at the rows timed. A call longer than the timing's budget is timed by
        # it (a tall lm_head: 10-400 ms a call, at every bucket and candidate: two calls more
        # were a quarter of a check's time); a shorter one may have been a cold first call.
        times = [took]
        if took < TIMING_BUDGET:
            times, began = [], time.perf_counter()
            while not times or (time.perf_counter() - began < TIMING_BUDGET and len(times) < 20):
                t = clock()
                kernel(x, w, scale)
                times.append(clock() - t)
                if times[0] > 3 * self.best.get(bucket, float("inf")):
                    break  # far behind the fastest: one call says enough
        median = float(np.median(times))
        self.best[bucket] = min(median, self.best.get(bucket, float("inf")))
        return None, median * 1e6


def _child(job: dict[str, Any], out: str, err: str) -> None:
    """Check `job`'s items one by one, printing a line as each begins and ends to `out`: the
    parent tells a crash, and the kernel it was in, from the last one."""
    children.redirect_output(out, err)
    kernels.limit_blas(job["threads"])
    clock = kernels.compute_clock(job["threads"])
    gen = np.random.default_rng(0)
    probe: _Probe | None = None
    loaded: dict[str, kernels.Kernel] = {}
    for item in job["items"]:
        dtype, out, inp = item["shape"]
        if probe is None or (probe.dtype, probe.out, probe.inp) != (dtype, out, inp):
            probe = None  # one shape's weights at a time
            probe = _Probe(dtype, out, inp, gen)
        if item["candidate"] not in loaded:
            loaded[item["candidate"]] = Candidate(item["candidate"], item["target"]).load()
        print(MARK + json.dumps({"begin": item["id"]}), flush=True)
        try:
            error, us = probe.check(loaded[item["candidate"]], item["bucket"], clock)
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


def matrix_shapes(
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], names: Iterable[str]
) -> list[Shape]:
    """The (dtype, out, in) of the named matrices among `specs` (name -> dtype, shape). An empty
    matrix is never multiplied (its block's partial is zero), so it needs no kernel."""
    shapes = []
    for n in names:
        if n not in specs or not all(specs[n][1]):
            continue
        dtype, shape = specs[n]
        found = stored_format(dtype, shape)
        if found is None and dtype not in kernels.DTYPE_NAMES:
            continue
        name = found.name if found is not None else kernels.DTYPE_NAMES[dtype]
        shapes.append((name, *stored_size(dtype, shape)))
    return shapes


def plan_shapes(
    source: ModelSource,
    slices: Sequence[Slice],
    dtype: str,
    head_rows: Sequence[tuple[int, int]] = (),
) -> list[Shape]:
    """Every matrix a plan's nodes multiply, the lm_head (whole, or each node's `head_rows`)
    included, stored as the split stores them for `dtype`: cut from shape-only tensors by the
    one function that cuts layers."""
    config = source.config
    full = {n: torch.empty(s, device="meta") for n, s in full_layer_shapes(config).items()}
    heads = [b - a for a, b in head_rows if b > a] or [config.vocab_size]
    shapes = [(source.head_dtype(dtype), rows, config.hidden) for rows in heads]
    layer_dtypes = {tuple(source.matrix_dtypes(i, dtype).items()) for i in range(config.n_layers)}
    for s in slices:
        cut, parts = slice_layer(config, full, s), slice_parts(config, s)
        for dtypes in layer_dtypes:
            kept = slice_dtypes(parts, dict(dtypes))
            shapes += [(d, *cut[n].shape) for n, d in kept.items() if all(cut[n].shape)]
    return sorted(set(shapes))


def describe(prepared: Prepared, shapes: Iterable[Shape], threads: int) -> str:
    """The table as text: per dtype, each candidate's time per call or why it was rejected;
    the chosen one is starred."""
    t = prepared.table
    lines = [
        f"device: {t.device['cpu']} (flags {t.device['flags']}), {t.device['machine']}, "
        f"python {t.device['python']}, torch {t.device['torch']}, numpy {t.device['numpy']}; "
        f"{threads} BLAS thread(s)",
        f"checked and timed now: {prepared.checked} in {prepared.seconds:.1f} s"
        if prepared.checked
        else f"read from the cache in {prepared.seconds * 1000:.0f} ms",
    ]
    for dtype in sorted({s[0] for s in shapes}, key=SHARD_DTYPES.index):
        names = [c.name for c in CANDIDATES[dtype]]
        lines += ["", f"{dtype}: time per call (us); * chosen", f"{'matrix':>12} {'rows':>5}"]
        lines[-1] += "".join(f"{n:>16}" for n in names)
        for shape in sorted(s for s in shapes if s[0] == dtype):
            for b in range(len(ROW_BUCKETS)):
                key = entry_key(shape, b, threads)
                picked = _pick(t, key, CANDIDATES[dtype])
                chosen, results = picked and picked.name, t.results.get(key, {})
                row = f"{shape[1]:>6}x{shape[2]:<5} {key.split(' rows ')[1].split()[0]:>5}"
                for n in names:
                    r = results.get(n)
                    if r is None:
                        cell = "crashed" if n in t.crashed else "-"
                    elif r["ok"]:
                        cell = ("*" if n == chosen else "") + f"{r['us']:.0f}"
                    else:
                        cell = "wrong" if r["error"].startswith("wrong") else "crashed"
                    row += f"{cell:>16}"
                lines.append(row)
    for name, what in t.crashed.items():
        lines.append(f"rejected on this device: {name}: {what}")
    lines.append("'-': not a candidate at those rows, or a fallback where another passed")
    return "\n".join(lines)
