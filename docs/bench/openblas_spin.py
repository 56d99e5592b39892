"""After a product on OpenBLAS's threads, how long an OpenMP block product (models/csrc/blocks.c)
called again and again waits for a core: OpenBLAS's threads spin ~2^28 cycles after a call.
Run from the repository: .venv/bin/python docs/bench/openblas_spin.py"""

import time

import numpy as np
import torch

from edgetp.models import native, quant
from edgetp.models.kernels import set_threads

set_threads(2)
rng = np.random.default_rng(0)
w = quant.FORMATS["q8_0"].quantize(torch.randn(1536, 640))
x = rng.standard_normal((1, 640), dtype=np.float32)
native.f32_activations(x, w)  # built and warm
a = rng.standard_normal((512, 512))
a @ a  # OpenBLAS's threads now spin
began, calls = time.perf_counter(), []
while time.perf_counter() - began < 0.3:
    t = time.perf_counter()
    native.f32_activations(x, w)
    calls.append((t - began, time.perf_counter() - t))
slow = [(round(at * 1000, 1), round(took * 1e6)) for at, took in calls if took > 1e-3]
print(f"{len(calls)} calls in 0.3 s; over 1 ms (ms after the BLAS product, us):", slow)
