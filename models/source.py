"""Where a model's weights come from: a GGUF file, an HF safetensors folder, or a bundled name.

Every source hands out the same canonical tensors (see `models.layers.LAYER_TENSORS`), a layer or
a band of rows at a time, so callers never need the whole model in memory.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from models import native
from models.bundled import check_kind, model_path
from models.config import ModelConfig
from models.dtypes import AUTO, SOURCE_TYPES, embedding_dtype, matrix_dtype
from models.errors import ModelError
from models.families import HF_ARCHITECTURES
from models.gguf_file import GGUFFile
from models.layers import (
    EXPERT_TENSORS,
    MATRICES,
    POST_NORM_TENSORS,
    POST_NORMS,
    ROUTER,
    SHARED_ROUTER,
    Slice,
    full_layer_shapes,
    layer_tensor_names,
    slice_parts,
)
from models.quant import BLOCK, FORMATS
from models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class ModelSource(ABC):
    """A model's config, tokenizer and full tensors, read on demand: whole, or a band of rows
    at a time (`rows`), as float32 or, where the source stores one of the engine's block
    formats and the caller asks for it, as those blocks byte for byte."""

    path: Path
    config: ModelConfig

    @property
    def name(self) -> str:
        return self.path.name

    @abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    def stored_type(self, layer: int | None, name: str) -> str:
        """How the source stores a tensor: a GGUF type name, or F32, F16, BF16. `name` is a
        canonical layer tensor (`layer` its index) or, with `layer` None, "embedding",
        "lm_head", "final_norm", POST_NORMS or ROUTER."""
        if layer is None and name in (POST_NORMS, ROUTER):  # the master's, as float32
            return "F32"
        return self._stored_type(layer, name)

    def rows(
        self, layer: int | None, name: str, start: int, stop: int, blocks: bool = False
    ) -> torch.Tensor:
        """Rows [start, stop) of a tensor (named as in `stored_type`): float32, or with `blocks`
        the stored blocks where they are in one of models.quant's formats. Q and K rows come in
        whole heads."""
        if name == POST_NORMS:  # row 2 i: layer i's post-attention norm, 2 i + 1: post-FFN
            return torch.stack(
                [self.tensor(r // 2, POST_NORM_TENSORS[r % 2]) for r in range(start, stop)]
            )
        if layer is None and name == ROUTER:  # rows e of layer i at i router_rows + e
            n = self.config.router_rows
            layers = range(start // n, (stop - 1) // n + 1)
            bands = [self._router(i, max(start - i * n, 0), min(stop - i * n, n)) for i in layers]
            return torch.cat(bands)
        return self._rows(layer, name, start, stop, blocks)

    def _router(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a layer's rows of ROUTER: its router's, then its shared
        expert's gate."""
        n = self.config.n_experts
        bands = [self._rows(layer, ROUTER, start, min(stop, n), False)] if start < n else []
        if stop > n:  # the shared expert's gate, row n
            bands.append(self._rows(layer, SHARED_ROUTER, 0, 1, False))
        return torch.cat(bands)

    @abstractmethod
    def _stored_type(self, layer: int | None, name: str) -> str: ...

    @abstractmethod
    def _rows(
        self, layer: int | None, name: str, start: int, stop: int, blocks: bool
    ) -> torch.Tensor: ...

    def shape(self, layer: int | None, name: str) -> tuple[int, ...]:
        c = self.config
        if layer is not None:
            return full_layer_shapes(c)[name]
        if name == POST_NORMS:
            return (2 * c.n_layers, c.hidden)
        if name == ROUTER:
            return (c.n_layers * c.router_rows, c.hidden)
        return (c.hidden,) if name == "final_norm" else (c.vocab_size, c.hidden)

    def tensor(self, layer: int | None, name: str, blocks: bool = False) -> torch.Tensor:
        return self.rows(layer, name, 0, self.shape(layer, name)[0], blocks)

    def layer(self, index: int, blocks: bool = False) -> dict[str, torch.Tensor]:
        """Layer `index`'s full tensors under canonical names."""
        return {name: self.tensor(index, name, blocks) for name in self.layer_tensors()}

    def layer_tensors(self) -> tuple[str, ...]:
        return layer_tensor_names(self.config)  # the post norms and router are the master's

    def global_names(self) -> list[str]:
        """The tensors the master holds whole: the embedding, lm_head and norms after the
        layers' sums."""
        c = self.config
        return (
            ["final_norm", "embedding"]
            + ([] if c.tied_embeddings else ["lm_head"])
            + ([POST_NORMS] if c.post_norms else [])
            + ([ROUTER] if c.moe else [])
        )

    def embedding(self) -> torch.Tensor:
        """(vocab, hidden)."""
        return self.tensor(None, "embedding")

    def final_norm(self) -> torch.Tensor:
        return self.tensor(None, "final_norm")

    def lm_head(self) -> torch.Tensor:
        """(vocab, hidden); the embedding itself when the model ties them."""
        return self.tensor(None, "lm_head")

    def rope_freq_factors(self) -> torch.Tensor | None:
        return None

    def matrix_dtypes(self, layer: int, dtype: str) -> dict[str, str]:
        """The shard dtype of each of a layer's fused matrices (`models.layers.MATRICES`) when
        the split asks for `dtype` (`auto`: as this source stores them)."""
        parts = slice_parts(self.config, Slice.whole(self.config))
        return {
            m: matrix_dtype(dtype, [self.stored_type(layer, p.source) for p in parts[m]])
            for m in MATRICES
        }

    def ffn_align(self, dtype: str) -> int:
        """The columns a plan cuts the FFN in multiples of, for a split at `dtype`: the widest
        block of any layer's down projection (256 for a K-quant file's), so that every node's
        slice of it is whole blocks of the file's own."""
        return max(
            FORMATS[d].block_values if d in FORMATS else BLOCK
            for layer in range(self.config.n_layers)
            for d in [self.matrix_dtypes(layer, dtype)["w_down"]]
        )

    def head_dtype(self, dtype: str) -> str:
        """The shard dtype of the embedding and lm_head when the split asks for `dtype`."""
        return embedding_dtype(dtype, self.stored_type(None, "embedding"))


