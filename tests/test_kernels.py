"""Kernels are admitted per device: checked in a child process, timed, chosen, cached.

The suite cannot choose its CPU, so it tests the mechanism: kernels that are wrong or that crash
are rejected and the node still answers right; what was admitted here is right at the widths
and row counts that broke torch's int8 kernel on one CPU or another.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import SamplingParams
from edgetp.memory.files import default_state_dir
from edgetp.models import kernels
from edgetp.models.dtypes import SHARD_DTYPES
from edgetp.models.kernels import SCALE_SUFFIX, Candidate, linear, quantize
from edgetp.models.quant import FORMATS
from edgetp.node.device import CHECK_FOLDER, CHILD_TIMEOUT, KernelError, prepare
from edgetp.node.kernel_probe import TOLERANCE, Probe
from edgetp.node.kernel_table import entry_key

TESTS = Path(__file__).parent
FAKES = (
    Candidate("fast-but-wrong", "kernel_fakes:wrong"),
    Candidate("crasher", "kernel_fakes:crash"),
)


@pytest.fixture
def fakes_importable(monkeypatch):
    """The check's child process finds tests/kernel_fakes.py, as it finds any candidate."""
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)


@pytest.fixture
def fresh_table():
    """Each test installs its own choices; the next test starts from none."""
    kernels.uninstall()
    yield
    kernels.uninstall()


