"""Deliberately broken kernels, for the check that must reject them (tests/test_kernels.py).

They are imported by name in the check's child process, as any candidate is.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import torch


def wrong(x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None) -> np.ndarray:
    """Fast and wrong: what a kernel reading past its rows looks like from outside."""
    return np.full((x.shape[0], w.shape[0]), 1e13, dtype=np.float32)


def crash(x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None) -> np.ndarray:
    """Dies as a segfaulting native kernel would: no exception, no cleanup."""
    os.abort()


def killed(x: np.ndarray, w: torch.Tensor, scale: torch.Tensor | None = None) -> np.ndarray:
    """Ended as the out-of-memory killer ends a process: SIGKILL, which no kernel sends."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL cannot be caught")
