"""This device: its state folder, and the kernels it admitted for the shapes it computes.

A kernel that is fast on one CPU can be silently wrong on another (torch's int8 kernel returns
garbage at some widths on one x86 vendor and crashes at others on the second). So before a node
multiplies anything, `prepare` makes sure every candidate kernel for every (dtype, rows, out, in)
it will use has been, on this device:

1. checked against a float64 product of the same stored weights, in a child process
   (`node.kernel_probe`), so that a kernel that crashes is a rejected kernel and not a dead node
   (a kernel that crashes once is never used on this device again; one that disagrees is
   rejected for that shape and rows);
2. timed, if it passed, with the BLAS threads the node computes with (in CPU seconds under a CPU
   quota, `models.kernels.compute_clock`);

and installs the fastest that passed (`models.kernels.install`). The results are cached in the
state folder under a key of the CPU (model, flags and cgroup quota), Python, torch, NumPy and
the kernels' source, so a second start costs a file read (`node.kernel_table`). `edgetp kernels`
shows the table.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from edgetp.memory.files import atomic_write, default_state_dir
from edgetp.models import kernels, quant
from edgetp.models.errors import ModelError
from edgetp.models.kernels import CANDIDATES, ROW_BUCKETS, Candidate
from edgetp.models.layers import Slice, full_layer_shapes, slice_dtypes, slice_layer, slice_parts
from edgetp.models.moe import expert_specs
from edgetp.models.quant import stored_format, stored_size
from edgetp.node import children, kernel_probe, kernel_table
from edgetp.node.kernel_probe import MARK
from edgetp.node.kernel_table import Prepared, Shape, Table, entry_key, pick, read_table, table_path

if TYPE_CHECKING:
    from edgetp.models.source import ModelSource

log = logging.getLogger(__name__)

CHILD_TIMEOUT = 300.0  # s for one child's whole job: a kernel that hangs is a rejected kernel
CHECK_FOLDER = "edgetp-kernel-check-"  # + the caller's pid: a temporary folder for a check's output


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
        "blas": blas_kernels(),
        "code": _code_fingerprint(),
    }


def blas_kernels() -> str:
    """NumPy's BLAS, its version and the kernels it runs: OpenBLAS picks them for the CPU, or
    as OPENBLAS_CORETYPE says (some hosts set it for every program: on a Zen 5 "Haswell"'s
    float32 product of 512x640 by 640x2048 ran at 224 GFLOP/s, its own choice at 406). A
    prompt's products go to BLAS, so a time cached under one is no time for the other."""
    from threadpoolctl import threadpool_info

    for info in threadpool_info():
        if info.get("user_api") == "blas":
            kind = info.get("architecture") or ""
            return f"{info.get('internal_api')} {info.get('version')} {kind}".strip()
    return "none"


def _code_fingerprint() -> str:
    """The source of the candidates and of their check: a cached verdict (a kernel rejected, a
    time) is about the code that earned it, so a new version of either checks again."""
    digest = hashlib.sha256()
    models = Path(kernels.__file__).parent
    sources = [
        models / "native.py",
        models / "activations.py",
        *sorted((models / "csrc").glob("*.c")),
    ]
    checks = (sys.modules[__name__], kernel_probe, kernel_table)
    for path in [Path(str(m.__file__)) for m in (kernels, quant, *checks)] + sources:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


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
    candidates = candidates or dict(CANDIDATES)
    threads = kernels.blas_threads()
    cache_dir = cache_dir or default_state_dir() / "kernels"
    device = fingerprint()  # /proc and cgroup files: read once per call
    path = table_path(cache_dir, device)
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
        table = read_table(path, device)
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
            chosen = pick(table, key, candidates[s[0]], kernels.activations())
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
                {
                    "candidate": c.name,
                    "target": c.target,
                    "activations": c.activations,
                    "shape": list(s),
                    "bucket": b,
                }
                for c in candidates[s[0]]
                if c.fallback == fallbacks
                and c.activations in ("exact", kernels.activations())  # the others' unused
                and c.name not in table.crashed
                and (c.max_rows is None or ROW_BUCKETS[b][0] <= c.max_rows)
                and ROW_BUCKETS[b][1] >= c.min_rows
                and c.name not in table.results.get(key, {})
            ]
    return todo


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
        child = children.start(
            kernel_probe.run, job_args, "edgetp-kernels", oom_score_adj=children.OOM_CHECK
        )
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
    heads = [b - a for a, b in head_rows if b > a] or [config.vocab_size]
    shapes = [(source.head_dtype(dtype), rows, config.hidden) for rows in heads]
    # a layer of each kind (gated DeltaNet layers cut differently), with each's dtypes
    kinds: dict[bool, tuple[int, set[tuple[tuple[str, str], ...]]]] = {}
    for i in range(config.n_layers):
        kind = kinds.setdefault(config.is_linear(i), (i, set()))
        kind[1].add(tuple(source.matrix_dtypes(i, dtype).items()))
    for s, (layer, layer_dtypes) in ((s, k) for s in slices for k in kinds.values()):
        full = {
            n: torch.empty(shape, device="meta")
            for n, shape in full_layer_shapes(config, layer).items()
        }
        cut, parts = slice_layer(config, full, s, layer), slice_parts(config, s, layer)
        for dtypes in layer_dtypes:
            kept = slice_dtypes(parts, dict(dtypes))
            specs = expert_specs({n: (t.dtype, tuple(t.shape)) for n, t in cut.items()},
                                 config.n_stacked)  # fmt: skip
            sizes = {n: specs[n][1] for n in kept}
            shapes += [(d, sizes[n][0], sizes[n][1]) for n, d in kept.items() if all(sizes[n])]
    return sorted(set(shapes))
