"""A decode step's blocks in one C call each (models/csrc/rows.c), for a slice whose weights are
resident, float32 or in a GGUF block format whose C product this device admitted.

`attention_rows` and `ffn_rows` are ~35 NumPy calls a block; between two messages each runs cold
and costs more than its arithmetic. `NativeBlocks` computes the same partials in one call a block,
its matrix products on the routines the NumPy path would call (OpenBLAS's sgemv, or the block
formats' C products of models/native.py, handed to the C code as pointers), and keeps a table
of every layer's arguments that node/csrc/hop.c walks without Python between messages.

A model whose layers the C loop does not run whole (a mixture, gated DeltaNet layers) runs in C
a block at a call what it has: its attention layers (Qwen3.5's output gate included), its gated
DeltaNet layers (torch's path before, ~25 calls a layer) and its SwiGLU experts (NumPy's, two
products and an activation an expert).

It is used on a device only after `admit` has compared its partials with the NumPy ones there
(`NativeBlocks.check`); anything it does not cover (f16, bf16 or int8 weights, a block format on
another kernel, a window that streams, more rows than a decode batch) runs the NumPy path.
"""

from __future__ import annotations

import ctypes
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import torch

from edgetp.models import native
from edgetp.models.backends import (
    Block,
    BlockBackend,
    Hidden,
    RecurrentStates,
    StepTables,
    Weights,
)
from edgetp.models.block_rows import attention_rows, ffn_rows, rms_norm_rows
from edgetp.models.cbuild import built
from edgetp.models.config import ModelConfig
from edgetp.models.deltanet import L2_EPS, GatedDeltaNet, channels, key_of_value
from edgetp.models.dtypes import BLOCK_DTYPES
from edgetp.models.families import family_of
from edgetp.models.kernels import blas_threads, chosen_kernel, dtype_name
from edgetp.models.kvformat import ROUNDING, KVArrays, Q8Arrays, format_of, kv_parts
from edgetp.models.layers import MATRICES, Slice, StepBatch
from edgetp.models.moe import EXPERT_TENSORS, Routing, moe_rows
from edgetp.models.quant import block_format, matrix_size
from edgetp.models.rope import Rope

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "rows.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-lm")
# A decode batch's rows: rows.c's scratch holds MAX_ROWS. Block products take every row in one
# pass over the weights, up to the rows whose kernels this device chose among its C builds; float32
# weights take an sgemv a row, as "numpy-gemv" does, and past FLOAT_ROWS a matrix product wins.
MAX_ROWS = 16
FLOAT_ROWS = 8
SGEMV_SYMBOLS = ("scipy_cblas_sgemv64_", "cblas_sgemv64_")  # 64-bit integer arguments
TIMING_ROUNDS, TIMING_CALLS = 3, 10  # the admission's timing: a few ms for SmolLM2
# Native blocks are turned away only when clearly slower. The timing runs one layer warm in a
# loop, where NumPy's ~35 calls a block cost little and the two tie (SmolLM2, one row: 467-484
# CPU us a layer each); in a decode step those calls run cold between messages, and there the
# NumPy blocks cost a node ~8 ms of CPU a token more (`git log -p docs/decisions.md`). A tie is
# no reason to turn them away, and which of two tied timings wins is chance.
SLOWER = 1.25
TOLERANCE = 1e-4  # of the largest partial value: sgemv's own rounding, summed in another order

# The block formats as models/csrc/rows.c numbers them; F32 is float32 weights on sgemv.
F32 = -1
BLOCK_KINDS = {name: i for i, name in enumerate(BLOCK_DTYPES)}
assert len(BLOCK_KINDS) <= 16, "rows.c has room for 16 formats (N_FORMATS)"
# The admitted block-product kernels the C blocks can call, and the build each one is.
BLOCK_BUILDS = {"c-f32": "avx2", "c-portable": "portable", "c-expand": "expand", "c-int8": "avx2"}
BLOCK_BUILDS |= {"c-portable-int8": "portable", "c-f32-avx512": "avx512"}
INTEGER = {"c-int8", "c-portable-int8"}  # their products are `<format>_q8`, the others' `_f32`

c_float_p = ctypes.POINTER(ctypes.c_float)
c_int64_p = ctypes.POINTER(ctypes.c_int64)
if TYPE_CHECKING:  # a c_float_p; ctypes' pointer types cannot be subscripted at run time
    FloatPointer: TypeAlias = ctypes._Pointer[ctypes.c_float]


class Step(ctypes.Structure):
    _fields_ = [
        ("B", ctypes.c_int64),
        ("slots", c_int64_p),
        ("starts", c_int64_p),
        ("cos", c_float_p),
        ("sin", c_float_p),
        ("local_cos", c_float_p),
        ("local_sin", c_float_p),
    ]