def open_model(spec: str | Path | None = None) -> ModelSource:
    """A GGUF file path, an HF folder path, or a bundled model name (default: SmolLM2)."""
    path = model_path(spec)
    if path.is_dir():
        return HFSource(path)
    return GGUFSource(path)


def default_dtype(spec: str | Path | None = None) -> str:
    """The shard dtype when none is asked for: a GGUF file's weights as the file stores them
    (`auto`: 4-bit decode measured at 1.26x llama.cpp's time on the same file,
    docs/bench/smollm2-q4_1-vs-llamacpp.txt), an HF folder's as float32 (their bf16 or f16
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
}
# A mixture of experts' stacks, (n_experts, out, in) each: expert e's rows follow expert e - 1's.
_GGUF_EXPERTS = {"gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight",
                 "down": "ffn_down_exps.weight"}  # fmt: skip


# Where a fused family (Phi-3) stores the canonical matrices: Q, K, V one after another in one
# matrix, gate then up in another; `fused_rows` gives each one's first row.
_GGUF_FUSED = {
    "q": "attn_qkv.weight",
    "k": "attn_qkv.weight",
    "v": "attn_qkv.weight",
    "gate": "ffn_up.weight",
    "up": "ffn_up.weight",
}
_HF_FUSED = {
    "q": "self_attn.qkv_proj.weight",
    "k": "self_attn.qkv_proj.weight",
    "v": "self_attn.qkv_proj.weight",
    "gate": "mlp.gate_up_proj.weight",
    "up": "mlp.gate_up_proj.weight",
}


def expert_of(name: str) -> tuple[str, int] | None:
    """("gate", 3) for canonical "gate.3": an expert's tensor; None for any other."""
    base, _, expert = name.partition(".")
    return (base, int(expert)) if base in EXPERT_TENSORS and expert.isdigit() else None


