"""The matmul every projection goes through, on the kernel this device admitted and chose.

Weights are stored in one of the shard dtypes, chosen when the model is split (`--dtype`): four
plain ones, and GGUF's block formats (models/quant.py). For each
dtype there are several candidate kernels (`CANDIDATES`), and which is right, and which is fast,
depends on the CPU: torch's int8 kernel has returned garbage or crashed at some shapes;
OpenBLAS beats MKL for decode's matrix-vector products on one CPU and not necessarily on
another. So no candidate is trusted by default: `node.device.prepare` checks each against a
float64 reference in a child process on this device, times the ones that pass, and `install`s
the fastest per (dtype, rows, out, in). A shape nobody prepared runs on
`reference`, the plain float32 NumPy product every candidate is measured against.

Every kernel takes float32 rows (rows, in) as a NumPy array and returns float32 rows
(rows, out): the residual stream and the sums across nodes stay float32.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from edgetp.models.activations import Activations, check_activations
from edgetp.models.quant import FORMATS, block_format, matrix_size

log = logging.getLogger(__name__)

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
SCALE_SUFFIX = "_scale"  # an int8 matrix `w` is stored with its scales as `w_scale`

Kernel = Callable[[np.ndarray, torch.Tensor, "torch.Tensor | None"], np.ndarray]


# -- the candidates ------------------------------------------------------------------------------


def dtype_name(w: torch.Tensor) -> str:
    """The shard dtype a stored matrix is in."""
    found = block_format(w)
    return found.name if found is not None else DTYPE_NAMES[w.dtype]


def dequantize(w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """A stored matrix as float32 (int8 times its per-channel scales; blocks expanded)."""
    found = block_format(w)
    if found is not None:
        return found.dequantize(w)
    if w.dtype == torch.int8:
        if scale is None:
            raise ValueError("an int8 weight needs its per-channel scales")
        return w * scale[:, None]  # one pass: int8 times float32 is float32
    return w.float()


DEQUANT_ROWS = 512  # output rows converted at a time: a block stays in cache for its product


def reference(x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None) -> np.ndarray:
    """The plain product on float32 weights, converted a block of rows at a time unless they are
    float32 already."""
    if w.dtype == torch.float32:
        return x @ w.numpy().T
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)  # blocks: still a row per output
    for a in range(0, w.shape[0], DEQUANT_ROWS):
        b = min(a + DEQUANT_ROWS, w.shape[0])
        block = dequantize(w[a:b], None if scale is None else scale[a:b])
        np.matmul(x, block.numpy().T, out=out[:, a:b])
    return out


def numpy_gemv(x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None) -> np.ndarray:
    """One BLAS matrix-vector product per row: for a few rows it beats the matrix-matrix path."""
    wn = w.numpy()
    out = np.empty((x.shape[0], wn.shape[0]), dtype=np.float32)
    for r in range(x.shape[0]):
        np.dot(wn, x[r], out=out[r])
    return out


def torch_mm(x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None) -> np.ndarray:
    """torch's matmul in the weight's own dtype (the input is rounded to it)."""
    return torch.mm(torch.from_numpy(x).to(w.dtype), w.t()).float().numpy()


def torch_int8pack(x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None) -> np.ndarray:
    """torch's private int8-weight kernel (bf16 input): right or not depending on the CPU."""
    assert scale is not None
    xb = torch.from_numpy(x).bfloat16()
    return torch._weight_int8pack_mm(xb, w, scale.bfloat16()).float().numpy()


@dataclass(frozen=True)
class Candidate:
    """A kernel by name, where a fresh process finds it ("module:function"), and the most rows
    it is meant for (a per-row loop is not a candidate for a prefill)."""

    name: str
    target: str
    max_rows: int | None = None
    fallback: bool = False  # expands the weights to float32 at every product: used only if asked
    min_rows: int = 1  # a band expanded for BLAS pays off only over many rows
    activations: str = "exact"  # "int8": rounds x to int8 a block first (models/activations.py)

    def load(self) -> Kernel:
        import importlib

        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


def _own(
    name: str, function: str, max_rows: int | None = None, fallback: bool = False
) -> Candidate:
    return Candidate(name, f"{__name__}:{function}", max_rows, fallback)


