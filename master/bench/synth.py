"""Synthetic models: a real model's shapes with random weights, written as an HF folder.

Memory use and weight streaming depend on tensor shapes, not on what the weights say, so a
folder with Llama 2 70B's layer shapes and random values measures a 70B run on a machine that
could never download the real one. The folder is an ordinary HF safetensors folder (config.json,
one shard per layer plus one for the embedding/norm/head, an index, a tokenizer), read by
`models.source.HFSource` like any other model.

Each file is written by `memory.shards.write_safetensors`, the writer of the shards, so one
file's tensors are in memory at once: a Llama 2 70B layer is 1.7 GB in float16, Llama 3 70B's
embedding and head 4.2 GB. The weights are a deterministic function of (seed, tensor name): the
same seed gives the same bytes, and layer `i` is the same whatever number of layers is written.

The models imitated, their configs and their tokenizers' special tokens and chat templates, are
data in `master.bench.synth_models`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edgetp.master.bench.synth_models import SHAPES, tokenizer_style
from edgetp.memory.shards import write_safetensors
from edgetp.models.config_files import config_from_hf
from edgetp.models.errors import ModelError
from edgetp.models.gguf_vocab import bytes_to_unicode
from edgetp.models.layers import ROUTER, SHARED_ROUTER, expert_name
from edgetp.models.source import hf_layer_name

# Key in config.json that marks a folder as synthetic, so that nobody mistakes its output for a
# model's.
MARKER_KEY = "edgetp_synthetic"

_CONFIG_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_BLOCK_BYTES = 32 << 20  # float32 values drawn at a time: no float32 copy of a whole matrix
_WEIGHT_STD = 0.02  # Llama's initializer_range
_DISK_MARGIN = 64 << 20

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class _TensorSpec:
    """One tensor to write: HF name, shape and how its values are drawn."""

    name: str
    shape: tuple[int, ...]
    std: float | None  # None: all ones (a norm weight)


def write_synthetic_model(
    shape: str,
    layers: int,
    out: Path,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
    progress: Progress | None = None,
) -> Path:
    """Write an HF folder with `shape`'s tensor shapes, `layers` layers and random weights.

    `layers` is usually fewer than the real model's (a couple of 70B layers measure per-layer
    memory and streaming); more is allowed. The weights depend only on `seed` and the tensor's
    name. `out` must not exist or be an empty folder. Everything is written into a hidden
    `.NAME.partial-PID` folder next to it and renamed to `out` at the end, so an interrupted run
    leaves no folder that looks like a model. `progress(done_bytes, total_bytes)` is called as
    the weights are written. Returns `out`.
    """
    if shape not in SHAPES:
        raise ModelError(f"unknown model shape {shape!r}; known shapes: {', '.join(SHAPES)}")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ModelError(f"a synthetic model needs at least 1 layer, got {layers!r}")
    if dtype not in _CONFIG_DTYPES:
        raise ModelError(
            f"synthetic weights can be float32, float16 or bfloat16, not {dtype} "
            f"(quantized formats come from the GGUF path)"
        )
    out = Path(out).expanduser()
    if out.exists():
        if not out.is_dir():
            raise ModelError(f"{out} exists and is not a folder; choose another --out")
        if any(out.iterdir()):
            raise ModelError(f"{out} already exists and is not empty; remove it or choose another")

    config = _synthetic_config(shape, layers, dtype, seed)
    files = _shard_plan(SHAPES[shape], layers)
    total = synthetic_size(shape, layers, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < total + _DISK_MARGIN:
        raise ModelError(
            f"{shape} with {layers} layers needs {_gib(total)} but {out.parent} has {_gib(free)} "
            f"free; write fewer layers or choose another --out"
        )

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        done = 0
        weight_map: dict[str, str] = {}
        for filename, specs in files.items():
            write_safetensors(tmp / filename, {t.name: _values(t, dtype, seed) for t in specs})
            _fsync(tmp / filename)
            done += sum(math.prod(t.shape) for t in specs) * _element_size(dtype)
            if progress:
                progress(done, total)
            weight_map.update(dict.fromkeys((t.name for t in specs), filename))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2))
        _write_tokenizer(tmp, shape)
        # config.json last: a folder without it is not taken for a model.
        _write_text(tmp / "config.json", json.dumps(config, indent=2))
        _fsync(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
        _fsync(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def synthetic_size(shape: str, layers: int, dtype: torch.dtype = torch.float16) -> int:
    """Bytes of weights `write_synthetic_model` would write (to size a run before starting it)."""
    if shape not in SHAPES:
        raise ModelError(f"unknown model shape {shape!r}; known shapes: {', '.join(SHAPES)}")
    element = _element_size(dtype)
    return sum(
        math.prod(t.shape) * element
        for specs in _shard_plan(SHAPES[shape], layers).values()
        for t in specs
    )


# ------------------------------------------------------------------------- weights


def _synthetic_config(shape: str, layers: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    config = _layers_of(SHAPES[shape], layers)
    config["torch_dtype"] = _CONFIG_DTYPES[dtype]
    config[MARKER_KEY] = {"shape": shape, "seed": seed}
    return config


def _layers_of(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """`config` with its first `layers` layers, their kinds cut as many (Qwen3.5's, Gemma 4's);
    a Gemma 4's last a global one, and as large a share of them reading earlier layers' KV as
    leaves each kind a layer to read."""
    out = dict(config, num_hidden_layers=layers)
    if "layer_types" not in config:
        return out
    out["layer_types"] = config["layer_types"][:layers]
    if "num_kv_shared_layers" in config:
        out["layer_types"] = out["layer_types"][:-1] + ["full_attention"]
        shared = round(config["num_kv_shared_layers"] * layers / config["num_hidden_layers"])
        first_global = out["layer_types"].index("full_attention")
        out["num_kv_shared_layers"] = max(0, min(shared, layers - first_global - 1))
    return out


def _shard_plan(config: dict[str, Any], layers: int) -> dict[str, list[_TensorSpec]]:
    """File name -> tensors: the globals in the first file, then one file per layer.

    `config` is the shape's own, with its real number of layers.
    """
    hidden = config["hidden_size"]
    vocab = config["vocab_size"]
    # Residual-branch outputs get GPT-2's 1/sqrt(2 * depth) on top of Llama's 0.02, so the
    # residual stream grows slowly through many layers. Depth is the real model's, so a
    # layer's values do not depend on how many layers are written.
    residual_std = _WEIGHT_STD / math.sqrt(2 * config["num_hidden_layers"])

    count = layers + 1
    files: dict[str, list[_TensorSpec]] = {}
    globals_ = [
        _TensorSpec("model.embed_tokens.weight", (vocab, hidden), _WEIGHT_STD),
        _TensorSpec("model.norm.weight", (hidden,), _norm_std(config)),
    ]
    if not config.get("tie_word_embeddings", False):
        globals_.append(_TensorSpec("lm_head.weight", (vocab, hidden), _WEIGHT_STD))
    if config["architectures"][0] == "Gemma4ForCausalLM":
        return _gemma4_plan(_layers_of(config, layers), globals_, residual_std)
    files[f"model-{1:05d}-of-{count:05d}.safetensors"] = globals_
    model = config_from_hf(config, "config.json")
    for i in range(layers):
        p = f"model.layers.{i}."
        mixer = _linear_attention if model.is_linear(i) else _attention
        files[f"model-{i + 2:05d}-of-{count:05d}.safetensors"] = [
            *mixer(p, config, residual_std),
            *_ffn(p, config, residual_std),
        ]
    return files


def _norm_std(config: dict[str, Any]) -> float | None:
    """What a norm's weights are drawn with: None, ones; 0, zeros, for a family whose norms
    scale by (1 + weight) (Qwen3.5's)."""
    return 0.0 if config_from_hf(config, "config.json").attention_gate else None


def _linear_attention(p: str, config: dict[str, Any], residual_std: float) -> list[_TensorSpec]:
    """A gated DeltaNet layer's tensors (Qwen3.5), as transformers names them."""
    model = config_from_hf(config, "config.json")
    hidden, nv = model.hidden, model.linear_v_heads
    keys, values = model.linear_k_heads * model.linear_k_dim, nv * model.linear_v_dim
    la = p + "linear_attn."
    return [
        _TensorSpec(p + "input_layernorm.weight", (hidden,), _norm_std(config)),
        _TensorSpec(la + "in_proj_qkv.weight", (2 * keys + values, hidden), _WEIGHT_STD),
        _TensorSpec(la + "in_proj_z.weight", (values, hidden), _WEIGHT_STD),
        _TensorSpec(la + "in_proj_b.weight", (nv, hidden), _WEIGHT_STD),
        _TensorSpec(la + "in_proj_a.weight", (nv, hidden), _WEIGHT_STD),
        _TensorSpec(la + "conv1d.weight", (2 * keys + values, 1, model.linear_conv), _WEIGHT_STD),
        _TensorSpec(la + "A_log", (nv,), _WEIGHT_STD),  # decay rates near -1
        _TensorSpec(la + "dt_bias", (nv,), None),
        _TensorSpec(la + "norm.weight", (model.linear_v_dim,), None),  # as it is: ones
        _TensorSpec(la + "out_proj.weight", (hidden, values), residual_std),
    ]


def _attention(p: str, config: dict[str, Any], residual_std: float) -> list[_TensorSpec]:
    """A layer's attention tensors, and its query and key norms where the family has them."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    qk_norm = config["architectures"][0].startswith("Qwen3")
    norm_std = _norm_std(config)
    norms = [_TensorSpec(p + f"self_attn.{n}_norm.weight", (head_dim,), norm_std) for n in "qk"]
    gated = 2 if config_from_hf(config, "config.json").attention_gate else 1
    biases = []
    if config.get("attention_bias"):  # gpt-oss: Q, K, V and O biases, and its sinks
        biases = [
            _TensorSpec(p + f"self_attn.{n}_proj.bias", (rows,), _WEIGHT_STD)
            for n, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim),
                            ("v", kv_heads * head_dim), ("o", hidden))
        ]  # fmt: skip
        biases.append(_TensorSpec(p + "self_attn.sinks", (heads,), _WEIGHT_STD))
    return [
        *biases,
        _TensorSpec(p + "input_layernorm.weight", (hidden,), norm_std),
        _TensorSpec(p + "self_attn.q_proj.weight", (gated * heads * head_dim, hidden), _WEIGHT_STD),
        _TensorSpec(p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), _WEIGHT_STD),
        _TensorSpec(p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), _WEIGHT_STD),
        _TensorSpec(p + "self_attn.o_proj.weight", (hidden, heads * head_dim), residual_std),
        *(norms if qk_norm else []),
    ]


def _ffn(p: str, config: dict[str, Any], residual_std: float) -> list[_TensorSpec]:
    """A layer's FFN tensors: one SwiGLU, or a router and its experts', under the names its
    family's files give them (`models.source.hf_layer_name`)."""
    hidden = config["hidden_size"]
    norm = _TensorSpec(p + "post_attention_layernorm.weight", (hidden,), _norm_std(config))
    model = config_from_hf(config, "config.json")
    if not model.moe:
        ffn = config["intermediate_size"]
        return [
            norm,
            _TensorSpec(p + "mlp.gate_proj.weight", (ffn, hidden), _WEIGHT_STD),
            _TensorSpec(p + "mlp.up_proj.weight", (ffn, hidden), _WEIGHT_STD),
            _TensorSpec(p + "mlp.down_proj.weight", (hidden, ffn), residual_std),
        ]
    ffn, experts, arch = model.ffn_hidden, model.n_experts, model.architecture
    if model.expert_bias:  # gpt-oss: a layer's experts in one tensor each, (E, in, out)
        return [
            norm,
            _TensorSpec(p + "mlp.router.weight", (experts, hidden), _WEIGHT_STD),
            _TensorSpec(p + "mlp.router.bias", (experts,), _WEIGHT_STD),
            _TensorSpec(p + "mlp.experts.gate_up_proj", (experts, hidden, 2 * ffn), _WEIGHT_STD),
            _TensorSpec(p + "mlp.experts.gate_up_proj_bias", (experts, 2 * ffn), _WEIGHT_STD),
            _TensorSpec(p + "mlp.experts.down_proj", (experts, ffn, hidden), residual_std),
            _TensorSpec(p + "mlp.experts.down_proj_bias", (experts, hidden), residual_std),
        ]
    layer = int(p.split(".")[2])  # p is "model.layers.{i}."
    out = [norm, _TensorSpec(hf_layer_name(layer, ROUTER, arch), (experts, hidden), _WEIGHT_STD)]
    for e in range(experts):
        out += [
            _TensorSpec(hf_layer_name(layer, expert_name(n, e), arch), shape, std)
            for n, shape, std in (
                ("gate", (ffn, hidden), _WEIGHT_STD),
                ("up", (ffn, hidden), _WEIGHT_STD),
                ("down", (hidden, ffn), residual_std),
            )
        ]
    if model.n_shared:  # a shared expert and its gate (Qwen2-MoE, Qwen3.5-MoE)
        width = model.n_shared * ffn
        out += [
            _TensorSpec(hf_layer_name(layer, name, arch), shape, std)
            for name, shape, std in (
                ("shared_gate", (width, hidden), _WEIGHT_STD),
                ("shared_up", (width, hidden), _WEIGHT_STD),
                ("shared_down", (hidden, width), residual_std),
                (SHARED_ROUTER, (1, hidden), _WEIGHT_STD),
            )
        ]
    return out


def _gemma4_plan(
    config: dict[str, Any], globals_: list[_TensorSpec], residual_std: float
) -> dict[str, list[_TensorSpec]]:
    """A Gemma 4's files (`config` with the layers written): its per-layer input embeddings
    beside the globals, and each layer at its own shape (`models.gemma4.layer_config`): a
    global layer's heads, a sharing layer without keys and values and with its wider FFN."""
    from edgetp.models import gemma4

    model = config_from_hf(config, "config.json")
    d, n, ple = model.hidden, model.n_layers, model.ple_dim
    count = n + 1
    globals_ = globals_ + [
        _TensorSpec("model.embed_tokens_per_layer.weight", (model.ple_vocab, n * ple), _WEIGHT_STD),
        _TensorSpec("model.per_layer_model_projection.weight", (n * ple, d), _WEIGHT_STD),
        _TensorSpec("model.per_layer_projection_norm.weight", (ple,), None),
    ]
    files = {f"model-{1:05d}-of-{count:05d}.safetensors": globals_}
    for i in range(n):
        c, p = gemma4.layer_config(model, i), f"model.layers.{i}."
        q, kv = model.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        specs = [
            _TensorSpec(p + "self_attn.q_proj.weight", (q, d), _WEIGHT_STD),
            _TensorSpec(p + "self_attn.q_norm.weight", (c.head_dim,), None),
            _TensorSpec(p + "self_attn.o_proj.weight", (d, q), residual_std),
            _TensorSpec(p + "mlp.gate_proj.weight", (c.ffn_hidden, d), _WEIGHT_STD),
            _TensorSpec(p + "mlp.up_proj.weight", (c.ffn_hidden, d), _WEIGHT_STD),
            _TensorSpec(p + "mlp.down_proj.weight", (d, c.ffn_hidden), residual_std),
            *(_TensorSpec(p + f"{name}.weight", (d,), None) for name in (
                "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm", "post_per_layer_input_norm")),
            _TensorSpec(p + "per_layer_input_gate.weight", (ple, d), _WEIGHT_STD),
            _TensorSpec(p + "per_layer_projection.weight", (d, ple), residual_std),
            _TensorSpec(p + "layer_scalar", (1,), None),
        ]  # fmt: skip
        if not gemma4.shares_kv(model, i):
            specs += [
                _TensorSpec(p + "self_attn.k_proj.weight", (kv, d), _WEIGHT_STD),
                _TensorSpec(p + "self_attn.k_norm.weight", (c.head_dim,), None),
            ]
            if gemma4.stored_name(model, i, "v") == "v":
                specs.append(_TensorSpec(p + "self_attn.v_proj.weight", (kv, d), _WEIGHT_STD))
        files[f"model-{i + 2:05d}-of-{count:05d}.safetensors"] = specs
    return files


def _tensor_seed(seed: int, name: str) -> int:
    """A generator seed for one tensor, so its values depend on nothing but (seed, name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _values(spec: _TensorSpec, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The tensor's values in `dtype`, drawn as float32 `_BLOCK_BYTES` of rows at a time."""
    if spec.std is None:
        return torch.ones(spec.shape, dtype=dtype)
    out = torch.empty(spec.shape, dtype=dtype)
    rows = out.view(spec.shape[0], -1)  # (rows, everything else)
    per_block = max(1, _BLOCK_BYTES // (rows.shape[1] * 4))
    generator = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
    buffer = torch.empty((min(per_block, len(rows)), rows.shape[1]), dtype=torch.float32)
    for start in range(0, len(rows), per_block):
        block = buffer[: min(per_block, len(rows) - start)]
        torch.randn(block.shape, generator=generator, out=block)
        rows[start : start + len(block)] = block.mul_(spec.std)
    return out


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------- tokenizer


def _write_tokenizer(folder: Path, shape: str) -> None:
    """A byte-level BPE with exactly `vocab_size` tokens, the family's special tokens at their ids.

    Any text encodes (every byte is a token) and decodes back unchanged. Merges of letter
    sequences fill the vocabulary, so text takes a few characters a token, not one a byte, and
    prompt lengths stay in the range of a real tokenizer's.
    """
    import tokenizers
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors

    config = SHAPES[shape]
    style = tokenizer_style(shape)
    vocab_size = config["vocab_size"]
    specials = style.specials
    bos = specials[config["bos_token_id"]]
    eos = specials[config["eos_token_id"]]

    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    free_ids = (i for i in range(vocab_size) if i not in specials)
    for token, merge in _byte_level_tokens():
        token_id = next(free_ids, None)
        if token_id is None:
            break
        vocab[token] = token_id
        if merge:
            merges.append(merge)
    vocab.update({text: token_id for token_id, text in specials.items()})
    if len(vocab) != vocab_size:
        raise ModelError(f"internal: built {len(vocab)} tokens for a vocabulary of {vocab_size}")

    model = tokenizers.models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(text, special=True, normalized=False) for _, text in sorted(specials.items())]
    )
    if style.add_bos:
        # For transformers, which adds BOS through the post-processor.
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    backend.save(str(folder / "tokenizer.json"))

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": style.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": style.chat_template,
    }
    if style.unk:
        tokenizer_config["unk_token"] = style.unk
    _write_text(folder / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2))


def _byte_level_tokens() -> Iterator[tuple[str, tuple[str, str] | None]]:
    """Byte-level tokens in id order: the 256 bytes, then merged letter sequences, endlessly.

    Each merged token is an earlier token plus one letter, so every merge's parts are already
    in the vocabulary and earlier merges rank first, as BPE requires. "Ġ" (a space) only starts
    a token, as GPT-2's pre-tokenizer puts spaces before words.
    """
    spelling = bytes_to_unicode()
    for b in range(256):
        yield spelling[b], None
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
        chr(c) for c in range(ord("A"), ord("Z") + 1)
    ]
    level = ["Ġ", *letters]
    while True:
        longer = []
        for prefix in level:
            for letter in letters:
                yield prefix + letter, (prefix, letter)
                longer.append(prefix + letter)
        level = longer


# ------------------------------------------------------------------------- helpers


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's entry to disk: before the rename that makes it a model."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"