def fused_rows(config: ModelConfig, layer: int | None, name: str) -> int:
    """The row of its fused matrix at which canonical tensor `name` starts (0 where the model
    stores it on its own)."""
    if not config.fused or layer is None or name not in _GGUF_FUSED:
        return 0
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return {"q": 0, "k": q, "v": q + kv, "gate": 0, "up": config.ffn_hidden}[name]


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> half-split pairs)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
        .contiguous()
    )


def _gguf_name(layer: int | None, name: str, tied: bool, fused: bool = False) -> str:
    expert = expert_of(name)
    if layer is not None and expert is not None:
        return f"blk.{layer}.{_GGUF_EXPERTS[expert[0]]}"
    if layer is not None:
        stored = _GGUF_FUSED[name] if fused and name in _GGUF_FUSED else _GGUF_LAYER[name]
        return f"blk.{layer}.{stored}"
    if name == "lm_head" and not tied:
        return "output.weight"
    return "output_norm.weight" if name == "final_norm" else "token_embd.weight"


class GGUFSource(ModelSource):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = GGUFFile(path)
        tied = not self.file.has_tensor("output.weight")
        longrope = None
        if self.file.has_tensor("rope_factors_short.weight"):  # llama.cpp's LongRoPE tensors
            longrope = (
                self.file.tensor("rope_factors_short.weight").tolist(),
                self.file.tensor("rope_factors_long.weight").tolist(),
            )
        self.config = ModelConfig.from_gguf(self.file.metadata, str(path), tied, longrope)
        if self.config.moe and not self.file.has_tensor("blk.0.ffn_gate_exps.weight"):
            raise ModelError(
                f"{path}: its experts are not stacked as blk.N.ffn_gate_exps.weight (an older "
                "converter's layout, one tensor an expert): convert the model again with a "
                "current llama.cpp"
            )
        # llama.cpp's converter permutes Q/K rows for its interleaved RoPE only for these.
        self._permuted = self.config.architecture in ("llama", "mistral", "smollm3")
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
        return _gguf_name(layer, name, c.tied_embeddings, c.fused)

    def _stored_type(self, layer: int | None, name: str) -> str:
        return self.file.info(self._name(layer, name)).tensor_type.name

    def _rows(
        self, layer: int | None, name: str, start: int, stop: int, blocks: bool
    ) -> torch.Tensor:
        gguf_name = self._name(layer, name)
        kind = self.file.info(gguf_name).tensor_type.name.lower()
        at = fused_rows(self.config, layer, name)
        expert = expert_of(name) if layer is not None else None
        if expert is not None:  # a stack's rows: expert e's after e experts' rows
            at = expert[1] * self.shape(layer, name)[0]
        if name == SHARED_ROUTER:  # a vector in the file, one row here
            return self.file.tensor(gguf_name).view(1, -1)[start:stop]
        if blocks and kind in FORMATS:
            stored = self.file.stored_rows(gguf_name, at + start, at + stop)
            out = torch.from_numpy(stored).view(stop - start, -1, FORMATS[kind].block_bytes)
        else:
            out = self.file.tensor_rows(gguf_name, at + start, at + stop)
        if self._permuted and layer is not None and name in ("q", "k"):
            hd = self.config.head_dim
            if start % hd or stop % hd:
                raise ValueError(f"rows {start}:{stop} of {gguf_name} cut through a head")
            out = unpermute_qk(out, (stop - start) // hd)
        return out

    def rope_freq_factors(self) -> torch.Tensor | None:
        if self.file.has_tensor("rope_freqs.weight"):
            return self.file.tensor("rope_freqs.weight")
        return None


_HF_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    ROUTER: "mlp.gate.weight",
    "shared_gate": "mlp.shared_expert.gate_proj.weight",
    "shared_up": "mlp.shared_expert.up_proj.weight",
    "shared_down": "mlp.shared_expert.down_proj.weight",
    SHARED_ROUTER: "mlp.shared_expert_gate.weight",
}
# Gemma 3 names its norms after where they sit: "post_attention" is after attention, not
# before the FFN as in Llama.
_HF_GEMMA_NORMS = {
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_ffn_norm": "post_feedforward_layernorm.weight",
}