def test_a_wrong_and_a_crashing_kernel_are_rejected_and_the_product_stays_right(
    tmp_path, fakes_importable, fresh_table
):
    shapes = [("f32", 48, 40), ("f32", 96, 13)]
    candidates = {"f32": (*FAKES, *kernels.CANDIDATES["f32"])}
    prepared = prepare(shapes, cache_dir=tmp_path, candidates=candidates)
    table = prepared.table
    assert "crasher" in table.crashed and "SIGABRT" in table.crashed["crasher"]
    for shape in shapes:
        for bucket in range(len(kernels.ROW_BUCKETS)):
            key = entry_key(shape, bucket, kernels.blas_threads())
            verdict = table.results[key]["fast-but-wrong"]
            assert not verdict["ok"] and verdict["error"].startswith("wrong"), verdict
            assert table.chosen(key) not in ("fast-but-wrong", "crasher")
    assert "fast-but-wrong" not in kernels.kernel_set() and "crasher" not in kernels.kernel_set()
    gen = torch.Generator().manual_seed(0)
    for out, inp in [(48, 40), (96, 13)]:
        w = torch.randn(out, inp, generator=gen)
        for rows in (1, 3, 8, 40):
            x = torch.randn(rows, inp, generator=gen)
            torch.testing.assert_close(linear(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)


def test_a_tall_matrix_s_check_finds_one_wrong_output_anywhere_in_it():
    """The check compares a tall matrix's product a block of outputs at a time (its float64
    copies at once were most of the check's memory): one output off, or not a number, in the
    last block of an lm_head's 49152 is still found, and the right product still passes."""
    probe = Probe("q8_0", 49152, 64, np.random.default_rng(0))
    x, products, _ = probe.case(3)
    right = products[:, probe.tile].astype(np.float32)
    assert probe.error(right, 3) is None
    assert probe.error(right[:, :-1], 3).startswith("wrong shape (3, 49151)")
    off = right.copy()
    off[2, 49151] += 0.5
    assert probe.error(off, 3) == "wrong: |error| up to 0.5 at 3 rows"
    off[2, 49151] = np.nan
    assert probe.error(off, 3).startswith("wrong: |error| up to ")  # the others' rounding
    assert probe.error(np.full_like(right, np.nan), 3) == "wrong: |error| up to nan at 3 rows"


def test_a_check_killed_from_outside_is_not_held_against_its_kernel(
    tmp_path, fakes_importable, fresh_table
):
    """The out-of-memory killer ends a check's child with SIGKILL, as it ends any process of a
    device whose memory is full: that says nothing of the kernel, and a crash is kept for good.
    The start fails saying so, and the next one checks the kernel again."""
    shapes = [("f32", 48, 40)]
    candidates = {"f32": (Candidate("killed", "kernel_fakes:killed"), *kernels.CANDIDATES["f32"])}
    for _ in range(2):  # the second start checks it again: nothing was kept
        with pytest.raises(KernelError) as refused:
            prepare(shapes, cache_dir=tmp_path, candidates=candidates)
        message = str(refused.value)
        assert "check of kernel killed on f32 48x40 rows 1 threads" in message, message
        assert "killed from outside (SIGKILL)" in message, message
        assert "out-of-memory killer" in message and "more memory free" in message, message


def test_a_block_dtype_without_a_working_kernel_is_refused_unless_the_fallback_is_asked_for(
    tmp_path, fakes_importable, fresh_table, monkeypatch
):
    """When a block format's native kernels are rejected (no compiler, another CPU), running it
    would expand every matrix to float32 at every product: the node says which dtype, why, and
    what to do, and runs the expansion only when the user sets the variable."""
    fallback = next(c for c in kernels.CANDIDATES["q4_1"] if c.fallback)
    candidates = {"q4_1": (*FAKES, fallback)}
    shapes = [("q4_1", 48, 64)]
    monkeypatch.delenv(kernels.ALLOW_FALLBACK_ENV, raising=False)
    with pytest.raises(KernelError) as refused:
        prepare(shapes, cache_dir=tmp_path, candidates=candidates)
    message = str(refused.value)
    assert "--dtype q4_1 has no working kernel" in message, message
    assert "fast-but-wrong: wrong" in message and "crasher: " in message, message
    assert message.endswith("run edgetp kernels --recheck"), message  # a crash is kept
    assert kernels.ALLOW_FALLBACK_ENV in message and kernels.kernel_set() == ""
    monkeypatch.setenv(kernels.ALLOW_FALLBACK_ENV, "1")
    prepare(shapes, cache_dir=tmp_path, candidates=candidates)
    assert kernels.kernel_set() == f"q4_1: {fallback.name}"


def test_the_fallback_is_checked_only_where_no_other_kernel_passed(tmp_path, fresh_table):
    """Expanding the weights at every product is slow to check too (most of a q4_1 lm_head's
    check): where a native kernel passed it is never used, so it is not checked."""
    shape = ("q4_1", 48, 64)
    table = prepare([shape], cache_dir=tmp_path).table
    fallback = next(c.name for c in kernels.CANDIDATES["q4_1"] if c.fallback)
    for bucket in range(len(kernels.ROW_BUCKETS)):
        results = table.results[entry_key(shape, bucket, kernels.blas_threads())]
        native_passed = any(r["ok"] for name, r in results.items() if name != fallback)
        assert native_passed == (fallback not in results), results


def test_a_check_s_folder_left_by_a_killed_caller_is_removed_by_the_next_check(
    tmp_path, monkeypatch, fresh_table
):
    """A check writes its child's output to a temporary folder named with its caller's pid; a
    caller killed outright cannot remove it, so the next check does (once it is older than any
    check lasts), and leaves a live caller's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = tmp_path / f"{CHECK_FOLDER}{gone.pid}-abc"
    live = tmp_path / f"{CHECK_FOLDER}{os.getpid()}-def"
    long_ago = time.time() - 3 * CHILD_TIMEOUT  # older than any check lasts
    for folder in (left, live):
        folder.mkdir()
        (folder / "out").write_text("edgetp-kernel {}")
        os.utime(folder, (long_ago, long_ago))
    prepare([("f32", 16, 8)], cache_dir=tmp_path / "kernels")
    assert not left.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.glob(f"{CHECK_FOLDER}*")) == [live.name]


def test_a_fallback_timed_fastest_by_a_fluke_is_not_chosen_over_a_native_kernel():
    """Under load a native kernel can time slower than the float expansion once; the
    expansion is the last resort all the same."""
    from edgetp.node.kernel_table import Table, pick

    native, fallback = kernels.CANDIDATES["q4_1"][0], kernels.CANDIDATES["q4_1"][-1]
    assert fallback.fallback and not native.fallback
    key = entry_key(("q4_1", 960, 576), 0, 2)
    table = Table(device={}, results={key: {
        native.name: {"ok": True, "error": None, "us": 9898.0},
        fallback.name: {"ok": True, "error": None, "us": 7008.0},
    }})  # fmt: skip
    assert pick(table, key, kernels.CANDIDATES["q4_1"]) == native
    table.results[key][native.name] = {"ok": False, "error": "wrong by 1", "us": None}
    assert pick(table, key, kernels.CANDIDATES["q4_1"]) == fallback


def test_a_second_start_reads_the_table_and_checks_nothing(tmp_path, fresh_table):
    """Nothing checked, and the table only read: no file of it written again (its time is a
    figure, printed)."""
    shapes = [("f32", 64, 32)]

    def files() -> dict[str, tuple[int, int]]:  # the lock file is opened for writing each time
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in tmp_path.iterdir()
                if p.name != ".lock"}  # fmt: skip

    first = prepare(shapes, cache_dir=tmp_path)
    written = files()
    again = prepare(shapes, cache_dir=tmp_path)
    print(f"read again in {again.seconds * 1000:.1f} ms")
    assert first.checked > 0 and again.checked == 0
    assert written and files() == written
    assert again.table.results == first.table.results


def test_a_start_under_other_blas_kernels_checks_again(tmp_path):
    """OPENBLAS_CORETYPE picks NumPy's BLAS kernels (a host may set it for every program), and
    a prompt's products are timed on them: a table timed under one is not read under another."""
    code = (
        "import sys; from pathlib import Path; from edgetp.node.device import prepare\n"
        "p = prepare([('f32', 64, 32)], cache_dir=Path(sys.argv[1]))\n"
        "print(p.checked, '|', p.table.device['blas'])"
    )
    seen = []
    for core in ("Haswell", "Haswell", "Sandybridge"):  # kernels every x86 here runs
        env = {**os.environ, "OPENBLAS_CORETYPE": core}
        result = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        checked, blas = result.stdout.strip().split(" | ")
        seen.append((int(checked), blas))
    print(seen)
    assert seen[0][0] > 0 and seen[0][1].startswith("openblas ") and seen[0][1].endswith("Haswell")
    assert seen[1] == (0, seen[0][1])  # the same kernels: read from the table
    assert seen[2][0] > 0 and seen[2][1].endswith("Sandybridge")


@pytest.mark.parametrize("dtype", SHARD_DTYPES)
def test_admitted_kernels_are_right_at_any_width_and_row_count(tmp_path, dtype, fresh_table):
    """torch's int8 kernel read past rows whose width is not a multiple of 8 on one CPU
    (garbage for one row, a crash for several) and was wrong at width 40 with 3 rows on
    another: whatever the check admits here must be right at those shapes (block formats:
    at widths of whole blocks)."""
    fmt = FORMATS.get(dtype)
    widths = [5, 13, 40, 100, 576] if fmt is None else [fmt.block_values * n for n in (1, 3, 9)]
    prepare([(dtype, 48, w) for w in widths], cache_dir=tmp_path)
    gen = torch.Generator().manual_seed(1)
    for width in widths:
        stored = quantize(torch.randn(48, width, generator=gen), dtype)
        w, scale = stored[""], stored.get(SCALE_SUFFIX)
        exact = kernels.dequantize(w, scale).double()
        for rows in (1, 2, 3, 4, 5, 8, 9, 33):
            x = torch.randn(rows, width, generator=gen)
            got = linear(x, w, scale=scale).double()
            bound = TOLERANCE[dtype] * x.double().norm(dim=1, keepdim=True) * exact.norm(dim=1)
            assert ((got - x.double() @ exact.t()).abs() <= bound + 1e-6).all(), (width, rows)


@pytest.mark.slow
def test_a_node_whose_fastest_candidates_are_broken_still_answers_right(
    smollm2, smollm2_tokenizer, tmp_path, monkeypatch, fakes_importable, fresh_table
):
    """The master is a node: with a wrong and a crashing kernel first in line for every f32
    product, it admits neither, and its greedy answer is the one the plain reference product
    gives (tests/test_reference.py holds that one to transformers)."""
    from edgetp.master.cluster.engine import Engine

    shared = default_state_dir() / "kernels"
    if shared.is_dir():  # the real candidates' verdicts on this device: only the fakes are new
        shutil.copytree(shared, tmp_path / "kernels", ignore=shutil.ignore_patterns(".*"))
    monkeypatch.setenv("EDGETP_HOME", str(tmp_path))
    monkeypatch.setitem(kernels.CANDIDATES, "f32", (*FAKES, *kernels.CANDIDATES["f32"]))
    engine = Engine.local(smollm2, [1.0], max_context=128)
    used = kernels.kernel_set()
    assert used.startswith("f32: ") and "wrong" not in used and "crasher" not in used, used
    prompt = smollm2_tokenizer.encode("The capital of France is")

    def greedy() -> list[int]:
        seqs = start(engine, [prompt], [SamplingParams(max_tokens=16, ignore_eos=True)])
        for _ in stream(engine, smollm2_tokenizer, seqs):
            pass
        return seqs[0].tokens

    admitted = greedy()
    kernels.uninstall()  # every product on the plain reference
    assert admitted == greedy() and len(admitted) == 16


def test_a_node_checks_its_kernels_before_its_slice_loads(smollm2, tmp_path, caplog):
    """A check's child needs a few hundred MB of its own: a node checks from its shards'
    headers before it loads anything, and those are the shapes the loaded slice multiplies, so
    the engine's own check afterwards finds every one of them in the table."""
    from edgetp.master.cluster.engine import Engine
    from edgetp.master.cluster.plan import head_rows, plan_slices
    from edgetp.memory.shards import ShardStore
    from edgetp.memory.splitter import split_model
    from edgetp.memory.window import LayerWindow
    from edgetp.node.executor import check_kernels_before_loading, make_executor

    config = smollm2.config
    slices = plan_slices(config, [1.0, 1.0])
    heads = head_rows(config, slices, [1.0, 1.0])
    store = ShardStore(tmp_path)
    manifest = split_model(smollm2, slices, store, dtype="auto", head_rows=heads)
    paths = [store.path(r) for r in manifest.nodes[1]]
    (a, b), head = heads[1], store.path(manifest.heads[0])
    checked = check_kernels_before_loading(paths, config.n_layers, (head, "lm_head", b - a))
    worker = make_executor(config, slices[1], LayerWindow(paths, config.n_layers), 64, 1)
    worker.hold_head(store.load(manifest.heads[0]), heads[1])
    assert {s[0] for s in checked} == {"q4_1", "q8_0"}, checked  # the layers' and the head's
    assert sorted(checked) == sorted(worker.matrix_shapes())
    worker.close()

    alone = split_model(smollm2, plan_slices(config, [1.0]), store, dtype="auto")
    with caplog.at_level(logging.INFO, "edgetp.node.device"):
        engine = Engine.from_manifest(alone, store, 64, 1)  # the whole head: the embedding's
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels for")]
    assert len(said) == 2 and "read from the cache" in said[1], said
    engine.close()


def test_the_kernels_command_shows_every_candidate_and_one_choice_per_row():
    """`edgetp kernels`: for each of the model's matrices and row buckets, each candidate's
    time or why it was rejected, and one chosen (the suite's engines may have filled the
    device's cache already: the command then reads it)."""
    cmd = [sys.executable, "-m", "edgetp.tui.cli", "kernels", "--dtype", "f32"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=os.environ)
    assert first.returncode == 0, first.stderr
    assert "checked and timed now" in first.stdout or "read from the cache" in first.stdout
    names = [c.name for c in kernels.CANDIDATES["f32"]]
    header = next(line for line in first.stdout.splitlines() if "matrix" in line)
    assert header.split()[2:] == names
    rows = [line for line in first.stdout.splitlines() if line.strip()[:1].isdigit()]
    # SmolLM2: 4 matrices per layer, and the lm_head.
    assert len(rows) == 5 * len(kernels.ROW_BUCKETS), first.stdout
    for row in rows:
        assert row.count("*") == 1, row


def test_a_process_pinned_to_one_core_uses_one_thread():
    """A node started under taskset or a cpuset of one core (docker --cpuset-cpus) runs one BLAS
    thread: two take turns on that core, spinning (a SmolLM2 FFN block: 7.5 ms against 0.43)."""
    probe = (
        "from edgetp.models.kernels import device_cores, set_threads\n"
        "print(device_cores(), set_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k != "EDGETP_CORES"}
    one_core = min(os.sched_getaffinity(0))
    result = subprocess.run(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{one_core}}}); {probe}"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1"]


CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


def _in_cpu_quota(quota: int, code: str) -> list[str]:
    """What `code` prints, run in a fresh process in a cgroup of `quota` us of CPU a 100 ms
    period (-1: none), without EDGETP_CORES."""
    group = CGROUP_CPU / f"edgetp-test-{os.getpid()}-{quota}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(quota))
        probe = f"import os\nopen('{group}/cgroup.procs', 'w').write(str(os.getpid()))\n{code}"
        env = {k: v for k, v in os.environ.items() if k != "EDGETP_CORES"}
        result = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.split()
    finally:
        group.rmdir()


@functools.cache
def _quota_answers(quota: int) -> list[str]:
    """In one fresh process in a cgroup of `quota` (`_in_cpu_quota`): its cores and BLAS threads,
    then the clocks it times kernels by at one and two threads. The tests below ask the same
    quotas: one process each, not one a test (each imports torch, at half a core ~9 s)."""
    code = (
        "from edgetp.models.kernels import compute_clock, device_cores, set_threads\n"
        "print(device_cores(), set_threads())\n"
        "print(compute_clock(1).__name__, compute_clock(2).__name__)"
    )
    return _in_cpu_quota(quota, code)


@pytest.mark.skipif(not os.access(CGROUP_CPU, os.W_OK), reason="needs a writable cgroup v1 cpu")
@pytest.mark.parametrize(("quota", "cores"), [(100_000, 1), (50_000, 1), (-1, os.cpu_count())])
def test_a_process_in_a_cpu_quota_uses_the_cores_of_its_quota(quota, cores):
    """A node run in a cgroup of one CPU (a container, an emulated small device) starts one
    BLAS thread, not one per core of the host."""
    assert _quota_answers(quota)[:2] == [str(cores), str(cores)]


