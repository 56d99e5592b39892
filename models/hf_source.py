"""An HF safetensors folder as a model source: config.json, model.safetensors or a sharded
index, the tokenizer's files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from edgetp.models.bundled import check_kind
from edgetp.models.config import ModelConfig
from edgetp.models.config_files import config_from_hf
from edgetp.models.errors import ModelError
from edgetp.models.families import family_of
from edgetp.models.layers import O_BIAS, ROUTER, ROUTER_BIAS, SHARED_ROUTER, SINKS, expert_of
from edgetp.models.quant import FORMATS
from edgetp.models.ranges import (
    SIDECAR,
    RemoteFile,
    RemoteModel,
    fetch_safetensors_header,
    tensor_runs,
)
from edgetp.models.source_base import HF_FUSED, ModelSource, fused_rows
from edgetp.models.tokenizer import Tokenizer

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
    O_BIAS: "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    ROUTER: "mlp.gate.weight",
    "shared_gate": "mlp.shared_expert.gate_proj.weight",
    "shared_up": "mlp.shared_expert.up_proj.weight",
    "shared_down": "mlp.shared_expert.down_proj.weight",
    SHARED_ROUTER: "mlp.shared_expert_gate.weight",
    # a gated DeltaNet layer's (Qwen3.5; Qwen3-Next fuses them otherwise: `_next_rows`)
    "ssm_qkv": "linear_attn.in_proj_qkv.weight",
    "ssm_z": "linear_attn.in_proj_z.weight",
    "ssm_b": "linear_attn.in_proj_b.weight",
    "ssm_a": "linear_attn.in_proj_a.weight",
    "ssm_conv": "linear_attn.conv1d.weight",  # (channels, 1, taps)
    "ssm_decay": "linear_attn.A_log",  # the decay rate is -exp(A_log)
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm.weight",
    "ssm_out": "linear_attn.out_proj.weight",
}
# Qwen3-Next's in-projections: per key head, its query, key, values and z rows in one matrix,
# its b and a rows in another (transformers' `fix_query_key_value_ordering` takes them apart)
_HF_NEXT = {
    "ssm_qkv": "linear_attn.in_proj_qkvz.weight",
    "ssm_z": "linear_attn.in_proj_qkvz.weight",
    "ssm_b": "linear_attn.in_proj_ba.weight",
    "ssm_a": "linear_attn.in_proj_ba.weight",
}
# Gemma 3 names its norms after where they sit: "post_attention" is after attention, not
# before the FFN as in Llama.
_HF_GEMMA_NORMS = {
    "ffn_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_ffn_norm": "post_feedforward_layernorm.weight",
}


_BLOCKS = "_blocks"  # an MXFP4 tensor's blocks, its scales beside them as "_scales"
# gpt-oss' names: every expert of a layer in one tensor each, (E, in, out) with gate and up
# interleaved by column in gate_up_proj (gate at even columns), their biases (E, out).
_HF_GPT_OSS = {
    ROUTER: "mlp.router.weight",
    ROUTER_BIAS: "mlp.router.bias",
    SINKS: "self_attn.sinks",
    "gate": "mlp.experts.gate_up_proj",
    "up": "mlp.experts.gate_up_proj",
    "down": "mlp.experts.down_proj",
    "gate_bias": "mlp.experts.gate_up_proj_bias",
    "up_bias": "mlp.experts.gate_up_proj_bias",
    "down_bias": "mlp.experts.down_proj_bias",
}

# Mixtral's names of its router and its experts' gate, up and down (w1, w3, w2)
_HF_MIXTRAL_ROUTER = "block_sparse_moe.gate.weight"
_HF_MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}


def hf_layer_name(index: int, canonical: str, architecture: str = "") -> str:
    """The config.json `architecture`'s name of layer `index`'s canonical tensor."""
    expert = expert_of(canonical)
    mixtral = architecture == "MixtralForCausalLM"
    gpt_oss = architecture == "GptOssForCausalLM"
    if gpt_oss and (expert is not None or canonical in _HF_GPT_OSS):
        stored = _HF_GPT_OSS[expert[0] if expert is not None else canonical]
    elif expert is not None and mixtral:
        stored = f"block_sparse_moe.experts.{expert[1]}.{_HF_MIXTRAL_EXPERT[expert[0]]}.weight"
    elif expert is not None:
        stored = f"mlp.experts.{expert[1]}.{expert[0]}_proj.weight"
    elif canonical == ROUTER and mixtral:
        stored = _HF_MIXTRAL_ROUTER
    else:
        stored = _HF_LAYER[canonical]
    return f"model.layers.{index}.{stored}"


# Published Qwen3.5 folders are vision-language models: their text model is read alone, its
# config from `text_config`, its tensors under `model.language_model.` (the vision tower's are
# left in the files).
_VISION_LANGUAGE = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",  # as Gemma 4 is published
}
_LANGUAGE_MODEL = "model.language_model."


def text_model_config(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A config.json's text model config, and the prefix of its tensors' names in place of
    "model.": the config itself and "model." but for a vision-language folder
    (`_VISION_LANGUAGE`)."""
    archs = raw.get("architectures") or []
    if not archs or archs[0] not in _VISION_LANGUAGE or "text_config" not in raw:
        return raw, "model."
    text = dict(raw["text_config"]) | {"architectures": [_VISION_LANGUAGE[archs[0]]]}
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    return text, _LANGUAGE_MODEL


