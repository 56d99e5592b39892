"""Where a model's weights come from: a GGUF file, an HF safetensors folder, or a bundled name.

Every source hands out the same canonical tensors (see `models.layers.LAYER_TENSORS`), a layer or
a band of rows at a time, so callers never need the whole model in memory.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from edgetp.models import native
from edgetp.models.activations import Activations, check_activations, default_activations
from edgetp.models.bundled import model_path
from edgetp.models.config import ModelConfig
from edgetp.models.config_files import config_from_gguf
from edgetp.models.dtypes import AUTO, SOURCE_TYPES
from edgetp.models.errors import ModelError
from edgetp.models.families import family_of
from edgetp.models.gguf_file import GGUFFile
from edgetp.models.hf_source import _HF_LAYER as _HF_LAYER
from edgetp.models.hf_source import HFSource as HFSource
from edgetp.models.hf_source import _next_rows
from edgetp.models.hf_source import hf_layer_name as hf_layer_name
from edgetp.models.layers import (
    EXPERT_BIAS_TENSORS,
    O_BIAS,
    ROUTER,
    ROUTER_BIAS,
    SHARED_ROUTER,
    SINKS,
    expert_of,
)
from edgetp.models.quant import FORMATS
from edgetp.models.ranges import RemoteFile, RemoteModel, write_whole
from edgetp.models.source_base import GGUF_FUSED, fused_rows
from edgetp.models.source_base import ModelSource as ModelSource
from edgetp.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def open_model(spec: str | Path | None = None) -> ModelSource:
    """A GGUF file path, an HF folder path, or a bundled model name (default: SmolLM2)."""
    path = model_path(spec)
    if path.is_dir():
        return HFSource(path)
    return GGUFSource(path)


def open_remote(model: RemoteModel, folder: Path) -> tuple[ModelSource, list[RemoteFile]]:
    """A model on the hub as a worker opens it to split its share: its sparse mirror in
    `folder` (a GGUF file, or an HF folder with its small files written whole), read by ranges;
    and the mirrors of its weight files, whose counts say what was fetched."""
    remotes = {n: RemoteFile(r, folder / n) for n, r in model.files.items()}
    for name, data in model.small.items():
        write_whole(folder / name, data)
    if not model.small and all(n.endswith(".gguf") for n in remotes):  # a file, or a split's
        first = min(remotes)  # -00001-of-0000N sorts first
        return GGUFSource(folder / first, remotes), list(remotes.values())
    return HFSource(folder, remotes), list(remotes.values())


def default_dtype(spec: str | Path | None = None) -> str:
    """The shard dtype when none is asked for: a GGUF file's weights as the file stores them
    (`auto`: 4-bit decode measured at 1.26x llama.cpp's time on the same file,
    docs/bench/README.md), an HF folder's as float32 (their bf16 or f16
    would decode on torch's kernels, which round the input). Where the block formats' C kernels
    cannot be built (no compiler), float32, saying so: the default command runs anywhere."""
    path = model_path(spec)
    if path.is_dir():
        return "f32"
    try:
        native.load(native.default_build())
    except (RuntimeError, OSError) as e:
        log.warning(
            "the model's own block formats need C kernels (%s): running its weights as f32 "
            "(install gcc for its own, smaller ones)",
            e,
        )
        return "f32"
    return AUTO


def model_activations(source: ModelSource, dtype: str, asked: str) -> Activations:
    """The activations `asked` for this model split at `dtype`: `auto` is int8 where its first
    layer's matrices are in a format measured to take int8 activations as llama.cpp does
    (models/activations.py), else exact."""
    if asked != "auto":
        return check_activations(asked)
    return default_activations(source.matrix_dtypes(0, dtype).values())


# GGUF tensor names of the canonical per-layer tensors.
_GGUF_LAYER = {
    "attn_norm": "attn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "o": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight",
    "up": "ffn_up.weight",
    "down": "ffn_down.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "post_ffn_norm": "post_ffw_norm.weight",
    ROUTER: "ffn_gate_inp.weight",
    "shared_gate": "ffn_gate_shexp.weight",
    "shared_up": "ffn_up_shexp.weight",
    "shared_down": "ffn_down_shexp.weight",
    SHARED_ROUTER: "ffn_gate_inp_shexp.weight",  # (hidden,): one row
    ROUTER_BIAS: "ffn_gate_inp.bias",
    SINKS: "attn_sinks.weight",
    O_BIAS: "attn_output.bias",
    # a gated DeltaNet layer's (qwen35, qwen35moe, qwen3next): llama.cpp's converter writes the
    # decay rate as -exp(A_log) already, and qwen3next's b and a as one matrix (`_next_rows`)
    "ssm_qkv": "attn_qkv.weight",
    "ssm_z": "attn_gate.weight",
    "ssm_b": "ssm_beta.weight",
    "ssm_a": "ssm_alpha.weight",
    "ssm_conv": "ssm_conv1d.weight",
    "ssm_decay": "ssm_a",
    "ssm_dt": "ssm_dt.bias",
    "ssm_norm": "ssm_norm.weight",
    "ssm_out": "ssm_out.weight",
}
# A mixture of experts' stacks, (n_experts, out, in) each: expert e's rows follow expert e - 1's.
_GGUF_EXPERTS = {"gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight",
                 "down": "ffn_down_exps.weight", "gate_bias": "ffn_gate_exps.bias",
                 "up_bias": "ffn_up_exps.bias", "down_bias": "ffn_down_exps.bias"}  # fmt: skip
# gpt-oss' FFN norm, which llama.cpp names after HF's post_attention_layernorm (Qwen3.5's too)
_GGUF_GPT_OSS_FFN_NORM = "post_attention_norm.weight"
_GGUF_NEXT_BA = "ssm_ba.weight"
# What a qwen35 file holds in llama.cpp's tiled order of value heads (`_tiled_order`): rows,
# but the out-projection's columns.
_TILED = ("ssm_qkv", "ssm_z", "ssm_b", "ssm_a", "ssm_conv", "ssm_decay", "ssm_dt", "ssm_out")


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> half-split pairs)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
        .contiguous()
    )


def _tiled_order(config: ModelConfig, name: str) -> torch.Tensor:
    """Where a qwen35 file stores each of canonical `name`'s rows (its columns: ssm_out).
    llama.cpp's converter puts the value heads that read one key head not side by side (as
    transformers holds them) but a key head's r-th after every key head's (r - 1)-th, for its
    broadcasts: value head i g + r of the g a key head is stored at r nk + i."""
    nk, g = config.linear_k_heads, config.linear_group
    width = 1 if name in ("ssm_b", "ssm_a", "ssm_decay", "ssm_dt") else config.linear_v_dim
    heads = torch.arange(nk * g)
    stored = (heads % g) * nk + heads // g  # (nv,): each grouped head's tiled place
    values = (stored.unsqueeze(1) * width + torch.arange(width)).flatten()
    if name in ("ssm_qkv", "ssm_conv"):  # the queries' and keys' rows, then the values'
        keys = 2 * nk * config.linear_k_dim
        return torch.cat((torch.arange(keys), keys + values))
    return values


def _gguf_name(
    layer: int | None,
    name: str,
    tied: bool,
    fused: bool = False,
    ffn_norm_after_attention: bool = False,
) -> str:
    expert = expert_of(name)
    if layer is not None and expert is not None:
        return f"blk.{layer}.{_GGUF_EXPERTS[expert[0]]}"
    if layer is not None and ffn_norm_after_attention and name == "ffn_norm":
        return f"blk.{layer}.{_GGUF_GPT_OSS_FFN_NORM}"
    if layer is not None:
        stored = GGUF_FUSED[name] if fused and name in GGUF_FUSED else _GGUF_LAYER[name]
        return f"blk.{layer}.{stored}"
    if name == "lm_head" and not tied:
        return "output.weight"
    return "output_norm.weight" if name == "final_norm" else "token_embd.weight"


class GGUFSource(ModelSource):
    """A GGUF file; or, with `remotes` (or a mirror's record beside `path`), the sparse mirror
    of one on the hub, whose bytes are fetched as they are read (models/ranges.py)."""

    def __init__(self, path: Path, remotes: dict[str, RemoteFile] | None = None) -> None:
        self.path = path
        self.file = GGUFFile(path, remotes)
        tied = not self.file.has_tensor("output.weight")
        longrope = None
        if self.file.has_tensor("rope_factors_short.weight"):  # llama.cpp's LongRoPE tensors
            longrope = (
                self.file.tensor("rope_factors_short.weight").tolist(),
                self.file.tensor("rope_factors_long.weight").tolist(),
            )
        config = config_from_gguf(self.file.metadata, str(path), tied, longrope)
        # what the file's tensors, not its keys, say of its family's fields
        config = replace(config, **family_of(config).gguf_tensor_fields(config, self.file))
        # a llama's attention biases have no key: llama.cpp loads the tensors where they are
        self.config = replace(
            config,
            qkv_bias=config.qkv_bias or self.file.has_tensor("blk.0.attn_q.bias"),
            o_bias=config.o_bias or self.file.has_tensor("blk.0.attn_output.bias"),
        )
        gemma4_mixture = bool(self.config.dense_ffn)  # its gate and up in one stack
        if (
            not gemma4_mixture
            and self.config.moe
            and self.file.has_tensor("blk.0.ffn_gate_up_exps.weight")
        ):
            raise ModelError(
                f"{path}: its experts' gate and up are one stacked tensor (ffn_gate_up_exps), "
                "which edgetp does not read yet: convert the model without fusing them"
            )
        if (
            not gemma4_mixture
            and self.config.moe
            and not self.file.has_tensor("blk.0.ffn_gate_exps.weight")
        ):
            raise ModelError(
                f"{path}: its experts are not stacked as blk.N.ffn_gate_exps.weight (an older "
                "converter's layout, one tensor an expert): convert the model again with a "
                "current llama.cpp"
            )
        # llama.cpp's converter permutes Q/K rows for its interleaved RoPE for some families
        self._permuted = family_of(self.config).gguf_permuted
        c = self.config
        # qwen35's value heads in the tiled order (`_tiled_order`), where heads share keys
        self._tiled = c.architecture in ("qwen35", "qwen35moe") and c.linear_group > 1
        self._next = c.architecture == "qwen3next"  # its b and a in one matrix
        for name in self.file.tensor_names():  # say it now, not halfway through a split
            kind = self.file.info(name).tensor_type.name
            if kind not in SOURCE_TYPES:
                raise ModelError(
                    f"{path}: tensor {name} is stored as {kind}, which edgetp cannot read "
                    f"(it reads {', '.join(SOURCE_TYPES)}); convert the model with another "
                    "quantization"
                )

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf_metadata(self.file.metadata, str(self.path))

    def _name(self, layer: int | None, name: str) -> str:
        c = self.config
        own = family_of(c).gguf_name(c, layer, name)
        if own is not None:
            return own
        if layer is not None and self._next and name in ("ssm_b", "ssm_a"):
            return f"blk.{layer}.{_GGUF_NEXT_BA}"
        # gpt-oss' and the DeltaNet families' FFN norm is named after attention
        after = c.expert_bias or bool(c.linear_layers)
        return _gguf_name(layer, name, c.tied_embeddings, c.fused, after)

    def _reordered(self, layer: int | None, name: str) -> torch.Tensor | None:
        """The rows of the stored tensor, in order, that hold canonical `name` where the file
        keeps them in another order (qwen35's tiled value heads, qwen3next's b and a); None
        where it keeps them as they are."""
        if layer is None or not self.config.is_linear(layer):
            return None
        if self._next and name in ("ssm_b", "ssm_a"):
            return _next_rows(self.config, name)
        if self._tiled and name in _TILED:
            return _tiled_order(self.config, name)
        return None

    def _stored_type(self, layer: int | None, name: str) -> str:
        kind = self.file.info(self._name(layer, name)).tensor_type.name
        if self._reordered(layer, name) is not None and not self._moves_blocks(name, kind):
            return "F32"  # read as floats to be put back in order (blocks would cut heads)
        return kind

    def _moves_blocks(self, name: str, kind: str) -> bool:
        """Whether a reordered tensor of this type is put back in order as whole blocks: rows
        always (each is whole blocks), ssm_out's columns where a value head is whole blocks."""
        fmt = FORMATS.get(kind.lower())
        if fmt is None:
            return False
        return name != "ssm_out" or self.config.linear_v_dim % fmt.block_values == 0

    def _rows(
        self, layer: int | None, name: str, start: int, stop: int, blocks: bool
    ) -> torch.Tensor:
        gguf_name = self._name(layer, name)
        kind = self.file.info(gguf_name).tensor_type.name.lower()
        at = fused_rows(self.config, layer, name)
        expert = expert_of(name) if layer is not None else None
        if expert is not None:  # a stack's rows: expert e's after e experts' rows
            at = expert[1] * self.shape(layer, name)[0]
            if self.config.dense_ffn and expert[0] in ("gate", "up"):  # Gemma 4's: both
                at = (2 * expert[1] + (expert[0] == "up")) * self.config.ffn_hidden
        if name == SHARED_ROUTER:  # a vector in the file, one row here
            return self.file.tensor(gguf_name).view(1, -1)[start:stop]
        if expert is not None and expert[0] in EXPERT_BIAS_TENSORS:  # (E, n): a few floats
            return self.file.tensor(gguf_name).reshape(-1)[at + start : at + stop]
        order = self._reordered(layer, name)
        if order is not None and blocks and self._moves_blocks(name, kind):
            fmt = FORMATS[kind]
            if name == "ssm_out":  # its value heads are its columns: whole blocks of them
                cols = fmt.from_bytes(self.file.stored_rows(gguf_name, start, stop))
                return cols[:, order[:: fmt.block_values] // fmt.block_values].contiguous()
            rows = fmt.from_bytes(self.file.stored_rows(gguf_name, 0, len(order)))
            return rows[order[start:stop]].contiguous()
        if order is not None and name == "ssm_out":  # its value heads are its columns
            return self.file.tensor_rows(gguf_name, start, stop)[:, order].contiguous()
        if order is not None:
            return self.file.tensor(gguf_name)[order[start:stop]].contiguous()
        if blocks and kind in FORMATS:
            stored = self.file.stored_rows(gguf_name, at + start, at + stop)
            out = FORMATS[kind].from_bytes(stored)
        else:
            out = self.file.tensor_rows(gguf_name, at + start, at + stop)
        if self._permuted and layer is not None and name in ("q", "k", "q_bias", "k_bias"):
            hd = self.config.head_dim
            if start % hd or stop % hd:
                raise ValueError(f"rows {start}:{stop} of {gguf_name} cut through a head")
            out = unpermute_qk(out, (stop - start) // hd)
        return out

    def weight_files(self) -> list[Path]:
        return list(self.file.paths)

    def remote(self) -> RemoteModel | None:
        files = {r.local.name: r.remote for r in self.file.remotes if r is not None}
        return RemoteModel(files) if files else None

    def fetched(self) -> None:
        for remote in self.file.remotes:
            if remote is not None:
                remote.save()

    def _only_columns(self, layer: int | None, name: str, cols: tuple[int, int] | None) -> None:
        if not any(self.file.remotes):  # a local file: nothing to fetch
            return
        if self._reordered(layer, name) is not None:  # its columns move: read them all
            cols = None
        self.file.only_columns(self._name(layer, name), cols)

    def rope_freq_factors(self) -> torch.Tensor | None:
        if self.file.has_tensor("rope_freqs.weight"):
            return self.file.tensor("rope_freqs.weight")
        return None