@pytest.mark.slow  # runs the model end to end: not for `make test-fast`
@pytest.mark.skipif(not os.access(CGROUP_CPU, os.W_OK), reason="needs a writable cgroup v1 cpu")
@pytest.mark.parametrize(
    ("quota", "clocks"),
    [(50_000, ["thread_time", "process_time"]), (-1, ["perf_counter", "perf_counter"])],
)
def test_kernels_under_a_cpu_quota_are_timed_in_cpu_seconds(quota, clocks):
    """A kernel check in a cgroup of half a core times in CPU seconds: by the wall clock, where
    a call lands in the quota's period picked torch's product for an lm_head 2 times in 6, ~30%
    slower than NumPy's in CPU (docs/bench/README.md, Kernels). Free, the wall clock."""
    assert _quota_answers(quota)[2:] == clocks


@pytest.mark.parametrize("package", ["models", "memory", "node", "master", "tui"])
def test_every_package_sets_the_thread_spins_before_torch_loads(package):
    """OpenMP's and OpenBLAS's threads spin only briefly between products (models/__init__.py
    says why): whichever package a process imports first sets both, before torch, NumPy or
    the C kernels load a runtime, which reads them once."""
    script = (
        f"import os, sys; import {package}; print('torch' in sys.modules, 'numpy' in "
        "sys.modules, os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    )
    spins = ("GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")
    env = {k: v for k, v in os.environ.items() if k not in spins}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "False", "1000", "10"]