def _next_rows(config: ModelConfig, name: str) -> torch.Tensor:
    """The rows of Qwen3-Next's fused in-projection (`_HF_NEXT`) that hold canonical `name`,
    in the canonical order (queries of every key head, keys, values; z; b; a)."""
    dk, dv, g = config.linear_k_dim, config.linear_v_dim, config.linear_group
    heads = torch.arange(config.linear_k_heads).unsqueeze(1)
    if name in ("ssm_b", "ssm_a"):  # per key head: b of its g value heads, then a
        first = 0 if name == "ssm_b" else g
        return (heads * 2 * g + first + torch.arange(g)).flatten()
    width = 2 * dk + 2 * g * dv  # per key head: query, key, its value heads' values and z
    if name == "ssm_z":
        return (heads * width + 2 * dk + g * dv + torch.arange(g * dv)).flatten()
    q = (heads * width + torch.arange(dk)).flatten()
    values = (heads * width + 2 * dk + torch.arange(g * dv)).flatten()
    return torch.cat((q, q + dk, values))


def _gpt_oss_expert_rows(t: torch.Tensor, kind: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of canonical `kind` (gate, up, down or their biases) of one gpt-oss
    expert, whose tensor `t` is stored (in, out) (a bias: (out,)), gate and up interleaved by
    output (gate at even ones), as transformers' GptOssExperts holds them."""
    if kind in ("gate", "gate_bias", "up", "up_bias"):
        first = 0 if kind.startswith("gate") else 1
        t = t[..., 2 * start + first : 2 * stop : 2]
    else:
        t = t[..., start:stop]
    return t.T.contiguous().float() if t.dim() == 2 else t.float()


class HFSource(ModelSource):
    """An HF folder: config.json, model.safetensors or a sharded index, tokenizer files. A
    weight file may be the sparse mirror of one on the hub (models/ranges.py; `remotes`, or
    its record beside it), whose bytes are fetched before a read reads them."""

    def __init__(self, path: Path, remotes: dict[str, RemoteFile] | None = None) -> None:
        from safetensors import safe_open

        self.path = path
        self._remotes: dict[Path, RemoteFile] = {}
        self._layouts: dict[Path, tuple[int, dict[str, Any]]] = {}  # data start, header
        self._columns: dict[str, tuple[int, int]] = {}  # tensor -> bytes of each row read
        check_kind(path)
        config_path = path / "config.json"
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelError(f"{config_path} is not valid JSON ({exc})") from exc
        raw, self._prefix = text_model_config(raw)
        self.config = config_from_hf(raw, str(config_path))
        family = family_of(self.config)
        self._norm_plus_one = family.norm_plus_one
        self._next = self.config.architecture == "Qwen3NextForCausalLM"
        # Gemma 3's and 4's names of their norms; Gemma 4's scale by the weight alone
        self._gemma_norms = family.norms_by_place
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
            remote = remotes.get(name) if remotes is not None else RemoteFile.reopen(path / name)
            if remote is not None:
                self._layouts[path / name] = fetch_safetensors_header(remote)
                self._remotes[path / name] = remote
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
        own = family_of(self.config).hf_name(self.config, layer, name)
        if own is not None:
            key = own
        elif layer is not None and self.config.fused and name in HF_FUSED:
            key = f"model.layers.{layer}.{HF_FUSED[name]}"
        elif layer is not None and self._next and name in _HF_NEXT:
            key = f"model.layers.{layer}.{_HF_NEXT[name]}"
        elif layer is not None and self._gemma_norms and name in _HF_GEMMA_NORMS:
            key = f"model.layers.{layer}.{_HF_GEMMA_NORMS[name]}"
        elif layer is not None:
            key = hf_layer_name(layer, name, self.config.architecture)
        elif name == "lm_head" and not self.config.tied_embeddings:
            key = "lm_head.weight"
        else:
            key = "model.norm.weight" if name == "final_norm" else "model.embed_tokens.weight"
        if self._prefix != "model." and key.startswith("model."):  # a vision-language folder's
            key = self._prefix + key.removeprefix("model.")
        if key not in self._where and key + _BLOCKS in self._where:  # gpt-oss' MXFP4 experts
            return key + _BLOCKS
        if key not in self._where:
            raise ModelError(f"{self.path}: tensor {key!r} is missing")
        return key

    def _stored_type(self, layer: int | None, name: str) -> str:
        from safetensors import safe_open

        key = self._key(layer, name)
        if key.endswith(_BLOCKS):
            return "MXFP4"
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
        expert = expert_of(name) if layer is not None else None
        if expert is not None and key.endswith(_BLOCKS):
            stored = self._mxfp4_rows(key, expert, start, stop)
            return stored if blocks else FORMATS["mxfp4"].dequantize(stored)
        plain = not (expert is not None and (self.config.expert_bias or self.config.dense_ffn))
        plain = plain and not (layer is not None and self._next and name in _HF_NEXT)
        self._ensure(key, (at + start, at + stop) if plain else None)  # else: all its rows
        with safe_open(str(self._where[key]), framework="pt") as handle:
            if expert is not None and self.config.expert_bias:  # gpt-oss' (E, in, out)
                out = _gpt_oss_expert_rows(handle.get_slice(key)[expert[1]], expert[0], start, stop)
            elif layer is not None and self._next and name in _HF_NEXT:
                rows = _next_rows(self.config, name)[start:stop]
                out = handle.get_tensor(key)[rows].to(torch.float32)
            elif expert is not None and self.config.dense_ffn:  # Gemma 4's (E, out, in)
                at = self.config.ffn_hidden if expert[0] == "up" else 0  # up after gate
                out = handle.get_slice(key)[expert[1]][at + start : at + stop].to(torch.float32)
            else:
                out = handle.get_slice(key)[at + start : at + stop].to(torch.float32)
        if self._norm_plus_one and name.endswith("norm") and name != "ssm_norm":
            out = out + 1  # Gemma's norms scale by (1 + weight); GGUF files store the sum
        if name == "ssm_conv":  # (channels, 1, taps)
            out = out.reshape(out.shape[0], -1)
        elif name == "ssm_decay":  # llama.cpp's, from A_log
            out = -out.exp()
        return out

    def _mxfp4_rows(self, key: str, expert: tuple[str, int], start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of an expert's gate, up or down stored as MXFP4 blocks and scales
        (openai's gpt-oss: (E, out, in / 32, 16) and (E, out, in / 32), gate and up interleaved
        by row), as GGUF's MXFP4 blocks (rows, in / 32, 17)."""
        from safetensors import safe_open

        parts = []
        for name in (key.removesuffix(_BLOCKS) + "_scales", key):
            self._ensure(name, None)
            with safe_open(str(self._where[name]), framework="pt") as handle:
                t = handle.get_slice(name)[expert[1]]
            if expert[0] in ("gate", "up"):
                first = 0 if expert[0] == "gate" else 1
                parts.append(t[2 * start + first : 2 * stop : 2])
            else:
                parts.append(t[start:stop])
        scales, nibbles = parts
        # openai packs values 2i and 2i + 1 in byte i (low nibble first), GGUF j and j + 16
        values = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=-1).flatten(-2)  # (.., 32)
        packed = values[..., :16] | (values[..., 16:] << 4)
        return torch.cat((scales.unsqueeze(-1), packed), dim=-1).contiguous()

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_hf_folder(self.path)

    def remote(self) -> RemoteModel | None:
        if not self._remotes:
            return None
        files = {p.name: r.remote for p, r in self._remotes.items()}
        weights = [p for p in self.path.iterdir() if p.suffix == ".safetensors"]
        small = {p.name: p.read_bytes() for p in sorted(self.path.iterdir()) if p.is_file()
                 and p not in weights and not p.name.endswith(SIDECAR)}  # fmt: skip
        return RemoteModel(files, small)

    def fetched(self) -> None:
        for remote in self._remotes.values():
            remote.save()

    def _only_columns(self, layer: int | None, name: str, cols: tuple[int, int] | None) -> None:
        if not self._remotes:  # local files: nothing to fetch
            return
        key = self._key(layer, name)
        if self._where[key] not in self._layouts:
            return
        entry = self._layouts[self._where[key]][1][key]
        shape = entry["shape"]
        if cols is None or len(shape) != 2 or cols == (0, shape[1]):
            self._columns.pop(key, None)
            return
        begin, end = entry["data_offsets"]
        item = (end - begin) // (shape[0] * shape[1])
        self._columns[key] = (cols[0] * item, cols[1] * item)

    def _ensure(self, key: str, rows: tuple[int, int] | None) -> None:
        """Fetch rows `rows` of tensor `key` (None: all of it) into a remote file's mirror,
        only the columns a reader said it reads (`only_columns`)."""
        file = self._where[key]
        if file not in self._layouts:
            return
        data, header = self._layouts[file]
        begin, end = header[key]["data_offsets"]
        shape = header[key]["shape"]
        if rows is None or len(shape) < 2:
            self._remotes[file].ensure([(data + begin, data + end)])
            return
        row = (end - begin) // shape[0]
        runs = tensor_runs(data + begin, row, rows, self._columns.get(key))
        self._remotes[file].ensure(runs)