@functools.cache
def _cpu_words() -> frozenset[str]:
    """The words of /proc/cpuinfo (its flags among them), read once a process."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def _cpu_has(flag: str) -> bool:
    return flag in _cpu_words()


def has_avx2() -> bool:
    """Whether this CPU runs the hand-tuned block products (models/csrc/blocks.c)."""
    return _cpu_has("avx2")


def has_avx512() -> bool:
    """Whether this CPU says it runs blocks.c's AVX-512 build (the check still runs it: one
    VM class advertises an extension that faults when used)."""
    return has_avx2() and _cpu_has("avx512f")


# The portable C build of the block products (ARM boards, x86 without AVX2) is 14x slower than
# the AVX2 one where both run: a candidate only where the AVX2 build cannot be (checking and
# timing it would lengthen every first start for nothing).
NATIVE = "edgetp.models.native"  # the block kernels' module, where a fresh process finds them
_PORTABLE = () if has_avx2() else (Candidate("c-portable", f"{NATIVE}:portable_activations"),)
_PORTABLE_INT8 = (
    ()
    if has_avx2()
    else (Candidate("c-portable-int8", f"{NATIVE}:portable_int8_activations", activations="int8"),)
)
# blocks.c's float tiles, AVX2 and (where the CPU has it) AVX-512, which takes 0.6x the AVX2
# time (Zen 5, one row, SmolLM2's Q4_1 576x1536: 32 against 53 us). Neither for a prompt's rows:
# a tile expands the weights again for each 8 rows. Each tied BLAS at the 17+ bucket's 64 timing
# rows (AVX-512, Q8_0 4096x640: 2030 against 2088 us; AVX2, Gemma 3's Q4_K 640x2048: 1068
# against 1121), and so was chosen by a round's noise, and made a prompt of 512 tokens 1.2x as
# slow (AVX-512) and Gemma 3's of 1,024 1.5x (AVX2: 475-545 against 725-837 tokens/s).
_TILES = (Candidate("c-f32", f"{NATIVE}:f32_activations", max_rows=16),)
_AVX512 = (
    (Candidate("c-f32-avx512", f"{NATIVE}:f32_avx512_activations", max_rows=16),)
    if has_avx512()
    else ()
)
_INT8 = (
    Candidate("c-int8", f"{NATIVE}:int8_activations", activations="int8"),
    Candidate("c-int8-blas", f"{NATIVE}:int8_blas", min_rows=9, activations="int8"),
)

# models/csrc/blocks.c's formats (as models/native.py builds it: float and int8 products for
# each), and blocks_portable.c's
HAND_TUNED = ("q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "iq4_nl", "q4_k", "q6_k")
PORTABLE = ("q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "iq4_nl")

# Row counts group into buckets: a step's rows are its sequences (decode) or its tokens
# (prefill); a kernel's speed, and for some its correctness, changes with them. A batched
# decode's 9-16 rows have a bucket of their own: there the block kernels took 0.55-0.6x the time
# of a band expanded for BLAS, which wins from some 32 rows on (SmolLM2's Q4_1 shapes, 2 cores).
ROW_BUCKETS: tuple[tuple[int, int], ...] = (
    (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 1 << 62)
)  # fmt: skip

# Per dtype, what a user of any CPU would expect to be considered; the plain route (`reference`,
# NumPy's BLAS on float32) comes last, so the check can cut short timing it where it is slow.
CANDIDATES: dict[str, tuple[Candidate, ...]] = {
    "f32": (
        _own("numpy-gemv", "numpy_gemv", max_rows=8),
        _own("torch-mm", "torch_mm"),
        _own("numpy-gemm", "reference"),
    ),
    "f16": (_own("torch-mm-f16", "torch_mm"), _own("upcast-f32", "reference")),
    "bf16": (_own("torch-mm-bf16", "torch_mm"), _own("upcast-f32", "reference")),
    "int8": (_own("torch-int8pack", "torch_int8pack"), _own("dequant-f32", "reference")),
    # Expanding blocks to float32 at every product costs ~30x a q4_1 token: a device whose
    # native kernels were rejected refuses the dtype unless `ALLOW_FALLBACK_ENV` asks for it.
    # The blocks of 32 but MXFP4, and Q4_K and Q6_K, have hand-tuned AVX2 products (AVX-512 ones
    # too where the CPU has it, and the blocks of 32 a portable build); every format has the
    # compiler-vectorised ones of models/csrc/expand.c, and for a prefill's rows a band expanded
    # for BLAS.
    **{
        name: (
            *(_TILES if name in HAND_TUNED else ()),
            *(_AVX512 if name in HAND_TUNED else ()),
            *(_PORTABLE if name in PORTABLE else ()),
            *(_INT8 if name in HAND_TUNED else ()),
            *(_PORTABLE_INT8 if name in PORTABLE else ()),
            Candidate("c-expand", f"{NATIVE}:expand_activations"),
            Candidate("c-expand-blas", f"{NATIVE}:expand_blas", min_rows=9),
            _own("dequant-f32", "reference", fallback=True),
        )
        for name in FORMATS
    },
}


def row_bucket(rows: int) -> int:
    """The index of the bucket of ROW_BUCKETS that holds `rows` (written out: every product
    asks)."""
    if rows <= 4:
        return 0 if rows <= 1 else 1 if rows == 2 else 2
    return 3 if rows <= 8 else 4 if rows <= 16 else 5


assert all(row_bucket(low) == b == row_bucket(high) for b, (low, high) in enumerate(ROW_BUCKETS)), (
    "row_bucket follows ROW_BUCKETS"
)


# -- exact or int8 activations ---------------------------------------------------------------------

_activations: Activations = "exact"  # which candidates `node.device.prepare` chooses among


def set_activations(mode: str) -> None:
    """Choose among the candidates of `mode` ("exact" or "int8", models/activations.py) from the
    next `node.device.prepare` on; a shape without an int8 one keeps an exact one."""
    global _activations
    _activations = check_activations(mode)


def activations() -> Activations:
    """The activations this process's products are chosen for."""
    return _activations


