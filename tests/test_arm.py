"""ARM boards are devices too: the block formats' C products, built for aarch64 as a board's
compiler builds them (NEON, the portable C), run under qemu-user and held to the same reference
as on this machine: the expansions to the gguf package's values exactly, the products to
float64 on those values. (No aarch64 Python is needed: tests/csrc/arm_check.c drives them.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from edgetp.models.activations import rounded_rows
from edgetp.models.kernels import PORTABLE
from edgetp.models.native import CSRC
from edgetp.models.quant import FORMATS, random_blocks

HARNESS = Path(__file__).with_name("csrc") / "arm_check.c"
COMPILER, EMULATOR = "aarch64-linux-gnu-gcc", "qemu-aarch64"
OBJDUMP = "aarch64-linux-gnu-objdump"  # binutils, which the compiler comes with

pytestmark = pytest.mark.slow  # a cross build, and every check run under an emulator


# Each build as a board's compiler makes it (-march=native there): a plain ARMv8 core (Cortex-A53,
# A72), one with the dot product instructions (A55, A76: sdot), one with int8 matrix products
# too (A710, Neoverse V1: smmla). The instruction a variant exists for, which its code must hold.
BUILDS = {
    "expand": ("expand.c", "armv8-a", None),
    "portable": ("blocks_portable.c", "armv8-a", None),
    "portable-dotprod": ("blocks_portable.c", "armv8.2-a+dotprod", "sdot"),
    "portable-i8mm": ("blocks_portable.c", "armv8.2-a+dotprod+i8mm", "smmla"),
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """The harness linked with models/csrc/expand.c, and with blocks_portable.c, for aarch64."""
    missing = [tool for tool in (COMPILER, EMULATOR) if shutil.which(tool) is None]
    assert not missing, (
        f"{' and '.join(missing)} not found: install Debian's gcc-aarch64-linux-gnu and "
        "qemu-user (`make setup` does, as root)"
    )
    folder = tmp_path_factory.mktemp("arm")
    out = {}
    for build, (source, arch, instruction) in BUILDS.items():
        out[build] = folder / f"arm_{build}"
        extra = ["-DPORTABLE"] if source == "blocks_portable.c" else []
        subprocess.run(
            [COMPILER, "-O3", f"-march={arch}", "-fopenmp", "-static", *extra, str(HARNESS),
             str(CSRC / source), "-o", str(out[build]), "-lm"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        if instruction is not None:
            code = subprocess.run(
                [OBJDUMP, "-d", str(out[build])], check=True, capture_output=True, text=True
            ).stdout
            assert f"\t{instruction}\t" in code, f"the {build} build has no {instruction}"
    return out


def _run(binary: Path, fmt: str, w: np.ndarray, x: np.ndarray, expands: bool):
    (rows, inp), out = x.shape, w.shape[0]
    header = f"{fmt} {rows} {inp} {out} {w.nbytes}\n".encode()
    done = subprocess.run(
        [EMULATOR, str(binary)], input=header + w.tobytes() + x.tobytes(),
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    data = np.frombuffer(done.stdout, np.float32)
    y = data[: rows * out].reshape(rows, out)
    values = data[rows * out :].reshape(out, inp) if expands else None
    return y, values


@pytest.mark.parametrize(
    ("build", "fmt"),
    [("expand", f) for f in FORMATS] + [("portable", f) for f in PORTABLE],
)
def test_the_aarch64_builds_multiply_the_stored_weights_exactly(builds, build, fmt):
    rng = np.random.default_rng(len(fmt))
    v = FORMATS[fmt].block_values
    for out, inp, rows in ((7, 2 * v, 1), (33, 1280 if v == 256 else 640, 3), (5, 5 * v, 9)):
        w = random_blocks(FORMATS[fmt], out, inp, rng).numpy()
        x = rng.standard_normal((rows, inp), dtype=np.float32)
        y, values = _run(builds[build], fmt, w, x, expands=build == "expand")
        exact = FORMATS[fmt].dequantize(torch.from_numpy(w)).double().numpy()
        if values is not None:
            assert np.array_equal(values, exact.astype(np.float32)), (fmt, out, inp)
        want = x.astype(np.float64) @ exact.T
        bound = 1e-4 * np.outer(np.linalg.norm(x, axis=1), np.linalg.norm(exact, axis=1)) + 1e-6
        assert (np.abs(y - want) <= bound).all(), (fmt, out, inp, rows)


@pytest.mark.parametrize(
    ("build", "fmt"),
    [(b, f) for b in ("portable", "portable-dotprod", "portable-i8mm") for f in PORTABLE],
)
def test_the_aarch64_int8_products_equal_the_integer_reference(builds, build, fmt):
    """The portable build's int8 activations (models/activations.py) on aarch64, plain and
    with sdot and smmla: the rows rounded as NumPy rounds them, each block's integer sum exact,
    only the float sum over the blocks apart (1e-5 of |x| |w|). Odd counts of weight rows and
    rows of x leave a pair's second out."""
    rng = np.random.default_rng(len(fmt))
    for out, inp, rows in ((7, 64, 1), (33, 640, 3), (5, 160, 9), (8, 96, 4)):
        w = random_blocks(FORMATS[fmt], out, inp, rng).numpy()
        x = rng.standard_normal((rows, inp), dtype=np.float32)
        y, _ = _run(builds[build], f"{fmt}_q8", w, x, expands=False)
        exact = FORMATS[fmt].dequantize(torch.from_numpy(w)).double().numpy()
        rounded = rounded_rows(x)
        want = rounded @ exact.T
        bound = 1e-5 * np.outer(np.linalg.norm(rounded, axis=1), np.linalg.norm(exact, axis=1))
        assert (np.abs(y - want) <= bound).all(), (fmt, out, inp, rows)
