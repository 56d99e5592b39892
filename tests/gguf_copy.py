"""transformers' model and tokenizer of a GGUF file: the tests' independent reference, loaded
without the costs of gguf's reader that change nothing of what it reads."""

from __future__ import annotations

import contextlib
import functools
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from edgetp.models.gguf_file import DEFAULT_ALIGNMENT, GGUF_MAGIC, _Cursor

VOCABULARY_ARRAYS = (
    "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)  # fmt: skip
_U32 = 4  # GGUF's value type of a uint32


class PlainArrayReader(gguf.GGUFReader):
    """gguf's reader over the same mapped bytes, seen as a plain array: it takes every key's
    parts as slices of its `data`, and a slice of a `np.memmap` pays for the subclass
    (`__array_finalize__`) each time, half of the 40 s of CPU Gemma 3's tokenizer took here."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._plain = mapped.view(np.ndarray)


@contextlib.contextmanager
def plain_array_reader() -> Iterator[None]:
    """transformers' GGUF loader reads through `PlainArrayReader` meanwhile (it imports the
    reader from gguf at each call)."""
    reader = gguf.GGUFReader
    gguf.GGUFReader = PlainArrayReader
    try:
        yield
    finally:
        gguf.GGUFReader = reader


def transformers_tokenizer(path: Path) -> Any:
    """transformers' tokenizer of the GGUF file at `path`."""
    from transformers import AutoTokenizer

    with plain_array_reader():
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def transformers_model(path: Path, folder: Path, **kwargs: Any) -> Any:
    """transformers' model of the GGUF file at `path` in float32 (in eval mode), loaded from a
    copy in `folder` without the vocabulary arrays. Its loader builds gguf's table of tensor
    names anew for every submodule (397 of them for SmolLM2: 14 of the 18 s of CPU a load took);
    the table depends only on the architecture and the layer count, so it is built once here."""
    from transformers import AutoModelForCausalLM

    weights = without_vocabulary_arrays(path, folder / path.name)
    build_table = gguf.get_tensor_name_map  # the loader imports it from gguf at each call
    gguf.get_tensor_name_map = functools.cache(build_table)
    try:
        with plain_array_reader():
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=weights.name, dtype=torch.float32, **kwargs
            )
    finally:
        gguf.get_tensor_name_map = build_table
    return model.eval()


def without_vocabulary_arrays(path: Path, out: Path) -> Path:
    """A copy of the GGUF file at `path` without its vocabulary's arrays (their size stated as
    a key, where the file does not): every other key and every tensor byte for byte, for
    transformers to load the model from. Its GGUF reader takes each token and merge through
    numpy views, twice: 40-50 s for Gemma 3's 262,144 tokens, for a model the tests give token
    ids (our tokenizer is held to transformers' own on these files by tests/test_tokenizer.py)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        cur.pos = len(GGUF_MAGIC)
        version, n_tensors, n_keys = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
        kept, keys, vocabulary, alignment, architecture = [], set(), 0, DEFAULT_ALIGNMENT, ""
        for _ in range(n_keys):
            start = cur.pos
            key = cur.string()
            value = cur.value(cur.scalar("<I"))
            if key == "general.alignment":
                alignment = value
            if key == "general.architecture":
                architecture = value
            if key == VOCABULARY_ARRAYS[0]:
                vocabulary = len(value)
            if key not in VOCABULARY_ARRAYS:
                kept.append(buf[start : cur.pos])
                keys.add(key)
        tensors_start = cur.pos
        for _ in range(n_tensors):
            cur.string()
            dims = cur.scalar("<I")
            cur.pos += 8 * dims + 4 + 8  # the dims, the type, the offset
        tensor_table = buf[tensors_start : cur.pos]
        data_start = -(-cur.pos // alignment) * alignment
        key = f"{architecture}.vocab_size"
        if key not in keys:  # else transformers would take the size from the tokens
            name = key.encode()
            kept.append(struct.pack("<Q", len(name)) + name + struct.pack("<II", _U32, vocabulary))
        header = b"".join(
            [GGUF_MAGIC, struct.pack("<IQQ", version, n_tensors, len(kept)), *kept, tensor_table]
        )  # fmt: skip
        with open(out, "wb") as f:
            f.write(header + bytes(-len(header) % alignment))
            f.write(buf[data_start:])
    return out


def write_shape(writer: gguf.GGUFWriter, config: Any) -> None:
    """A transformers config's shape as llama.cpp's converter writes it for every family: the
    layers, widths, heads and their size, the context and the norm's epsilon."""
    c = config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_block_count(c.num_hidden_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
