"""An HF safetensors folder of the same weights gives the same logits as the GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_copy import transformers_tokenizer
from safetensors.torch import save_file

from edgetp.master.cluster.engine import Engine
from edgetp.models.errors import ModelError
from edgetp.models.layers import StepBatch
from edgetp.models.source import HFSource, hf_layer_name, open_model

pytestmark = pytest.mark.slow


def write_hf_folder(source, folder: Path, shards: int) -> None:
    """Save `source`'s dequantized weights as an HF Llama folder, in `shards` files."""
    c = source.config
    tensors = {
        "model.embed_tokens.weight": source.embedding(),
        "model.norm.weight": source.final_norm(),
    }
    for i in range(c.n_layers):
        for name, t in source.layer(i).items():
            tensors[hf_layer_name(i, name)] = t
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, str(folder / file))
            weight_map |= dict.fromkeys(part, file)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": c.hidden,
        "intermediate_size": c.ffn_hidden,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.context_length,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def gguf_engine(smollm2):
    return Engine.local(smollm2)


@pytest.fixture(scope="module")
def hf_folders(smollm2, tmp_path_factory) -> dict[int, Path]:
    """The model as an HF folder in one file and in three, each with transformers' tokenizer
    of the GGUF file, written once for the module: the tests only read them."""
    tokenizer = transformers_tokenizer(smollm2.path)
    folders = {}
    for shards in (1, 3):
        folders[shards] = tmp_path_factory.mktemp(f"hf-{shards}")
        write_hf_folder(smollm2, folders[shards], shards)
        tokenizer.save_pretrained(folders[shards])
    return folders


@pytest.mark.parametrize("shards", [1, 3])
def test_safetensors_logits_equal_gguf_logits(smollm2_tokenizer, gguf_engine, hf_folders, shards):
    hf = open_model(str(hf_folders[shards]))
    assert isinstance(hf, HFSource)
    assert hf.config.tied_embeddings
    ids = smollm2_tokenizer.encode("Tensor parallelism splits every layer across devices.")
    assert hf.tokenizer().encode("Tensor parallelism splits every layer across devices.") == ids
    batch = StepBatch((0,), (0,), (len(ids),))
    ours = Engine.local(hf).forward([ids], batch, all_logits=True)
    expected = gguf_engine.forward([ids], batch, all_logits=True)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_missing_tensor_is_named(hf_folders, tmp_path):
    written = hf_folders[1]
    (tmp_path / "model.safetensors").symlink_to(written / "model.safetensors")
    config = json.loads((written / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 31}))
    hf = open_model(str(tmp_path))
    with pytest.raises(ModelError, match="model.layers.30"):
        hf.layer(30)


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelError, match="GPT2LMHeadModel"):
        open_model(str(tmp_path))


def _file_backed_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))


def test_reading_every_layer_leaves_no_file_pages_mapped(hf_folders):
    """A splitter reads the whole model through the source; what it read must not stay mapped
    into the process, where it counts as memory (as safetensors' open handles did)."""
    source = open_model(str(hf_folders[1]))
    layer_bytes = sum(t.nbytes for t in source.layer(0).values())  # first use warms up
    before = _file_backed_rss()
    for i in range(1, source.config.n_layers):
        source.layer(i)
    source.embedding()
    grown = _file_backed_rss() - before
    print(f"file-backed RSS grew {grown / 2**20:.1f} MiB over {source.config.n_layers} layers")
    assert grown < layer_bytes / 4  # the model is 30 layers and an embedding: none stays
