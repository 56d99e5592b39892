"""The block formats' own products (models/csrc/blocks.c), built on this machine at first use.

NumPy and torch have no product for GGUF's blocks; expanding a matrix to float32 for every
product costs 30 times a float32 token. So the C source ships with the package and the system's
C compiler builds it, once per version of the source, into a folder under the temp directory
(a build artifact, shared by the processes of one boot). No compiler, another architecture, or a
CPU without AVX2: `load` raises, and the on-device check rejects these candidates with that
message; a build that runs but is wrong on this CPU is rejected by the same check.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from models.kernels import blas_threads
from models.quant import block_format

SOURCE = Path(__file__).with_name("csrc") / "blocks.c"
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
# Multiply-adds (rows x out x in) below which one thread beats waking a second. Measured on a
# 2-core EPYC (AVX2), one row, q4_1: 192x576 takes 4.8 us on one thread and 4.5 on two, 384x576
# 13.8 and 8.0, 576x576 18.8 and 11.4; and in a decode step, where the weights stream from
# memory, two threads gain more still.
SMALL = 1 << 17

_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """The built library, building it first if this version of the source was never built."""
    global _lib
    if _lib is None:
        source = SOURCE.read_bytes()
        digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
        folder = Path(tempfile.gettempdir()) / f"edgetp-native-{os.getuid()}"
        built = folder / f"blocks-{digest}.so"
        if not built.is_file():
            _build(folder, built)
        lib = ctypes.CDLL(str(built))
        for name in ("q4_0_f32", "q4_1_f32", "q8_0_f32"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
            fn.argtypes += [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
            fn.restype = None
        _lib = lib
    return _lib


def _build(folder: Path, built: Path) -> None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) to build the block-format kernels")
    if os.uname().machine not in ("x86_64", "AMD64"):
        raise RuntimeError(f"the block-format kernels are x86 only, this is {os.uname().machine}")
    folder.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: a process loading it never sees half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", partial], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, built)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


_functions: dict[int, Callable[..., None]] = {}  # block bytes -> the format's C product


def f32_activations(
    x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None
) -> np.ndarray:
    """The candidate "c-f32": x (rows, in) @ w^T for blocks w (out, in/32, bytes), the stored
    weights' product in float32. A decode step calls this ~120 times a token, so the lookups
    are cached and the pointers read the cheap way (`.ctypes` builds an object per access)."""
    fn = _functions.get(w.shape[-1])
    if fn is None:
        fmt = block_format(w)
        assert fmt is not None, "a block-format kernel needs a block matrix"
        fn = _functions[w.shape[-1]] = getattr(load(), f"{fmt.name}_f32")
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    blocks = w if w.is_contiguous() else w.contiguous()  # held until the call returns
    rows, inp = x.shape
    out = blocks.shape[0]
    y = np.empty((rows, out), dtype=np.float32)
    threads = 1 if rows * out * inp < SMALL else blas_threads()
    x_at, y_at = x.__array_interface__["data"][0], y.__array_interface__["data"][0]
    fn(x_at, rows, inp, blocks.data_ptr(), out, y_at, threads)
    return y
