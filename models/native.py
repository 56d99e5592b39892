"""The block formats' own products, built from C on this machine at first use.

NumPy and torch have no product for GGUF's blocks; expanding a matrix to float32 for every
product costs 30 times a float32 token. So the C sources ship with the package and the system's
C compiler builds them at first use (models/cbuild.py). Four builds, eight candidates:

- "c-f32" (models/csrc/blocks.c): x86 with AVX2, FMA and F16C, tuned by hand (the blocks of 32
  but MXFP4, and Q4_K and Q6_K, the K-quants of a Q4_K_M file); "c-f32-avx512", the same file's
  float products built for AVX-512, where the CPU has it;
- "c-portable" (models/csrc/blocks_portable.c): plain C the compiler vectorises for this CPU
  (-march=native), for ARM boards and x86 without AVX2 (a candidate only there: 14x slower than
  "c-f32" where both run, 4x faster than expanding to float32);
- "c-int8" (blocks.c) and "c-portable-int8" (blocks_portable.c): the same formats with x rounded
  to int8 a block of 32 (the K-quants' a block of 256) and integer dot products
  (models/activations.py), chosen only under `--activations int8`; "c-int8-blas", for a prompt's
  many rows, the same rounding with the product of "c-expand-blas";
- "c-expand" (models/csrc/expand.c): every block format, the K-quants included, in plain C
  with the compiler's vector types (-march=native: AVX-512, AVX2 or NEON); and "c-expand-blas",
  bands of rows expanded there and multiplied by NumPy's BLAS, for a prefill's many rows.

No compiler, or a CPU the build is not for: `load` raises, and the on-device check rejects that
candidate with the message; a build that runs but is wrong on this CPU is rejected by the same
check.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgetp.models.cbuild import built
from edgetp.models.dtypes import BLOCK_DTYPES
from edgetp.models.kernels import HAND_TUNED, PORTABLE, blas_threads, has_avx2
from edgetp.models.quant import block_format

CSRC = Path(__file__).with_name("csrc")
COMMON = ("-O3", "-fopenmp", "-shared", "-fPIC")


@dataclass(frozen=True)
class Build:
    source: Path
    flags: tuple[str, ...]
    x86_only: bool
    formats: tuple[str, ...]
    expands: bool = False  # has `<format>_expand`, whole rows to float32
    integer: tuple[str, ...] = ()  # formats with `<format>_q8`, int8 activations


BUILDS = {
    "avx2": Build(
        CSRC / "blocks.c",
        ("-mavx2", "-mfma", "-mf16c", *COMMON),
        True,
        HAND_TUNED,
        False,
        HAND_TUNED,
    ),
    "avx512": Build(
        CSRC / "blocks.c",
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", *COMMON),
        True,
        HAND_TUNED,
    ),
    "portable": Build(
        CSRC / "blocks_portable.c", ("-march=native", *COMMON), False, PORTABLE, False, PORTABLE
    ),
    "expand": Build(CSRC / "expand.c", ("-march=native", *COMMON), False, BLOCK_DTYPES, True),
}
# Multiply-adds (rows x out x in) below which one thread beats waking a second. Measured on a
# 2-core EPYC (AVX2), one row, q4_1: 192x576 takes 4.8 us on one thread and 4.5 on two, 384x576
# 13.8 and 8.0, 576x576 18.8 and 11.4; and in a decode step, where the weights stream from
# memory, two threads gain more still.
SMALL = 1 << 17  # multiply-adds below which a product runs on one thread

_libs: dict[str, ctypes.CDLL] = {}


def default_build() -> str:
    """The build this CPU's block products come from: the AVX2 one where it runs."""
    return "avx2" if has_avx2() else "portable"


def load(build: str = "avx2") -> ctypes.CDLL:
    """The built library, building it first if this version of the source was never built."""
    if build not in _libs:
        spec = BUILDS[build]
        if spec.x86_only and os.uname().machine not in ("x86_64", "AMD64"):
            raise RuntimeError(f"{spec.source.name} is for x86, this is {os.uname().machine}")
        lib = ctypes.CDLL(str(built(spec.source, spec.flags, ".so")))
        pointer, number = ctypes.c_void_p, ctypes.c_int
        names = [f"{fmt}_f32" for fmt in spec.formats] + [f"{fmt}_q8" for fmt in spec.integer]
        names += [f"{fmt}_gemm" for fmt in spec.formats] if spec.expands else []
        for name in names:
            fn = getattr(lib, name)
            fn.argtypes = [pointer, number, number, pointer, number, pointer, number]
            fn.restype = None
        if spec.expands:
            lib.expand_set_blas.argtypes = [pointer, pointer, pointer]
        if build == "avx2":
            lib.rounded_rows_q8.argtypes = [pointer, number, number, number, pointer, number]
            lib.rounded_rows_q8.restype = None
        _libs[build] = lib
    return _libs[build]


# (build, suffix, element dtype, block bytes), which name a format (models.quant) -> its product
_functions: dict[tuple[str, str, torch.dtype, int], Callable[..., None]] = {}