# -- the table this process uses -----------------------------------------------------------------

Key = tuple[str, int, int, int]  # (dtype name, row bucket, out, in)

_chosen: dict[Key, tuple[str, Kernel]] = {}
_unprepared_logged: set[tuple[str, int, int]] = set()
_kernel_set = ""  # what `kernel_set` says, kept with the table: nodes report it every step


def install(choices: dict[Key, Candidate]) -> None:
    """Use these admitted kernels from now on in this process (added to what it has)."""
    global _kernel_set
    for key, candidate in choices.items():
        _chosen[key] = (candidate.name, candidate.load())
    by_dtype: dict[str, set[str]] = {}
    for (dtype, *_), (name, _) in _chosen.items():
        by_dtype.setdefault(dtype, set()).add(name)
    _kernel_set = "; ".join(f"{d}: {', '.join(sorted(n))}" for d, n in sorted(by_dtype.items()))


def uninstall() -> None:
    """Forget every choice: each shape runs on `reference` until prepared again, chosen among
    exact activations' kernels unless `set_activations` says otherwise first."""
    global _kernel_set, _activations
    _chosen.clear()
    _kernel_set = ""
    _activations = "exact"


def kernel_set() -> str:
    """The admitted kernels this process uses, per dtype, e.g. "f32: numpy-gemm, numpy-gemv"."""
    return _kernel_set


def chosen_kernel(dtype: str, rows: int, out: int, inp: int) -> str | None:
    """The name of the admitted kernel this process multiplies such a matrix with, or None."""
    found = _chosen.get((dtype, row_bucket(rows), out, inp))
    return None if found is None else found[0]


def _kernel(dtype: str, rows: int, out: int, inp: int) -> Kernel:
    found = _chosen.get((dtype, row_bucket(rows), out, inp))
    if found is not None:
        return found[1]
    if (dtype, out, inp) not in _unprepared_logged:
        _unprepared_logged.add((dtype, out, inp))
        log.info("no kernel prepared for %s %dx%d: using the reference product", dtype, out, inp)
    return reference


# -- threads ---------------------------------------------------------------------------------------

_share: int | None = None  # this process's share of the cores, as last set
_blas_threads = 1  # BLAS threads in force now: kernels are timed with these
ALLOW_FALLBACK_ENV = "EDGETP_ALLOW_SLOW_KERNELS"  # "1": a dtype may run on its fallback
CORES_ENV = "EDGETP_CORES"  # the cores edgetp may use on this device (default: all of them)


def device_cores() -> int:
    """The cores edgetp's processes on this device share: `$EDGETP_CORES`, else the cores this
    process may run on (its affinity: taskset, a cpuset), fewer if its CPU quota (a cgroup: a
    container, or an emulated smaller device) allows fewer.

    More BLAS threads than the quota allows only take turns and spin: a 1-CPU cgroup on a
    2-core host runs one thread.
    """
    given = os.environ.get(CORES_ENV, "")
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ValueError(f"{CORES_ENV}={given!r} is not a whole number of at least 1")
        return int(given)
    cores = len(os.sched_getaffinity(0)) or 1  # os.cpu_count() counts cores it may not use
    quota = cpu_quota_cores()
    if quota is not None:
        cores = max(1, min(cores, int(quota)))
    return cores


def cpu_quota_cores() -> float | None:
    """This process's CPU quota in cores (0.5: half a core's time), None when unlimited."""
    quota = cgroup_cpu_quota()
    if "/" not in quota:
        return None
    share, period = (int(x) for x in quota.split("/"))
    return share / period


def compute_clock(threads: int) -> Callable[[], float]:
    """The clock to time this process's compute by, with `threads` BLAS threads.

    Under a CPU quota, CPU seconds: wall time there measures where in the quota's period a
    loop ran and who else ran on the core, not the code (at cpu=0.5 a worker's lm_head rows
    went to torch's product by a throttled period's chance, ~30% slower than NumPy's in CPU).
    One BLAS thread: its own thread's time, not its process's other threads' (a master
    serving). Without a quota, wall time: a BLAS pool's CPU seconds would count its spinning.
    """
    if cpu_quota_cores() is None:
        return time.perf_counter
    return time.thread_time if threads == 1 else time.process_time