# Mixtral's names of its router and its experts' gate, up and down (w1, w3, w2)
_HF_MIXTRAL_ROUTER = "block_sparse_moe.gate.weight"
_HF_MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}


def hf_layer_name(index: int, canonical: str, architecture: str = "") -> str:
    """The config.json `architecture`'s name of layer `index`'s canonical tensor."""
    expert = expert_of(canonical)
    mixtral = architecture == "MixtralForCausalLM"
    if expert is not None and mixtral:
        stored = f"block_sparse_moe.experts.{expert[1]}.{_HF_MIXTRAL_EXPERT[expert[0]]}.weight"
    elif expert is not None:
        stored = f"mlp.experts.{expert[1]}.{expert[0]}_proj.weight"
    elif canonical == ROUTER and mixtral:
        stored = _HF_MIXTRAL_ROUTER
    else:
        stored = _HF_LAYER[canonical]
    return f"model.layers.{index}.{stored}"


class HFSource(ModelSource):
    """An HF folder: config.json, model.safetensors or a sharded index, tokenizer files."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        check_kind(path)
        config_path = path / "config.json"
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelError(f"{config_path} is not valid JSON ({exc})") from exc
        self.config = ModelConfig.from_hf(raw, str(config_path))
        self._norm_plus_one = HF_ARCHITECTURES[self.config.architecture].gemma
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").is_file():
            weight_map = None
        else:
            raise ModelError(
                f"{path} has neither model.safetensors nor model.safetensors.index.json"
            )
        self._where: dict[str, Path] = {}  # tensor name -> the file that holds it
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for name in files:
            try:
                with safe_open(str(path / name), framework="pt") as handle:
                    keys = list(handle.keys())
            except Exception as exc:
                raise ModelError(f"{path / name} cannot be read as safetensors ({exc})") from exc
            for key in keys:
                self._where[key] = path / name
        if "lm_head.weight" not in self._where:
            self.config = ModelConfig.from_dict({**self.config.to_dict(), "tied_embeddings": True})

    def _key(self, layer: int | None, name: str) -> str:
        if layer is not None and self.config.fused and name in _HF_FUSED:
            key = f"model.layers.{layer}.{_HF_FUSED[name]}"
        elif layer is not None and self._norm_plus_one and name in _HF_GEMMA_NORMS:
            key = f"model.layers.{layer}.{_HF_GEMMA_NORMS[name]}"
        elif layer is not None:
            key = hf_layer_name(layer, name, self.config.architecture)
        elif name == "lm_head" and not self.config.tied_embeddings:
            key = "lm_head.weight"
        else:
            key = "model.norm.weight" if name == "final_norm" else "model.embed_tokens.weight"
        if key not in self._where:
            raise ModelError(f"{self.path}: tensor {key!r} is missing")
        return key

    def _stored_type(self, layer: int | None, name: str) -> str:
        from safetensors import safe_open

        key = self._key(layer, name)
        with safe_open(str(self._where[key]), framework="pt") as handle:
            return handle.get_slice(key).get_dtype()

    def _rows(
        self, layer: int | None, name: str, start: int, stop: int, blocks: bool
    ) -> torch.Tensor:
        from safetensors import safe_open

        key = self._key(layer, name)
        at = fused_rows(self.config, layer, name)
        # A file is opened per read: an open file stays mapped, and every page a read touched
        # would count as this process's memory (GBs while splitting a 70B model).
        with safe_open(str(self._where[key]), framework="pt") as handle:
            out = handle.get_slice(key)[at + start : at + stop].to(torch.float32)
        if self._norm_plus_one and (name.endswith("norm")):
            out = out + 1  # Gemma's norms scale by (1 + weight); GGUF files store the sum
        return out

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_hf_folder(self.path)