class AttentionArgs(ctypes.Structure):
    _fields_ = [
        ("D", ctypes.c_int64),
        ("hd", ctypes.c_int64),
        ("nq", ctypes.c_int64),
        ("nkv", ctypes.c_int64),
        ("half", ctypes.c_int64),
        ("kv_of_q", c_int64_p),
        ("norm", c_float_p),
        ("q_norm", c_float_p),
        ("k_norm", c_float_p),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("wqkv", ctypes.c_void_p),
        ("bqkv", c_float_p),
        ("wo", ctypes.c_void_p),
        ("wqkv_kind", ctypes.c_int),
        ("wo_kind", ctypes.c_int),
        ("cache_k", ctypes.c_void_p),
        ("cache_v", ctypes.c_void_p),
        ("scale_k", ctypes.c_void_p),
        ("scale_v", ctypes.c_void_p),
        ("kv_kind", ctypes.c_int),
        ("W", ctypes.c_int64),
        ("ring", ctypes.c_int),
        ("local_rope", ctypes.c_int),
        ("gate", ctypes.c_int),
        ("sinks", c_float_p),
        ("bo", c_float_p),
        ("scratch", c_float_p),
    ]


class FfnArgs(ctypes.Structure):
    _fields_ = [
        ("D", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("norm", c_float_p),
        ("eps", ctypes.c_float),
        ("gelu", ctypes.c_int),
        ("w_gate_up", ctypes.c_void_p),
        ("w_down", ctypes.c_void_p),
        ("gate_up_kind", ctypes.c_int),
        ("down_kind", ctypes.c_int),
        ("scratch", c_float_p),
    ]


class LinearArgs(ctypes.Structure):
    _fields_ = [
        ("D", ctypes.c_int64),
        ("nk", ctypes.c_int64),
        ("nv", ctypes.c_int64),
        ("dk", ctypes.c_int64),
        ("dv", ctypes.c_int64),
        ("K", ctypes.c_int64),
        ("key_of_value", c_int64_p),
        ("norm", c_float_p),
        ("taps", c_float_p),
        ("decay", c_float_p),
        ("dt", c_float_p),
        ("ssm_norm", c_float_p),
        ("eps", ctypes.c_float),
        ("l2_eps", ctypes.c_float),
        ("wqkv", ctypes.c_void_p),
        ("wo", ctypes.c_void_p),
        ("wqkv_kind", ctypes.c_int),
        ("wo_kind", ctypes.c_int),
        ("conv_states", c_float_p),
        ("states", c_float_p),
        ("scratch", c_float_p),
    ]


class ExpertsArgs(ctypes.Structure):
    _fields_ = [
        ("D", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("norm", c_float_p),
        ("eps", ctypes.c_float),
        ("w_gate_up", ctypes.c_void_p),
        ("w_down", ctypes.c_void_p),
        ("gate_up_kind", ctypes.c_int),
        ("down_kind", ctypes.c_int),
        ("gate_up_row", ctypes.c_int64),
        ("down_row", ctypes.c_int64),
        ("scratch", c_float_p),
    ]


_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """The built library with NumPy's sgemv handed to it; RuntimeError saying why not."""
    global _lib
    if _lib is None:
        sgemv = native.numpy_blas(SGEMV_SYMBOLS)
        lib = ctypes.CDLL(str(built(SOURCE, FLAGS, ".so")))
        lib.rows_set_sgemv.argtypes = [ctypes.c_void_p]
        lib.rows_set_sgemv(sgemv)
        lib.rows_set_block_product.argtypes = [ctypes.c_int, ctypes.c_void_p]
        lib.rows_set_threads.argtypes = [ctypes.c_int, ctypes.c_int64]
        for name in ("rows_attention", "rows_ffn", "rows_linear"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = None
        lib.rows_experts.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p]
        lib.rows_experts.restype = None
        lib.rows_layers.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.rows_layers.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.rows_layers.argtypes += [ctypes.c_float]
        lib.rows_layers.restype = None
        lib.rows_post_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.rows_post_norm.argtypes += [ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
        lib.rows_post_norm.restype = None
        _lib = lib
    return _lib


_no_build: list[str] = []  # why rows.c does not build here, once known


def post_norm_rows(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """A decode step's summed block output x (B, D) normed by w (D,) before the residual, by
    rows.c's `rows_post_norm`: the engine's loop over the blocks and the one-call loop
    (`NativeBlocks.run_layers`) then give the same floats. NumPy's `rms_norm_rows` where rows.c
    does not build."""
    if not _no_build:
        try:
            lib = load()
        except (RuntimeError, OSError) as exc:
            _no_build.append(str(exc))
    if _no_build:
        return rms_norm_rows(x, torch.from_numpy(w), eps)
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty_like(x)
    lib.rows_post_norm(x.ctypes.data, w.ctypes.data, x.shape[0], x.shape[1], eps, y.ctypes.data)
    return y


ATTENTION_MATRICES = ("wqkv", "wo")


def unsupported(config: ModelConfig, weights: dict[str, torch.Tensor]) -> str | None:
    """Why a slice with these (one layer's) weights cannot run every layer natively, attention
    and FFN in one loop, or None."""
    if config.moe:  # experts run in C a block at a time (admit)
        return "the C blocks do not run a mixture of experts in their loop"
    if config.linear_layers:  # Qwen3.5's: its blocks run in C a block at a time (admit)
        return "the C blocks do not run gated DeltaNet layers in their loop"
    ffn = tuple(name for name in MATRICES if name not in ATTENTION_MATRICES)
    return attention_unsupported(config, weights) or _matrices_unsupported(weights, ffn)


def attention_unsupported(config: ModelConfig, weights: dict[str, torch.Tensor]) -> str | None:
    """Why an attention layer with these weights cannot run natively, or None."""
    if config.value_norm:  # Gemma 4's attention: its decode steps run on torch (models.backends)
        return "the C blocks have no value norm nor KV shared across layers"
    return _matrices_unsupported(weights, ATTENTION_MATRICES)


def _matrices_unsupported(weights: dict[str, torch.Tensor], names: tuple[str, ...]) -> str | None:
    for name in names:
        w = weights[name]
        if block_format(w) is None and w.dtype != torch.float32:
            return f"{name} is stored as {w.dtype}, not float32 or a block format"
        try:
            _block_product(w)
        except RuntimeError as exc:
            return f"{name}: {exc}"
    return None


def deltanet_unsupported(config: ModelConfig, layers: list[dict[str, torch.Tensor]]) -> str | None:
    """Why a slice's gated DeltaNet layers (these weights, every layer's) cannot run natively,
    or None."""
    if not config.linear_layers:
        return "the model has no gated DeltaNet layers"
    if not isinstance(family_of(config), GatedDeltaNet):
        return f"{family_of(config).name}'s linear attention is not rows.c's gated delta rule"
    for i in config.linear_layers:
        w = layers[i]
        for name in ("wqkv", "wo"):
            if block_format(w[name]) is None and w[name].dtype != torch.float32:
                return f"{name} is stored as {w[name].dtype}, not float32 or a block format"
            try:
                _block_product(w[name])
            except RuntimeError as exc:
                return f"{name}: {exc}"
        for name in ("attn_norm", "conv", "decay", "dt", "ssm_norm"):
            if w[name].dtype != torch.float32:
                return f"{name} is stored as {w[name].dtype}, not float32"
    return None


def experts_unsupported(config: ModelConfig, layers: list[dict[str, torch.Tensor]]) -> str | None:
    """Why a slice's mixture of experts (these weights, every layer's) cannot run natively, or
    None: rows.c's experts are SwiGLU's, without biases, int8 scales or a dense FFN beside."""
    if not config.moe:
        return "the model has no mixture of experts"
    if config.activation == "gelu_tanh" or config.swiglu_limit is not None or config.dense_ffn:
        return "rows.c's experts are plain SwiGLU's"
    for w in layers:
        if any(name in w for name in EXPERT_TENSORS[2:]):
            return "the experts have int8 scales or biases"
        if w["ffn_norm"].dtype != torch.float32:
            return f"ffn_norm is stored as {w['ffn_norm'].dtype}, not float32"
        for name in ("w_gate_up", "w_down"):
            if block_format(w[name]) is None and w[name].dtype != torch.float32:
                return f"{name} is stored as {w[name].dtype}, not float32 or a block format"
            try:
                _block_product(w[name], config.n_stacked)
            except RuntimeError as exc:
                return f"{name}: {exc}"
    return None


def _block_product(w: torch.Tensor, stacked: int = 1) -> tuple[int, int, int]:
    """(kind, address of its C product, rows) for a matrix the C blocks multiply: (F32, 0,
    FLOAT_ROWS) for float32 weights; for a block format whose one-row kernel this process chose
    among its C builds, that one, and the rows up to which every row count's choice is a C build
    (RuntimeError naming the kernels otherwise).

    A batch of any size runs on that one product: where the timings chose another C build for
    some row counts (a few us apart, or one noisy timing), turning the C blocks away for it made
    a SmolLM2 token 50% slower (7.5 ms against 4.9)."""
    fmt = block_format(w)
    if fmt is None:
        return F32, 0, FLOAT_ROWS
    dtype, (out, inp) = dtype_name(w), matrix_size(w)
    out //= stacked  # a mixture's stack is multiplied an expert's rows at a time
    names = [chosen_kernel(dtype, rows, out, inp) for rows in range(1, MAX_ROWS + 1)]
    on_c = next((i for i, name in enumerate(names) if name not in BLOCK_BUILDS), len(names))
    if on_c == 0:
        raise RuntimeError(f"{dtype} {out}x{inp} runs on {sorted(set(map(str, names)))}, not C")
    fn = getattr(native.load(BLOCK_BUILDS[str(names[0])]),
                 f"{fmt.name}_{'q8' if names[0] in INTEGER else 'f32'}")  # fmt: skip
    return BLOCK_KINDS[fmt.name], ctypes.cast(fn, ctypes.c_void_p).value or 0, on_c


def _matrix(
    lib: ctypes.CDLL, w: torch.Tensor, stacked: int = 1
) -> tuple[FloatPointer | int, int, int]:
    """(address, kind, rows) of a weight matrix (a stack of `stacked` experts' rows) for the C
    blocks, its block product handed over: `rows`, as many as its product takes
    (`_block_product`)."""
    kind, product, rows = _block_product(w, stacked)
    if kind == F32:
        return _float_ptr(w), F32, rows
    assert w.is_contiguous()
    lib.rows_set_block_product(kind, product)
    return w.data_ptr(), kind, rows


# How rows.c numbers the KV cache formats (models/kvformat.py).
KV_KINDS = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}
KV_Q8_0 = 2


def _cache(keys: KVArrays, values: KVArrays) -> tuple[int, int, int | None, int | None, int]:
    """A layer's cache for rows.c: its keys' and values' addresses, their q8_0 scales' (or
    None), and the format's number."""
    if isinstance(keys, Q8Arrays) and isinstance(values, Q8Arrays):
        arrays = keys.codes, values.codes, keys.scales, values.scales
        assert all(a.flags.c_contiguous for a in arrays)
        k, v, sk, sv = (a.ctypes.data for a in arrays)
        return k, v, sk, sv, KV_Q8_0
    assert isinstance(keys, np.ndarray) and isinstance(values, np.ndarray)
    assert keys.flags.c_contiguous and values.flags.c_contiguous
    return keys.ctypes.data, values.ctypes.data, None, None, KV_KINDS[keys.dtype]


def _ptr(t: torch.Tensor | np.ndarray | None) -> FloatPointer | None:
    return None if t is None else _float_ptr(t)


def _float_ptr(t: torch.Tensor | np.ndarray) -> FloatPointer:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    assert a.dtype == np.float32 and a.flags.c_contiguous
    return a.ctypes.data_as(c_float_p)


class NativeBlocks(BlockBackend):
    """Every layer's block arguments for one slice (resident weights) and its KV cache and
    gated DeltaNet states; `begin_step` points them at a step's sequences. As a
    `BlockBackend`: a decode step's blocks of up to `max_rows` sequences, as many as every
    matrix's product takes: attention and FFN where the C blocks run every layer `whole`, else
    its attention layers' `attention` alone, gated DeltaNet layers where given their `linear`
    states, a mixture's SwiGLU `experts` (the model's other blocks then run on NumPy or torch)."""

    name = "c"

    def __init__(
        self,
        config: ModelConfig,
        s: Slice,
        layers: list[dict[str, torch.Tensor]],
        keys: list[KVArrays],
        values: list[KVArrays],
        whole: bool = True,
        linear: RecurrentStates | None = None,
        experts: bool = False,
        attention: bool = False,
    ) -> None:
        self.lib = load()
        self.config = config
        self.layers = layers  # held, as the caches are: the structs point into them
        self.caches = keys, values
        self.whole = whole
        self.linear = linear
        hd, nq, nkv = config.head_dim, s.n_q, s.n_kv
        group = config.group_size
        self.kv_of_q = (np.arange(*s.q_heads, dtype=np.int64) // group) - s.kv_heads[0]
        scale = config.query_scale or 1.0 / math.sqrt(hd)
        self.scratch: list[np.ndarray] = []
        self.attention_args: dict[int, AttentionArgs] = {}  # by layer
        self.ffn_args: list[FfnArgs] = []
        self.linear_args: dict[int, LinearArgs] = {}
        self.experts_args: list[ExpertsArgs] = []
        self.max_rows = MAX_ROWS
        gate = int(config.attention_gate)
        for i, w in enumerate(layers if whole or attention else []):
            if config.is_linear(i):
                continue
            wqkv, wo = _matrix(self.lib, w["wqkv"]), _matrix(self.lib, w["wo"])
            self.max_rows = min(self.max_rows, wqkv[2], wo[2])
            W = keys[i].shape[2]
            rows_room = (nq * (1 + gate) + 2 * nkv) * hd + nq * hd + config.hidden  # rows.c
            room = np.zeros(MAX_ROWS * rows_room, np.float32)
            self.scratch.append(room)
            local = config.is_local(i)
            self.attention_args[i] = AttentionArgs(
                config.hidden, hd, nq, nkv, config.rope_dims // 2,
                self.kv_of_q.ctypes.data_as(c_int64_p),
                _ptr(w["attn_norm"]), _ptr(w.get("q_norm")), _ptr(w.get("k_norm")),
                config.norm_eps, scale, ctypes.cast(wqkv[0], ctypes.c_void_p),
                _ptr(w.get("bqkv")), ctypes.cast(wo[0], ctypes.c_void_p), wqkv[1], wo[1],
                *_cache(keys[i], values[i]), W,
                int(local and config.sliding_window is not None),
                int(config.own_rope(i)), gate, _ptr(w.get("sinks")), _ptr(w.get("bo")),
                _ptr(room),
            )  # fmt: skip
            if not whole:
                continue
            gate_up, down = _matrix(self.lib, w["w_gate_up"]), _matrix(self.lib, w["w_down"])
            self.max_rows = min(self.max_rows, gate_up[2], down[2])
            n = matrix_size(w["w_down"])[1]
            room = np.zeros(MAX_ROWS * (config.hidden + 3 * n), np.float32)
            self.scratch.append(room)
            self.ffn_args.append(
                FfnArgs(
                    config.hidden, n, _ptr(w["ffn_norm"]), config.norm_eps,
                    int(config.activation == "gelu_tanh"),
                    ctypes.cast(gate_up[0], ctypes.c_void_p), ctypes.cast(down[0], ctypes.c_void_p),
                    gate_up[1], down[1], _ptr(room),
                )
            )  # fmt: skip
        for w in layers if experts else []:
            self._experts_layer(w)
        if linear is not None:
            self.key_of_value = key_of_value(config, s).numpy().astype(np.int64)
            for i in config.linear_layers:
                self._linear_layer(i, layers[i], s, linear)
        self.step = Step()
        self._held: tuple[np.ndarray, ...] = ()
        # (2 L) pointers, layer i's attention arguments at 2 i and its FFN's at 2 i + 1: what a
        # loop over every block takes (`run_layers`, node/csrc/hop.c).
        self.table = (ctypes.c_void_p * (2 * len(self.ffn_args)))()
        for i, f in enumerate(self.ffn_args):
            a = self.attention_args[i]
            self.table[2 * i], self.table[2 * i + 1] = ctypes.addressof(a), ctypes.addressof(f)

    def _experts_layer(self, w: dict[str, torch.Tensor]) -> None:
        """A layer's experts' arguments: its stacks of every expert's rows, an expert's rows a
        product."""
        stacked = self.config.n_stacked
        gate_up, down = (_matrix(self.lib, w[m], stacked) for m in ("w_gate_up", "w_down"))
        self.max_rows = min(self.max_rows, gate_up[2], down[2])
        d, n = self.config.hidden, matrix_size(w["w_down"])[1]
        room = np.zeros(MAX_ROWS * (3 * d + 3 * n), np.float32)
        self.scratch.append(room)
        row_bytes = [w[m][0].numel() * w[m].element_size() for m in ("w_gate_up", "w_down")]
        self.experts_args.append(
            ExpertsArgs(
                d, n, _ptr(w["ffn_norm"]), self.config.norm_eps,
                ctypes.cast(gate_up[0], ctypes.c_void_p), ctypes.cast(down[0], ctypes.c_void_p),
                gate_up[1], down[1], *row_bytes, _ptr(room),
            )
        )  # fmt: skip

    def _linear_layer(
        self, i: int, w: dict[str, torch.Tensor], s: Slice, linear: RecurrentStates
    ) -> None:
        """Layer i's gated DeltaNet arguments, pointing into its states (allocated once, in
        place from then on: node.kvcache.LinearStates)."""
        config = self.config
        wqkv, wo = _matrix(self.lib, w["wqkv"]), _matrix(self.lib, w["wo"])
        self.max_rows = min(self.max_rows, wqkv[2], wo[2])
        c, values = sum(channels(config, s)), s.n_linear * config.linear_v_dim
        width = c + values + 2 * s.n_linear
        room = np.zeros(MAX_ROWS * (config.hidden + width + values) + c, np.float32)
        self.scratch.append(room)
        conv, state = linear.conv[i], linear.states[i]
        assert conv.is_contiguous() and state.is_contiguous()
        self.linear_args[i] = LinearArgs(
            config.hidden, s.n_linear_keys, s.n_linear, config.linear_k_dim,
            config.linear_v_dim, config.linear_conv,
            self.key_of_value.ctypes.data_as(c_int64_p),
            _ptr(w["attn_norm"]), _ptr(w["conv"]), _ptr(w["decay"]), _ptr(w["dt"]),
            _ptr(w["ssm_norm"]), config.norm_eps, L2_EPS,
            ctypes.cast(wqkv[0], ctypes.c_void_p), ctypes.cast(wo[0], ctypes.c_void_p),
            wqkv[1], wo[1], _ptr(conv), _ptr(state), _ptr(room),
        )  # fmt: skip

    def begin_step(
        self,
        batch: StepBatch,
        cos_sin: tuple[np.ndarray, np.ndarray],
        local_cos_sin: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        """A decode step's sequences and their RoPE rows ((B, 1, half) each, from `Rope.rows`)."""
        slots, starts = self._set_step(batch)
        cos, sin = (np.ascontiguousarray(t, np.float32) for t in cos_sin)
        lcos, lsin = (
            (cos, sin)
            if local_cos_sin is None
            else (np.ascontiguousarray(t, np.float32) for t in local_cos_sin)
        )
        self._held = (slots, starts, cos, sin, lcos, lsin)  # the struct points into them
        st = self.step
        st.cos, st.sin = _ptr(cos), _ptr(sin)
        st.local_cos, st.local_sin = _ptr(lcos), _ptr(lsin)

    def _set_step(self, batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
        """The step's sequences (what a gated DeltaNet reads of it), and its blocks' threads."""
        slots = np.array(batch.slots, np.int64)
        starts = np.array(batch.starts, np.int64)
        self._held = (slots, starts)  # the struct points into them
        self.lib.rows_set_threads(blas_threads(), native.SMALL)  # as the NumPy path's
        st = self.step
        st.B = batch.size
        st.slots, st.starts = slots.ctypes.data_as(c_int64_p), starts.ctypes.data_as(c_int64_p)
        return slots, starts

    def supports(self, block: Block, batch: StepBatch) -> bool:
        ours = block in ("attention", "ffn") if self.whole else False
        ours = ours or (block == "attention" and bool(self.attention_args))
        ours = ours or (block == "linear" and self.linear is not None)
        ours = ours or (block == "experts" and bool(self.experts_args))
        return ours and batch.rows and batch.size <= self.max_rows

    def start_step(self, step: StepTables) -> None:
        assert step.cos_sin_rows is not None, "a decode step's"
        self.begin_step(step.batch, step.cos_sin_rows, step.local_cos_sin_rows)

    def attention(self, index: int, h: Hidden, w: Weights | None = None) -> Hidden:
        """Layer `index`'s attention partial for rows h (B, D); its weights are the ones this
        was built on (`w` is not read)."""
        out = np.empty_like(h)
        self.lib.rows_attention(
            ctypes.byref(self.attention_args[index]), ctypes.byref(self.step),
            _contiguous(h).ctypes.data, out.ctypes.data,
        )  # fmt: skip
        return out

    def linear_attention(self, index: int, h: Hidden, w: Weights | None = None) -> Hidden:
        """Layer `index`'s gated DeltaNet partial for rows h (B, D), each sequence's state
        brought to its start first (node.kvcache.LinearStates.prepare). A decode step's one
        token a sequence leaves nothing to keep: `finish` keeps steps of 2 or more tokens."""
        assert self.linear is not None
        self.linear.prepare(index, self.layers[index]["conv"])
        return self._linear(index, h)

    def experts(self, index: int, h: Hidden, w: Weights, routing: Routing) -> Hidden:
        """Layer `index`'s experts' partial for rows h (B, D) as `routing` chose them; its
        weights are the ones this was built on (`w` is not read)."""
        out = np.empty_like(h)
        chosen = np.ascontiguousarray(routing.experts, np.int64)
        weights = np.ascontiguousarray(routing.weights, np.float32)
        self.lib.rows_experts(
            ctypes.byref(self.experts_args[index]), ctypes.byref(self.step),
            _contiguous(h).ctypes.data, chosen.ctypes.data, weights.ctypes.data,
            chosen.shape[1], out.ctypes.data,
        )  # fmt: skip
        return out

    def _linear(self, index: int, h: Hidden) -> Hidden:
        out = np.empty_like(h)
        self.lib.rows_linear(
            ctypes.byref(self.linear_args[index]), ctypes.byref(self.step),
            _contiguous(h).ctypes.data, out.ctypes.data,
        )  # fmt: skip
        return out

    def ffn(self, index: int, h: Hidden, w: Weights | None = None) -> Hidden:
        out = np.empty_like(h)
        self.lib.rows_ffn(
            ctypes.byref(self.ffn_args[index]), ctypes.byref(self.step),
            _contiguous(h).ctypes.data, out.ctypes.data,
        )  # fmt: skip
        return out

    def run_layers(
        self, h: np.ndarray, post_norms: np.ndarray | None = None, eps: float = 0.0
    ) -> np.ndarray:
        """Every layer on h (B, D), each block's output summed into it, normed first by its
        row of `post_norms` (2 layers, D) where the model has them: the decode step of a node
        that holds every layer whole, in one call (the engine's loop over the blocks costs ~18
        us of Python a block, 60 a SmolLM2 token; with Gemma 3's post-block norms, 3.5 ms of
        its 25). The same float32 sums and norms in the same order as that loop: the same
        numbers."""
        h = np.array(h, np.float32, order="C")  # a copy: summed into in place
        out = np.empty_like(h)
        norms = None if post_norms is None else np.ascontiguousarray(post_norms, np.float32)
        self.lib.rows_layers(
            self.table, len(self.ffn_args), ctypes.byref(self.step),
            h.ctypes.data, out.ctypes.data, None if norms is None else norms.ctypes.data, eps,
        )  # fmt: skip
        return h

    def check(self, s: Slice, keys: list[KVArrays], values: list[KVArrays]) -> str | None:
        """Compare this build's partials with the NumPy path's on the first attention layer
        (and its FFN where whole), on layer 0's experts, and torch's on the first gated DeltaNet
        layer, for random rows at a few positions (slot 0, whose cache and state a first
        request fills anew); None when they agree, else what differed."""
        if self.linear is not None:
            why = self._check_linear(s)
            if why is not None:
                return why
        if self.experts_args:
            why = self._check_experts()
            if why is not None:
                return why
        if not self.attention_args:
            return None
        config, i = self.config, min(self.attention_args)
        rope = Rope(config, max(4, keys[i].shape[2]))
        rng = np.random.default_rng(0)
        saved = [a[0].copy() for a in (*kv_parts(keys[i]), *kv_parts(values[i]))]
        try:
            for pos in range(3):
                batch = StepBatch((0,), (pos,), (1,))
                cos_sin = rope.rows(batch.starts)
                h = rng.standard_normal((1, config.hidden), dtype=np.float32)
                want = attention_rows(
                    h, self.layers[i], s, config, cos_sin, keys[i], values[i], batch,
                    config.sliding_window if config.is_local(i) else None,
                )  # fmt: skip
                self.begin_step(batch, cos_sin, None)
                compared = [("attention", self.attention(i, h), want, ROUNDING[format_of(keys[i])])]
                if self.whole:
                    compared.append(
                        ("ffn", self.ffn(i, h), ffn_rows(h, self.layers[i], config), 0.0)
                    )
                for name, a, b, rounding in compared:
                    limit = (TOLERANCE + rounding) * max(1.0, float(np.abs(b).max()))
                    worst = float(np.abs(a - b).max())
                    if not worst <= limit:
                        return f"{name} at position {pos} differs by {worst:.3g} (> {limit:.3g})"
            native, numpy = self._time(s, i, h, keys, values, rope)
            if native > SLOWER * numpy:
                return f"slower than NumPy here ({native:.0f} against {numpy:.0f} us a layer)"
        finally:
            for a, was in zip((*kv_parts(keys[i]), *kv_parts(values[i])), saved, strict=True):
                a[0] = was
        return None

    def _check_experts(self) -> str | None:
        """Layer 0's experts for 3 random rows, each with its own random choice of them,
        against NumPy's (models/moe.py); then both timed, as `_time` times the other blocks."""
        config, w = self.config, self.layers[0]
        rng = np.random.default_rng(0)
        h = rng.standard_normal((3, config.hidden), dtype=np.float32)
        k = config.n_experts_used + config.n_shared
        chosen = np.stack([rng.permutation(config.n_stacked)[:k] for _ in range(3)])
        routing = Routing(chosen.astype(np.int64), rng.random((3, k), dtype=np.float32))
        self._set_step(StepBatch((0, 1, 2), (0, 0, 0), (1, 1, 1)))
        got, want = self.experts(0, h, w, routing), moe_rows(h, w, config, routing)
        limit = TOLERANCE * max(1.0, float(np.abs(want).max()))
        worst = float(np.abs(got - want).max())
        if not worst <= limit:
            return f"experts differ by {worst:.3g} (> {limit:.3g})"
        best = [math.inf, math.inf]  # CPU us a call, as `_time` takes them
        for _ in range(TIMING_ROUNDS):
            started = time.process_time()
            for _ in range(TIMING_CALLS):
                self.experts(0, h, w, routing)
            best[0] = min(best[0], time.process_time() - started)
            started = time.process_time()
            for _ in range(TIMING_CALLS):
                moe_rows(h, w, config, routing)
            best[1] = min(best[1], time.process_time() - started)
        c_us, numpy_us = (b / TIMING_CALLS * 1e6 for b in best)
        if c_us > SLOWER * numpy_us:
            return f"experts slower than NumPy here ({c_us:.0f} against {numpy_us:.0f} us)"
        return None

    def _check_linear(self, s: Slice) -> str | None:
        """The first gated DeltaNet layer's partials and the state it leaves, 3 tokens from a
        random state, against torch's (models/deltanet.py) from the same state; then both
        timed, as `_time` times the other blocks."""
        assert self.linear is not None
        config, i = self.config, self.config.linear_layers[0]
        conv, state = self.linear.conv[i], self.linear.states[i]
        saved = conv[0].clone(), state[0].clone()
        gen = torch.Generator().manual_seed(0)
        try:
            conv[0] = torch.randn(conv[0].shape, generator=gen)
            state[0] = torch.randn(state[0].shape, generator=gen) * 0.1
            want_conv, want_state = conv.clone(), state.clone()
            for pos in range(3):
                batch = StepBatch((0,), (pos + 1,), (1,))
                h = torch.randn(1, config.hidden, generator=gen)
                family = family_of(config)
                with torch.inference_mode():
                    out = family.linear_partial(
                        h[:, None], self.layers[i], s, config, want_conv, want_state, batch
                    )[0]
                want = out[:, 0].numpy()
                self._set_step(batch)
                got = self._linear(i, h.numpy())
                for name, a, b in (
                    ("gated DeltaNet", got, want),
                    ("its state", state[0].numpy(), want_state[0].numpy()),
                    ("its convolution's inputs", conv[0].numpy(), want_conv[0].numpy()),
                ):
                    limit = TOLERANCE * max(1.0, float(np.abs(b).max()))
                    worst = float(np.abs(a - b).max())
                    if not worst <= limit:
                        return f"{name} at position {pos} differs by {worst:.3g} (> {limit:.3g})"
            best = [math.inf, math.inf]  # CPU us a call, as `_time` takes them
            for _ in range(TIMING_ROUNDS):
                started = time.process_time()
                for _ in range(TIMING_CALLS):
                    self._linear(i, h.numpy())
                best[0] = min(best[0], time.process_time() - started)
                started = time.process_time()
                with torch.inference_mode():
                    for _ in range(TIMING_CALLS):
                        family.linear_partial(
                            h[:, None], self.layers[i], s, config, want_conv, want_state, batch
                        )
                best[1] = min(best[1], time.process_time() - started)
            c_us, torch_us = (b / TIMING_CALLS * 1e6 for b in best)
            if c_us > SLOWER * torch_us:
                return f"slower than torch here ({c_us:.0f} against {torch_us:.0f} us a layer)"
        finally:
            conv[0], state[0] = saved
        return None

    def _time(
        self,
        s: Slice,
        i: int,
        h: np.ndarray,
        keys: list[KVArrays],
        values: list[KVArrays],
        rope: Any,
    ) -> tuple[float, float]:
        """CPU us of layer i (its attention, and its FFN where whole) natively and on NumPy,
        the best of alternating rounds.

        CPU time, not wall time: on a device under a CPU quota a round's wall time includes
        the periods it was throttled, and which of two close rounds lands in one is chance
        (measured at cpu=0.5: 1066 against 492 us, the native blocks turned away)."""
        config, w = self.config, self.layers[i]
        batch = StepBatch((0,), (2,), (1,))
        cos_sin = rope.rows(batch.starts)
        self.begin_step(batch, cos_sin, None)
        window = config.sliding_window if config.is_local(i) else None
        best = [math.inf, math.inf]
        for _ in range(TIMING_ROUNDS):
            started = time.process_time()
            for _ in range(TIMING_CALLS):
                a = self.attention(i, h)
                if self.whole:
                    self.ffn(i, a)
            best[0] = min(best[0], time.process_time() - started)
            started = time.process_time()
            for _ in range(TIMING_CALLS):
                a = attention_rows(h, w, s, config, cos_sin, keys[i], values[i], batch, window)
                if self.whole:
                    ffn_rows(a, w, config)
            best[1] = min(best[1], time.process_time() - started)
        return best[0] / TIMING_CALLS * 1e6, best[1] / TIMING_CALLS * 1e6


def _contiguous(h: np.ndarray) -> np.ndarray:
    if h.dtype == np.float32 and h.flags.c_contiguous:
        return h
    return np.ascontiguousarray(h, np.float32)


def admit(
    config: ModelConfig,
    s: Slice,
    layers: list[dict[str, torch.Tensor]],
    keys: list[KVArrays],
    values: list[KVArrays],
    linear: RecurrentStates | None = None,
) -> NativeBlocks | None:
    """Native blocks for this slice where this device builds them and they agree with the
    NumPy and torch paths: every layer's attention and FFN, and where a model has blocks the C
    code lacks, those it has (gated DeltaNet layers, a mixture's experts); None (logged)
    otherwise."""
    whole = unsupported(config, layers[0])
    first = next((i for i in range(len(layers)) if not config.is_linear(i)), None)
    attention = (
        "no attention layers" if first is None else attention_unsupported(config, layers[first])
    )
    deltanet = "no states given" if linear is None else deltanet_unsupported(config, layers)
    experts = experts_unsupported(config, layers)
    why: str | None = (
        f"{whole}; attention: {attention}; gated DeltaNet: {deltanet}; experts: {experts}"
    )
    if whole is None or attention is None or deltanet is None or experts is None:
        try:
            blocks = NativeBlocks(
                config, s, layers, keys, values, whole is None,
                linear if deltanet is None else None, experts is None, attention is None,
            )  # fmt: skip
            why = blocks.check(s, keys, values)
        except (RuntimeError, OSError) as exc:
            why = str(exc)
    if why is not None:
        log.info("decode blocks run on NumPy: %s", why)
        return None
    if whole is not None:
        parts = (("attention", attention), ("gated DeltaNet", deltanet), ("experts", experts))
        ran = [n for n, no in parts if no is None]
        log.info("%s decode in C; the other blocks on NumPy: %s", " and ".join(ran), whole)
    return blocks