def f32_activations(
    x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None
) -> np.ndarray:
    """The candidate "c-f32": x (rows, in) @ w^T for blocks w (out, in/32, bytes), the stored
    weights' product in float32, on the AVX2 build."""
    return _product("avx2", x, w)


def f32_avx512_activations(
    x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None
) -> np.ndarray:
    """The candidate "c-f32-avx512": the same product on the AVX-512 build (a block of 32 is
    two vectors of 16, summed in another order than the AVX2 build's)."""
    return _product("avx512", x, w)


def portable_activations(
    x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None
) -> np.ndarray:
    """The candidate "c-portable": the same product on the portable build."""
    return _product("portable", x, w)


def int8_activations(
    x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None
) -> np.ndarray:
    """The candidate "c-int8": each row of x rounded to int8 a block of 32 (d = max|x| / 127,
    as llama.cpp's Q8_0 and Q8_1 activations), then integer dot products a block, on the AVX2
    build (models/csrc/blocks.c; models/activations.py is its reference)."""
    return _product("avx2", x, w, "q8")


def portable_int8_activations(
    x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None
) -> np.ndarray:
    """The candidate "c-portable-int8": the same rounding and integer sums on the portable
    build."""
    return _product("portable", x, w, "q8")


def int8_blas(x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None) -> np.ndarray:
    """The candidate "c-int8-blas", for many rows (a prefill): each row of x rounded as "c-int8"
    rounds it, those values (d q, in float32) multiplied as "c-expand-blas" multiplies. The
    product of "c-int8" to float32's rounding, at BLAS's speed: on AVX2 an integer tile of 4
    rows took 1.2-2x BLAS's time at 512 rows."""
    fmt = block_format(w)
    assert fmt is not None, "c-int8-blas needs a block matrix"
    x = np.ascontiguousarray(x, dtype=np.float32)
    rounded = np.empty_like(x)
    rows, inp = x.shape
    x_at, out_at = x.__array_interface__["data"][0], rounded.__array_interface__["data"][0]
    load("avx2").rounded_rows_q8(x_at, rows, inp, fmt.block_values, out_at, blas_threads())
    return expand_blas(rounded, w)


def expand_activations(
    x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None
) -> np.ndarray:
    """The candidate "c-expand": the product on models/csrc/expand.c, which covers every block
    format (a chunk of weights expanded into a buffer once for a tile of rows)."""
    return _product("expand", x, w)


def expand_blas(x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None) -> np.ndarray:
    """The candidate "c-expand-blas", for many rows (a prefill): bands of weight rows expanded
    to float32 in C, each multiplied with every row of x by BLAS's sgemm, so each expanded
    weight serves every row at BLAS's speed rather than a block kernel's (a block kernel at 9 or
    more rows took 25x its time at 8)."""
    fmt = block_format(w)
    assert fmt is not None, "c-expand-blas needs a block matrix"
    fn = _gemms.get(fmt.name)
    if fn is None:
        lib = load("expand")
        lib.expand_set_blas(*(numpy_blas(names) for names in BLAS_SYMBOLS))
        fn = _gemms[fmt.name] = getattr(lib, f"{fmt.name}_gemm")
    x = np.ascontiguousarray(x, dtype=np.float32)
    blocks = w if w.is_contiguous() else w.contiguous()
    (rows, inp), out = x.shape, blocks.shape[0]
    y = np.empty((rows, out), dtype=np.float32)
    x_at, y_at = x.__array_interface__["data"][0], y.__array_interface__["data"][0]
    fn(x_at, rows, inp, blocks.data_ptr(), out, y_at, blas_threads())
    return y


_gemms: dict[str, Callable[..., None]] = {}
# NumPy's OpenBLAS as its wheels name it (64-bit integers), or as a system build does
BLAS_SYMBOLS = (
    ("scipy_cblas_sgemm64_", "cblas_sgemm64_"),
    ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_"),
    ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_"),
)


def numpy_blas(symbols: tuple[str, ...]) -> int:
    """The address of the first of `symbols` in the BLAS NumPy runs on (threadpoolctl finds
    its file); RuntimeError where it has none of them (another BLAS than OpenBLAS)."""
    from threadpoolctl import threadpool_info

    for info in threadpool_info():
        if info.get("user_api") != "blas":
            continue
        lib = ctypes.CDLL(info["filepath"])
        for symbol in symbols:
            fn = getattr(lib, symbol, None)
            if fn is not None:
                return ctypes.cast(fn, ctypes.c_void_p).value or 0
    raise RuntimeError(f"NumPy's BLAS has none of {', '.join(symbols)} to call from C")


def _product(build: str, x: np.ndarray, w: torch.Tensor, suffix: str = "f32") -> np.ndarray:
    """A decode step calls this ~120 times a token, so the lookups are cached and the pointers
    read the cheap way (`.ctypes` builds an object per access)."""
    layout = (build, suffix, w.dtype, w.shape[-1])
    fn = _functions.get(layout)
    if fn is None:
        fmt = block_format(w)
        assert fmt is not None, "a block-format kernel needs a block matrix"
        fn = _functions[layout] = getattr(load(build), f"{fmt.name}_{suffix}")
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
