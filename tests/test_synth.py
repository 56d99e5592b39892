"""Synthetic models: real shapes, random weights, read and run like any HF folder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from edgetp.master.bench.synth import MARKER_KEY, _write_tokenizer, write_synthetic_model
from edgetp.master.bench.synth_models import SHAPES, tokenizer_style
from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.plan import head_rows, plan_slices
from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.prompts import prompt_tokens
from edgetp.memory.shards import ShardStore
from edgetp.memory.splitter import split_model
from edgetp.models.config_files import config_from_hf
from edgetp.models.errors import ModelError
from edgetp.models.layers import StepBatch
from edgetp.models.source import HFSource, open_model
from edgetp.models.tokenizer import Tokenizer

SHAPE = "tinyllama-1.1b"
SMALL = "smollm2-135m"  # a real shape whose files are small, where only the writing is tested


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("synth") / "tiny"
    calls = []
    written = write_synthetic_model(
        SHAPE, 2, out, seed=7, progress=lambda done, total: calls.append((done, total))
    )
    assert written == out
    assert calls and calls[-1][0] == calls[-1][1]
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:], strict=False))
    yield out
    shutil.rmtree(out.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def source(folder):
    return open_model(folder)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_config_matches_shape(folder, source):
    assert isinstance(source, HFSource)
    shape = SHAPES[SHAPE]
    c = source.config
    assert c.n_layers == 2
    assert c.hidden == shape["hidden_size"] == 2048
    assert c.n_heads == shape["num_attention_heads"] == 32
    assert c.n_kv_heads == shape["num_key_value_heads"] == 4
    assert c.ffn_hidden == shape["intermediate_size"] == 5632
    assert c.vocab_size == shape["vocab_size"] == 32000
    assert not c.tied_embeddings
    raw = json.loads((folder / "config.json").read_text())
    assert raw[MARKER_KEY] == {"shape": SHAPE, "seed": 7}
    assert raw["torch_dtype"] == "float16"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3  # globals + one per layer
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_tensors_have_the_shapes_and_finite_values(source):
    c = source.config
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    expected = {
        "attn_norm": (c.hidden,),
        "q": (q_rows, c.hidden),
        "k": (kv_rows, c.hidden),
        "v": (kv_rows, c.hidden),
        "o": (c.hidden, q_rows),
        "ffn_norm": (c.hidden,),
        "gate": (c.ffn_hidden, c.hidden),
        "up": (c.ffn_hidden, c.hidden),
        "down": (c.hidden, c.ffn_hidden),
    }
    for i in range(c.n_layers):
        layer = source.layer(i)
        assert {name: tuple(t.shape) for name, t in layer.items()} == expected
        assert all(bool(t.isfinite().all()) for t in layer.values())
        assert torch.equal(layer["attn_norm"], torch.ones(c.hidden))
        assert 0.015 < float(layer["q"].std()) < 0.025
    assert tuple(source.embedding().shape) == (c.vocab_size, c.hidden)
    assert tuple(source.lm_head().shape) == (c.vocab_size, c.hidden)
    assert not torch.equal(source.layer(0)["q"], source.layer(1)["q"])


def test_tokenizer_round_trips(source):
    tok = source.tokenizer()
    assert tok.vocab_size == source.config.vocab_size
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    text = "Tensor parallelism splits every layer, 42 times: ünïcode 😀\n\tend."
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert len(ids) < len(text.encode())  # merges are used, not only bytes
    assert tok.decode(ids[1:]) == text
    chat = prompt_tokens(tok, "Hello?", raw=False)
    assert chat[0] == tok.bos_id and chat.count(tok.bos_id) == 1


def test_llama3_tokenizer_has_its_special_tokens(tmp_path):
    _write_tokenizer(tmp_path, "llama3-8b")
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.vocab_size == 128256
    assert (tok.bos_id, tok.eos_id) == (128000, 128001)
    assert tok.token_to_id("<|eot_id|>") in tok.eos_ids
    ids = prompt_tokens(tok, "What is the tallest mountain?", raw=False)
    assert ids[:2] == [128000, 128006]
    assert tok.decode(ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_engine_runs_it(source):
    engine = Engine.local(source)
    tok = source.tokenizer()
    ids = tok.encode("The capital of France is")
    logits = engine.forward([ids], StepBatch((0,), (0,), (len(ids),)), all_logits=True)
    assert logits.shape == (1, len(ids), source.config.vocab_size)
    assert bool(logits.isfinite().all())
    assert float(logits.std()) > 0.1  # not collapsed to a constant
    seqs = start(engine, [ids], [SamplingParams(max_tokens=4, ignore_eos=True)])
    for _ in stream(engine, tok, seqs):
        pass
    assert len(seqs[0].tokens) == 4
    assert all(0 <= t < source.config.vocab_size for t in seqs[0].tokens)


def test_split_by_vocabulary_the_master_holds_only_its_rows_of_the_head(source, tmp_path):
    """An untied head split by vocabulary over three nodes: the master's globals hold its own
    rows of it (the same values), not the whole head (131 MB here, 0.5 GB at 70B in f16)."""
    config = source.config
    slices = plan_slices(config, [1.0, 1.0, 1.0])
    rows = head_rows(config, slices, [1.0, 1.0, 1.0])
    store = ShardStore(tmp_path / "shards")
    manifest = split_model(source, slices, store, dtype="f16", head_rows=rows)
    held = store.load(manifest.globals)
    (a, b), whole = rows[0], source.lm_head()
    assert 0 < b - a < config.vocab_size
    assert held["lm_head"].shape == (b - a, config.hidden)
    assert torch.equal(held["lm_head"], whole[a:b].to(torch.float16))
    assert held["embedding"].shape == (config.vocab_size, config.hidden)  # it embeds every id
    for (a, b), ref in zip(rows[1:], manifest.heads, strict=True):  # the workers' rows
        assert torch.equal(store.load(ref)["lm_head"], whole[a:b].to(torch.float16))


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    two = _files(write_synthetic_model(SMALL, 2, tmp_path / "two", seed=3))
    one = _files(write_synthetic_model(SMALL, 1, tmp_path / "one", seed=3))
    other = _files(write_synthetic_model(SMALL, 1, tmp_path / "other", seed=4))
    shards = sorted(name for name in one if name.endswith(".safetensors"))
    assert len(shards) == 2
    # The globals and layer 0 are the same bytes whatever the number of layers written.
    two_shards = sorted(name for name in two if name.endswith(".safetensors"))
    assert [one[name] for name in shards] == [two[name] for name in two_shards[:2]]
    assert one["tokenizer.json"] == two["tokenizer.json"]
    assert all(one[name] != other[name] for name in shards)
    assert _files(tmp_path / "one") == one  # reading changed nothing


def test_bfloat16_tied_into_an_empty_folder(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    write_synthetic_model(SMALL, 1, out, dtype=torch.bfloat16)
    source = open_model(out)
    assert source.config.tied_embeddings
    assert torch.equal(source.lm_head(), source.embedding())
    with safe_open(str(out / "model-00002-of-00002.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tok = source.tokenizer()
    assert not tok.add_bos
    assert tok.decode(prompt_tokens(tok, "Hi", raw=False)).startswith("<|im_start|>user\nHi")


def test_unknown_shape_lists_the_known_ones(tmp_path):
    with pytest.raises(ModelError, match="llama2-70b"):
        write_synthetic_model("llama9-1t", 1, tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("layers", [0, -1])
def test_needs_a_layer(tmp_path, layers):
    with pytest.raises(ModelError, match="at least 1 layer"):
        write_synthetic_model(SHAPE, layers, tmp_path / "x")


def test_refuses_a_non_empty_out(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ModelError, match="not empty"):
        write_synthetic_model(SHAPE, 1, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_interrupted_write_leaves_nothing(tmp_path):
    def interrupt(done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_synthetic_model(SMALL, 1, tmp_path / "model", progress=interrupt)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_shape_is_a_config_edgetp_reads(name):
    shape = SHAPES[name]
    config = config_from_hf(shape, name)
    assert config.n_layers == shape["num_hidden_layers"]
    assert config.head_dim == shape.get("head_dim", shape["hidden_size"] // config.n_heads)
    specials = tokenizer_style(name).specials
    assert {shape["bos_token_id"], shape["eos_token_id"]} <= set(specials)
    assert all(0 <= i < shape["vocab_size"] for i in specials)


def test_refuses_to_start_without_the_disk_space(tmp_path, monkeypatch):
    import edgetp.master.bench.synth as synth

    full = shutil.disk_usage(tmp_path)._replace(free=1)
    monkeypatch.setattr(synth.shutil, "disk_usage", lambda _: full)
    with pytest.raises(ModelError, match="free"):
        write_synthetic_model("llama2-70b", 80, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_a_mixture_shape_writes_every_tensor_its_family_is_read_by(name):
    """The experts and router under the names and shapes `HFSource` reads for the family (a
    layer of either is GBs: its plan is checked, not written)."""
    from edgetp.master.bench.synth import _shard_plan
    from edgetp.models.layers import ROUTER, full_layer_shapes, layer_tensor_names
    from edgetp.models.source import hf_layer_name

    config = config_from_hf(SHAPES[name], name)
    written = {t.name: t.shape for specs in _shard_plan(SHAPES[name], 1).values() for t in specs}
    shapes = full_layer_shapes(config)
    for tensor in (*layer_tensor_names(config), ROUTER):
        assert written.pop(hf_layer_name(0, tensor, config.architecture)) == shapes[tensor]
    assert set(written) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