def cgroup_cpu_quota() -> str:
    """This process's CPU quota (cgroup), "none" when unlimited: a node run as a smaller device
    (a cgroup with a quota) must time its kernels as that device, not read another's times."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):  # cgroup v1
                base = Path("/sys/fs/cgroup/cpu") / path.lstrip("/")
                quota = (base / "cpu.cfs_quota_us").read_text().strip()
                period = (base / "cpu.cfs_period_us").read_text().strip()
                return "none" if quota == "-1" else f"{quota}/{period}"
            if controllers == "":  # cgroup v2: "max 100000" or "50000 100000"
                text = (Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.max").read_text()
                quota, period = text.split()
                return "none" if quota == "max" else f"{quota}/{period}"
    except (OSError, ValueError):
        pass
    return "unknown"


def set_threads(threads: int | None = None) -> int:
    """This process's share of the cores (all of `device_cores()` unless told) for the BLAS
    matmuls.

    Torch keeps one thread: the projections run on OpenBLAS and what torch still does per step
    is small; its OpenMP workers spinning between ops would steal the cores from OpenBLAS's
    threads (measured: 260 ms/token instead of 14 on SmolLM2 with both at 2).
    """
    global _share
    if threads is not None and threads < 1:  # the kernel check would blame the kernels for it
        raise ValueError(f"threads must be at least 1, got {threads}")
    _share = threads or device_cores()
    return limit_blas(_share)


def leave_a_core_to_the_loader(streaming: bool) -> int:
    """BLAS threads for a node whose slice streams from disk (or not, again): one fewer than
    its share, down to one. Reading a layer is CPU work too (a copy per page), and BLAS's
    threads spinning between products starved the loader: SmolLM2 streamed through a window
    of 2 from a cold disk took 576 ms/token against 327 for the reads alone with 2 threads,
    and 355 against 348 with one. Streaming is bound by its reads, so compute loses nothing.
    """
    share = _share or device_cores()
    return limit_blas(max(1, share - 1) if streaming else share)


def limit_blas(n: int) -> int:
    from threadpoolctl import threadpool_limits

    global _blas_threads
    torch.set_num_threads(1)
    threadpool_limits(limits=n, user_api="blas")
    _blas_threads = n
    return n


def blas_threads() -> int:
    return _blas_threads


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Torch on n threads for the ops inside (a prompt's attention), on one again after."""
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(1)


# -- the products --------------------------------------------------------------------------------


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (..., in) @ w (out, in)^T + bias, as F.linear, in float32; `scale` for an int8 `w`."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1]).float().numpy()
    return torch.from_numpy(linear_rows(rows, w, bias, scale)).view(*lead, matrix_size(w)[0])


_layouts: dict[tuple[torch.dtype, torch.Size], tuple[str, int, int]] = {}  # -> (dtype, out, in)


def linear_rows(
    x: np.ndarray,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> np.ndarray:
    """`linear` for a float32 array of rows (rows, in), as an array (rows, out): the decode path,
    where each torch call costs more than the arithmetic (models/block_rows.py says why)."""
    layout = _layouts.get((w.dtype, w.shape))
    if layout is None:  # a decode step asks ~120 times per token for a few shapes
        layout = _layouts[(w.dtype, w.shape)] = (dtype_name(w), *matrix_size(w))
    if layout[0] == "int8" and scale is None:
        raise ValueError("an int8 weight needs its per-channel scales")
    kernel = _kernel(layout[0], x.shape[0], layout[1], layout[2])
    out = kernel(x, w, scale)
    if bias is not None:
        out += bias.numpy()
    return out


def quantize(w: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """A float matrix (out, in) stored as shard dtype `dtype`: {"": weight} plus {"_scale":
    scales} for int8.

    int8 is symmetric per output channel: scale = max|row| / 127, so the row's largest weight
    keeps full precision and a row of zeros stays exactly zero. The block formats are GGUF's.
    """
    w = w.float()
    if dtype in FORMATS:
        return {"": FORMATS[dtype].quantize(w)}
    if dtype != "int8":
        return {"": w.to(DTYPES[dtype]).contiguous()}
    largest = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])  # a slice may be empty
    scale = largest.clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"": q.contiguous(), SCALE_SUFFIX: scale}


def embed(
    ids: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of an embedding table stored in any of the dtypes, as float32."""
    found = block_format(table)
    if found is not None:  # only the rows asked for are expanded
        return found.dequantize(table[ids.reshape(-1)]).view(*ids.shape, -1)
    rows = F.embedding(ids, table).float()
    if scale is not None:
        rows *= scale[ids].unsqueeze(-1)
    return rows
