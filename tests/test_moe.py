"""A mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE, gpt-oss) split across nodes answers as
transformers' does.

A small random-weight model of each (2 layers, 8 experts of 128 columns, 2 a token; Qwen2-MoE's
shared expert beside them; gpt-oss' sinks, biases and window layer, its experts MXFP4 in its
GGUF file as llama.cpp writes them) saved as an HF folder and a GGUF file: its logits at every
position of a prefill and of its decode steps, at 1 to 4 nodes in this process and 3 real node
processes (the routing crosses the wire), and its greedy continuation, against transformers'.
Then the router on its own, and the STEP's routing checks.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import msgspec
import numpy as np
import pytest
import torch
from gguf_copy import write_shape
from test_families import (
    _assert_close_logits,
    _generated,
    _greedy,
    _llama_permute,
    _ours,
    _randomize,
    _reference,
    _windowed,
    check_tiles,
)

from edgetp.master.cluster.engine import Engine
from edgetp.models.config_files import config_from_gguf, config_from_hf
from edgetp.models.layers import StepBatch
from edgetp.models.moe import Routing, route
from edgetp.models.source import _GGUF_LAYER, _HF_LAYER, open_model
from edgetp.node import messages as M
from edgetp.node import protocol as P
from edgetp.node.steps import check_step

PROMPT_LENGTH = 40
NODES = (1, 2, 3, 4)

SMALL_MOE = {
    "hidden_size": 64,
    "intermediate_size": 128,  # a dense layer's: none here
    # 4 blocks of 32 columns (the plan's unit): every one of 4 nodes holds a slice of each expert
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # a head of o's columns is a whole number of q8_0 and q4_1 blocks
    "vocab_size": 320,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
}


# name -> (transformers config class, its values, GGUF architecture or None: an HF folder only)
MODELS = {
    "norm_topk": ("Qwen3MoeConfig", SMALL_MOE, "qwen3moe"),
    # llama.cpp's qwen3moe always renormalises the weights: no GGUF file holds this one
    "raw_topk": ("Qwen3MoeConfig", SMALL_MOE | {"norm_topk_prob": False}, None),
    # Mixtral: experts as wide as intermediate_size, weights renormalised, no query/key norms;
    # llama.cpp's converter writes it as a `llama` with experts, its Q and K rows permuted
    "mixtral": (
        "MixtralConfig",
        {k: v for k, v in SMALL_MOE.items() if not k.startswith(("num_experts", "norm", "moe"))}
        | {"num_local_experts": 8, "num_experts_per_tok": 2},
        "llama",
    ),
    # Qwen2-MoE: a shared expert two experts' widths wide beside the routed ones, Q/K/V biases;
    # llama.cpp never renormalises a qwen2moe's weights, nor does this one
    "qwen2moe": (
        "Qwen2MoeConfig",
        SMALL_MOE | {"norm_topk_prob": False, "shared_expert_intermediate_size": 256},
        "qwen2moe",
    ),
    # gpt-oss: a window of 24 (the prompt outgrows it), YaRN as its config has it; its experts'
    # gate and up are scaled up at build so that the clamp at 7 bites
    "gpt_oss": (
        "GptOssConfig",
        {k: v for k, v in SMALL_MOE.items() if not k.startswith(("num_experts", "norm", "moe"))}
        | {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 24},
        "gpt-oss",
    ),
}
GGUF_MODELS = sorted(name for name, (_, _, arch) in MODELS.items() if arch)
_BUILT: dict[str, tuple] = {}  # each model is made once for the module


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe(request, tmp_path_factory):
    """(transformers model, its HF folder (with model.gguf where a GGUF can hold it), a
    prompt)."""
    return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=GGUF_MODELS)
def gguf_moe(request, tmp_path_factory):
    """A model a GGUF file can hold."""
    return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["norm_topk", "qwen2moe"])
def block_moe(request, tmp_path_factory):
    """A Qwen3-MoE, and a Qwen2-MoE whose shared expert's pieces are columns inside its
    matrices: the models whose block shards are split."""
    return _built(request.param, tmp_path_factory)


def _built(name: str, tmp_path_factory) -> tuple:
    if name not in _BUILT:
        _BUILT[name] = _build(name, tmp_path_factory)
    return _BUILT[name]


def _build(name: str, tmp_path_factory) -> tuple:
    import transformers

    config_class, values, arch = MODELS[name]
    config = getattr(transformers, config_class)(**values)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    _randomize(model, seed=7)
    if arch == "gpt-oss":
        _as_mxfp4(model)
    model.eval()
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    if arch == "gpt-oss":
        _write_gpt_oss_gguf(model, folder / "model.gguf")
        _write_mxfp4_folder(model, folder, folder / "mxfp4")
    elif arch:
        _write_gguf(model, arch, folder / "model.gguf")
    prompt = torch.randint(
        0, config.vocab_size, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(0)
    )
    return model, folder, prompt.tolist()


def _write_gguf(model, arch: str, path: Path) -> None:
    """The model as llama.cpp's converter writes a qwen3moe or a Mixtral (`llama`), f32: each
    layer's experts as three stacks (n_experts, out, in), the router as ffn_gate_inp."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    write_shape(writer, c)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_expert_count(c.num_local_experts if arch == "llama" else c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if arch != "llama":  # a Mixtral's experts are feed_forward_length wide
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_vocab_size(c.vocab_size)
    state = {k: v.detach().float().contiguous().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    names = {hf: _GGUF_LAYER[canonical] for canonical, hf in _HF_LAYER.items()}
    heads = {"attn_q.weight": c.num_attention_heads, "attn_k.weight": c.num_key_value_heads}
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf, name in names.items():
            if prefix + hf in state:
                t = state[prefix + hf]
                if arch == "llama" and name in heads:
                    t = _llama_permute(torch.from_numpy(t), heads[name]).numpy()
                if name == "ffn_gate_inp_shexp.weight":  # llama.cpp's is a vector
                    t = t.reshape(-1)
                writer.add_tensor(f"blk.{i}.{name}", t)
        # transformers holds each layer's experts as (E, 2F, D) gate and up, and (E, D, F) down
        gate, up = np.split(state[f"{prefix}mlp.experts.gate_up_proj"], 2, axis=1)
        stacks = {"gate": gate, "up": up, "down": state[f"{prefix}mlp.experts.down_proj"]}
        for proj, stack in stacks.items():
            writer.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", np.ascontiguousarray(stack))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _mxfp4_rows(t: np.ndarray) -> np.ndarray:
    """(E, out, in) float32 as MXFP4 blocks along `in`, as llama.cpp stores gpt-oss' experts."""
    return gguf.quants.quantize(np.ascontiguousarray(t), gguf.GGMLQuantizationType.MXFP4)


def _as_mxfp4(model) -> None:
    """gpt-oss' experts' gate and up 8 times larger (some of the SwiGLU's inputs then pass its
    clamp), and every expert matrix rounded to what MXFP4 holds: the HF folder and the GGUF
    file (its experts in MXFP4) are then the same model."""
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj.mul_(8)
            for p in (experts.gate_up_proj, experts.down_proj):  # (E, in, out)
                rows = p.transpose(1, 2).numpy()  # (E, out, in)
                rounded = gguf.quants.dequantize(_mxfp4_rows(rows), mxfp4)
                p.copy_(torch.from_numpy(rounded).transpose(1, 2))


def _write_mxfp4_folder(model, folder: Path, out: Path) -> None:
    """The HF folder as openai publishes gpt-oss: its experts' matrices as MXFP4 blocks (E, out,
    in / 32, 16), two values a byte (2i low, 2i + 1 high), and their scales (E, out, in / 32)."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    for i in range(model.config.num_hidden_layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            rows = state.pop(name).transpose(1, 2).numpy()  # (E, out, in), gate and up interleaved
            blocks = _mxfp4_rows(rows).reshape(*rows.shape[:2], -1, 17)
            q = torch.from_numpy(blocks[..., 1:])  # GGUF's: values j and j + 16 in byte j
            values = torch.cat((q & 0x0F, q >> 4), dim=-1)  # (E, out, in / 32, 32) in order
            state[name + "_blocks"] = values[..., 0::2] | (values[..., 1::2] << 4)
            state[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(blocks[..., 0]))
            # transformers' own reading of such blocks gives the model's (E, in, out) back
            again = convert_moe_packed_tensors(
                state[name + "_blocks"], state[name + "_scales"], dtype=torch.float32
            )
            assert torch.equal(again, torch.from_numpy(rows).transpose(1, 2))
    save_file(state, str(out / "model.safetensors"))


def _write_gpt_oss_gguf(model, path: Path) -> None:
    """A gpt-oss as llama.cpp's converter writes it: its experts' gate and up apart (HF's
    interleave them by column), each stack (E, out, in) in MXFP4, their biases (E, out) beside
    them, the sinks as attn_sinks, the FFN norm as post_attention_norm."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    write_shape(writer, c)
    rope = c.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_sliding_window(c.sliding_window)
    writer.add_vocab_size(c.vocab_size)
    state = {k: v.detach().float().contiguous().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.sinks": "attn_sinks.weight",
        "mlp.router.weight": "ffn_gate_inp.weight",
        "mlp.router.bias": "ffn_gate_inp.bias",
    }
    for proj, short in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")):
        for kind in ("weight", "bias"):
            names[f"self_attn.{proj}_proj.{kind}"] = f"attn_{short}.{kind}"
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for hf, name in names.items():
            writer.add_tensor(f"blk.{i}.{name}", state[prefix + hf])
        gate_up = state[f"{prefix}mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # (E, 2F, D)
        bias = state[f"{prefix}mlp.experts.gate_up_proj_bias"]
        stacks = {
            "gate": (gate_up[:, ::2], bias[:, ::2]),
            "up": (gate_up[:, 1::2], bias[:, 1::2]),
            "down": (
                state[f"{prefix}mlp.experts.down_proj"].transpose(0, 2, 1),
                state[f"{prefix}mlp.experts.down_proj_bias"],
            ),
        }
        for proj, (weight, b) in stacks.items():
            writer.add_tensor(
                f"blk.{i}.ffn_{proj}_exps.weight",
                _mxfp4_rows(weight),
                raw_dtype=gguf.GGMLQuantizationType.MXFP4,
            )
            writer.add_tensor(f"blk.{i}.ffn_{proj}_exps.bias", np.ascontiguousarray(b))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
def test_logits_equal_transformers_on_every_node_count(moe):
    model, folder, prompt = moe
    expected, continuation = _reference(model, prompt)
    source = open_model(folder)
    assert source.config.moe and source.config.n_experts == 8
    assert source.config.n_shared == (2 if "qwen2moe" in folder.name else 0)
    for n in NODES:
        engine = Engine.local(source, (1.0,) * n)
        # The C blocks run every layer's attention (gpt-oss' sinks and O bias too) and plain
        # SwiGLU experts (rows.c's rows_experts), a block at a call; gpt-oss' experts (clamped,
        # with biases) decode on NumPy.
        natives = [ex.native for ex in engine.executors]
        layers = list(range(source.config.n_layers))
        assert all(b is not None and list(b.attention_args) == layers for b in natives)
        plain = source.config.swiglu_limit is None
        assert all(b is not None and bool(b.experts_args) == plain for b in natives)
        assert all(b is not None and not b.whole for b in natives)
        assert all(s.n_ffn > 0 for s in engine.slices)  # every node a slice of every expert
        ours = _ours(engine, prompt, continuation)
        _assert_close_logits(ours, expected, f"{folder.name} {n} node(s)")


@pytest.mark.slow
def test_gguf_logits_equal_transformers_on_every_node_count(gguf_moe):
    model, folder, prompt = gguf_moe
    expected, continuation = _reference(model, prompt)
    source = open_model(folder / "model.gguf")
    hf = open_model(folder).config
    assert replace(source.config, architecture=hf.architecture, norm_eps=hf.norm_eps) == hf
    for n in NODES:
        ours = _ours(Engine.local(source, (1.0,) * n), prompt, continuation)
        _assert_close_logits(ours, expected, f"{folder.name} gguf {n} node(s)")


@pytest.mark.slow
@pytest.mark.parametrize("stored", ["model.gguf", "mxfp4"])
def test_gpt_oss_mxfp4_experts_stay_mxfp4_on_real_nodes(tmp_path_factory, stored):
    """gpt-oss' MXFP4 experts, in a GGUF file (llama.cpp's blocks) or an HF folder (openai's
    blocks and scales), are split into MXFP4 shards as they are stored (`auto`), multiplied in
    their blocks by 3 processes: transformers' logits, on the values MXFP4 holds. The HF
    folder's at 1 to 4 nodes in this process too."""
    model, folder, prompt = _built("gpt_oss", tmp_path_factory)
    expected, continuation = _reference(model, prompt)
    source = open_model(folder / stored)
    assert source.stored_type(0, "gate.0") == "MXFP4"
    dtypes = source.matrix_dtypes(0, "auto")
    assert (dtypes["w_gate_up"], dtypes["w_down"], dtypes["wqkv"]) == ("mxfp4", "mxfp4", "f32")
    ours = _windowed(source, 3, "auto", prompt, continuation, 128)
    _assert_close_logits(ours, expected, f"gpt-oss {stored}, MXFP4 experts, 3 real nodes")
    if stored == "mxfp4":
        for n in NODES:
            ours = _ours(Engine.local(source, (1.0,) * n), prompt, continuation)
            _assert_close_logits(ours, expected, f"gpt-oss MXFP4 HF folder, {n} node(s)")


def test_lookup_drafts_change_no_greedy_token_of_gpt_oss_on_every_node_count(
    tmp_path_factory, smollm2_tokenizer
):
    """gpt-oss (sliding-window rings of 24 positions, sinks, experts): a prompt that repeats
    itself past its window, continued with lookup drafts and without: drafts are made and the
    tokens are one node's without drafts at every node count. (SmolLM2's vocabulary stands in
    to detokenize: the ids are below 320.)"""
    from test_gemma4 import _looped
    from test_speculate import SlowLinkSpeculator

    _, folder, prompt = _built("gpt_oss", tmp_path_factory)
    repeating = prompt[:12] * 3
    source = open_model(folder)
    assert source.config.sliding_window is not None
    assert len(repeating) > source.config.sliding_window
    one = _looped(Engine.local(source), repeating, smollm2_tokenizer)
    for n in NODES:
        engine = Engine.local(source, (1.0,) * n)
        speculator = SlowLinkSpeculator()
        assert _looped(engine, repeating, smollm2_tokenizer, speculator) == one, f"{n} nodes"
        print(f"\n{n} node(s): {speculator.figures()}")
        assert speculator.figures()["drafted"] > 0, f"{n} nodes"


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["split", "master"])
def test_real_nodes_equal_transformers(moe, attention):
    """3 processes, each streaming its slice from f32 shards: the routing goes over the wire,
    attention split across them or on the master alone."""
    model, folder, prompt = moe
    expected, continuation = _reference(model, prompt)
    ours = _windowed(open_model(folder), 3, "f32", prompt, continuation, 128, attention)
    _assert_close_logits(ours, expected, f"{folder.name} 3 real nodes, attention {attention}")


@pytest.mark.slow
def test_greedy_32_tokens_equal_transformers_generate_on_every_node_count(moe):
    model, folder, prompt = moe
    expected = _generated(model, prompt)
    source = open_model(folder)
    for n in NODES:
        assert _greedy(Engine.local(source, (1.0,) * n), prompt, 32) == expected, f"{n} node(s)"


@pytest.mark.slow
def test_gpt_oss_sinks_and_window_in_tiles_equal_transformers(tmp_path_factory, monkeypatch):
    """gpt-oss' sinks (explicit scores, a tile's at a time) and its window of 24: a prompt's
    attention in tiles, continued, batched and whole."""
    model, folder, prompt = _built("gpt_oss", tmp_path_factory)
    check_tiles(open_model(folder / "model.gguf"), model, prompt, "gpt_oss", monkeypatch)


@pytest.mark.slow
def test_batched_prefill_and_decode_equal_one_sequence_at_a_time(moe):
    """Two sequences in one step group their tokens by expert together: each gets what it
    gets alone."""
    _, folder, prompt = moe
    source = open_model(folder)
    alone = [Engine.local(source, (1.0, 1.0), slots=1) for _ in range(2)]
    a, b = prompt[:30], prompt[10:]
    want = [
        e.forward([p], StepBatch((0,), (0,), (len(p),)))[0]
        for e, p in zip(alone, (a, b), strict=True)
    ]
    both = Engine.local(source, (1.0, 1.0), slots=2)
    got = both.forward([a, b], StepBatch((0, 1), (0, 0), (len(a), len(b))))
    for g, w in zip(got, want, strict=True):
        _assert_close_logits(g.unsqueeze(0), w.unsqueeze(0), "batched prefill")
    step = StepBatch((0, 1), (len(a), len(b)), (1, 1))
    got = both.forward([[5], [6]], step)
    for i, (e, p, t) in enumerate(zip(alone, (a, b), (5, 6), strict=True)):
        w = e.forward([[t]], StepBatch((0,), (len(p),), (1,)))[0]
        _assert_close_logits(got[i].unsqueeze(0), w.unsqueeze(0), "batched decode")


def test_router_picks_the_top_experts_with_renormalised_weights():
    from edgetp.models.config import ModelConfig

    config = ModelConfig(
        architecture="Qwen3MoeForCausalLM", n_layers=1, hidden=4, n_heads=1, n_kv_heads=1,
        head_dim=4, ffn_hidden=8, vocab_size=10, context_length=16, norm_eps=1e-6,
        rope_theta=1e4, n_experts=3, n_experts_used=2, norm_topk_prob=True,
    )  # fmt: skip
    router = torch.eye(3, 4) * 10  # expert e reads component e of the normed state
    h = np.array([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 1.0, 0.5]], np.float32)
    r = route(h, torch.ones(4), router, config)
    assert r.experts.tolist() == [[1, 2], [2, 0]]
    np.testing.assert_allclose(r.weights.sum(axis=1), 1.0, rtol=1e-6)
    assert (r.weights[:, 0] > r.weights[:, 1]).all()


def test_a_shared_expert_joins_every_token_at_its_gate_weight():
    """Qwen2-MoE: the shared expert, cut as n_shared more experts, is every token's at the
    weight sigmoid(x @ its gate), beside the routed experts' raw softmax values."""
    from edgetp.models.config import ModelConfig

    config = ModelConfig(
        architecture="Qwen2MoeForCausalLM", n_layers=1, hidden=4, n_heads=1, n_kv_heads=1,
        head_dim=4, ffn_hidden=8, vocab_size=10, context_length=16, norm_eps=1e-6,
        rope_theta=1e4, n_experts=3, n_experts_used=1, n_shared=2,
    )  # fmt: skip
    router = torch.cat((torch.eye(3, 4) * 10, torch.tensor([[0.0, 0.0, 0.0, 1.0]])))
    h = np.array([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 1.0, -0.5]], np.float32)
    r = route(h, torch.ones(4), router, config)
    assert r.experts.tolist() == [[1, 3, 4], [2, 3, 4]]
    x = torch.nn.functional.rms_norm(torch.from_numpy(h), (4,), eps=1e-6)
    gate = torch.sigmoid(x[:, 3]).numpy()
    np.testing.assert_allclose(r.weights[:, 1:], np.stack([gate, gate], axis=1), rtol=1e-6)
    routed = torch.softmax(x @ router[:3].T, dim=-1).max(dim=-1).values  # not renormalised
    np.testing.assert_allclose(r.weights[:, 0], routed.numpy(), rtol=1e-6)


class _Cache:
    """What `check_step` reads of a KV cache."""

    slots, max_context = 2, 16


def _config():

    values = {"architectures": ["Qwen3MoeForCausalLM"], **SMALL_MOE}
    return config_from_hf(values, "config.json")


@pytest.mark.parametrize(
    ("experts", "weights", "why"),
    [
        (None, None, "without its experts"),
        ([[0, 8], [1, 2]], [[0.5, 0.5], [0.5, 0.5]], "expert 8 of 8"),
        ([[0, 1]], [[0.5, 0.5]], r"not \(2, 2\)"),
        ([[0, 1], [3, 3]], [[0.5, 0.5], [0.5, 0.5]], "twice"),
        ([[0, 1], [2, 3]], [[0.5, float("nan")], [0.5, 0.5]], "finite"),
        ([[0, 1], [2]], [[0.5, 0.5], [0.5, 0.5]], "not a table"),
    ],
)
def test_a_step_with_bad_routing_is_a_protocol_error(experts, weights, why):
    config = _config()
    batch = StepBatch((0, 1), (3, 4), (1, 1))
    step = M.Step(step=1, layer=0, block=P.FFN, batch=batch, experts=experts,
                  expert_weights=weights)  # fmt: skip
    h = [np.zeros((2, config.hidden), np.float32)]
    with pytest.raises(M.ProtocolError, match=why):
        check_step(step, h, config, _Cache(), None)  # type: ignore[arg-type]


def test_a_step_of_a_shared_expert_carries_its_pieces():

    values = {"architectures": ["Qwen2MoeForCausalLM"], **MODELS["qwen2moe"][1]}
    config = config_from_hf(values, "config.json")
    assert (config.n_shared, config.n_stacked) == (2, 10)
    batch = StepBatch((0, 1), (3, 4), (1, 1))
    h = [np.zeros((2, config.hidden), np.float32)]
    routed = [[0, 5], [1, 2]]
    for experts, why in ((routed, r"not \(2, 4\)"), ([[0, 5, 8, 10], [1, 2, 8, 9]], "10 of 10")):
        weights = [[0.5] * len(experts[0])] * 2
        step = M.Step(step=1, layer=0, block=P.FFN, batch=batch, experts=experts,
                      expert_weights=weights)  # fmt: skip
        with pytest.raises(M.ProtocolError, match=why):
            check_step(step, h, config, _Cache(), None)  # type: ignore[arg-type]
    good = [[0, 5, 8, 9], [1, 2, 8, 9]]
    step = M.Step(step=1, layer=0, block=P.FFN, batch=batch, experts=good,
                  expert_weights=[[0.5] * 4] * 2)  # fmt: skip
    work = check_step(step, h, config, _Cache(), None)  # type: ignore[arg-type]
    assert work.routing is not None and work.routing.experts.tolist() == good


def test_routing_travels_in_a_step_and_back():
    config = _config()
    routing = Routing(np.array([[3, 1], [0, 7]]), np.array([[0.75, 0.25], [0.5, 0.5]], np.float32))
    step = M.Step(
        step=1,
        layer=1,
        block=P.FFN,
        batch=StepBatch((0, 1), (3, 4), (1, 1)),
        experts=routing.experts.tolist(),
        expert_weights=routing.weights.tolist(),
    )
    h = np.ones((2, config.hidden), np.float32)
    message, tensors = M.decode_from_master(M.encode(step, (h,)))
    cache = _Cache()
    work = check_step(message, tensors, config, cache, None)
    assert work.routing is not None
    np.testing.assert_array_equal(work.routing.experts, routing.experts)
    np.testing.assert_array_equal(work.routing.weights, routing.weights)
    # an attention block carries none
    with pytest.raises(M.ProtocolError, match="experts in a STEP"):
        check_step(
            msgspec.structs.replace(message, block=P.ATTENTION), tensors, config, cache, None
        )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["q8_0", "q4_1"])
def test_block_experts_split_across_real_nodes_equal_one_node(block_moe, dtype):
    """Each expert's rows of the stacked matrices are multiplied in their blocks where they
    lie, a shared expert's pieces cut from its blocks by columns: a split gives what one node
    gives on the same weights. (int8's per-row scales span a slice's columns: another split is
    other weights.)"""
    model, folder, prompt = block_moe
    _, continuation = _reference(model, prompt)
    source = open_model(folder)
    one = _windowed(source, 1, dtype, prompt, continuation, 128)
    three = _windowed(source, 3, dtype, prompt, continuation, 128)
    _assert_close_logits(three, one, f"{folder.name} {dtype} 3 real nodes against 1")


def test_kernels_are_prepared_for_one_expert_at_a_time(moe):
    """The stacked matrices are multiplied an expert's rows at a time: those are the products
    a device checks kernels for, whichever way it is asked (a plan, a loaded slice)."""
    from edgetp.master.cluster.plan import plan_slices
    from edgetp.node.device import plan_shapes

    _, folder, _ = moe
    source = open_model(folder)
    c = source.config
    engine = Engine.local(source, (1.0, 1.0))
    slices = plan_slices(c, (1.0, 1.0))
    want = {("f32", 2 * s.n_ffn, c.hidden) for s in slices} | {
        ("f32", c.hidden, s.n_ffn) for s in slices
    }
    loaded = {shape for ex in engine.executors for shape in ex.matrix_shapes()}
    assert want <= loaded
    assert want <= set(plan_shapes(source, slices, "f32"))
    stacked = c.n_experts * 2 * slices[0].n_ffn
    assert all(rows < stacked for _, rows, _ in loaded)


@pytest.mark.parametrize(
    ("arch", "lacks"),
    [
        ("DeepseekV3ForCausalLM", "multi-head latent attention (MLA)"),
        ("deepseek2", "multi-head latent attention (MLA)"),
    ],
)
def test_an_unsupported_mixture_is_refused_in_one_line_naming_what_it_lacks(arch, lacks):
    from edgetp.models.errors import ModelError

    with pytest.raises(ModelError) as refused:
        if arch[0].isupper():
            config_from_hf({"architectures": [arch]}, "config.json")
        else:
            config_from_gguf({"general.architecture": arch}, "model.gguf", tied=False)
    message = str(refused.value)
    assert f"{arch!r} is not supported (it needs {lacks}" in message
    assert "Mixtral (llama / MixtralForCausalLM)" in message and "\n" not in message


def test_a_gguf_mixtral_with_one_tensor_an_expert_is_refused(tmp_path):
    """Older converters wrote blk.N.ffn_gate.E.weight, an expert a tensor: say to convert
    again rather than fail on a missing tensor halfway through."""
    from edgetp.models.errors import ModelError

    path = tmp_path / "old.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in [
        (writer.add_block_count, 1), (writer.add_embedding_length, 8),
        (writer.add_feed_forward_length, 16), (writer.add_head_count, 2),
        (writer.add_context_length, 32), (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_expert_count, 2), (writer.add_expert_used_count, 1),
        (writer.add_vocab_size, 4),
    ]:  # fmt: skip
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.add_tensor("blk.0.ffn_gate.0.weight", np.zeros((16, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match="not stacked as blk.N.ffn_gate_exps.*convert the model"):
        open_model(path)


def test_synth_gpt_oss_20b_writes_every_tensor_its_reader_takes():
    """`edgetp synth --shape gpt-oss-20b`: every tensor `HFSource` reads for a gpt-oss, under
    transformers' names and shapes (its experts one (E, in, out) tensor each: a layer is GBs,
    so its plan is checked, not written), and the published config read as gpt-oss."""
    from edgetp.master.bench.synth import _shard_plan
    from edgetp.master.bench.synth_models import SHAPES
    from edgetp.models.layers import ROUTER, ROUTER_BIAS, full_layer_shapes, layer_tensor_names
    from edgetp.models.source import hf_layer_name

    shape = SHAPES["gpt-oss-20b"]
    config = config_from_hf(shape, "gpt-oss-20b")
    assert (config.n_experts, config.n_experts_used, config.ffn_hidden) == (32, 4, 2880)
    assert config.local_layers == tuple(range(0, 24, 2)) and config.sliding_window == 128
    assert config.rope_scaling is not None and not config.rope_scaling.truncate
    written = {t.name: t.shape for specs in _shard_plan(shape, 1).values() for t in specs}
    shapes = full_layer_shapes(config)
    fused = {
        "mlp.experts.gate_up_proj": (32, 2880, 5760),
        "mlp.experts.down_proj": (32, 2880, 2880),
        "mlp.experts.gate_up_proj_bias": (32, 5760),
        "mlp.experts.down_proj_bias": (32, 2880),
    }
    for tensor in (*layer_tensor_names(config), ROUTER, ROUTER_BIAS):
        name = hf_layer_name(0, tensor, config.architecture)
        want = fused.get(name.removeprefix("model.layers.0."), shapes[tensor])
        assert written[name] == want, tensor
    taken = {hf_layer_name(0, t, config.architecture) for t in shapes}
    assert set(written) - taken == {"model.embed_tokens.weight", "model.norm.weight",
                                    "lm_head.weight"}  # fmt: skip


def test_the_c_blocks_run_gpt_oss_attention_but_not_its_experts():
    """gpt-oss' experts (clamped SwiGLU, biases) decode on NumPy rows, so its layers never run
    whole in C; its attention (sinks, O bias) does, a block at a call (held to transformers by
    test_logits_equal_transformers_on_every_node_count)."""
    from edgetp.models import rows_native

    values = {"architectures": ["GptOssForCausalLM"], **MODELS["gpt_oss"][1]}
    config = config_from_hf(values, "config.json")
    assert config.attention_sinks and config.o_bias
    assert "mixture of experts" in str(rows_native.unsupported(config, {}))
    assert "plain SwiGLU" in str(rows_native.experts_unsupported(config, []))


def test_a_gpt_oss_gguf_vocabulary_splits_words_as_o200k_does(monkeypatch):
    """A gpt-oss GGUF file's `gpt-4o` pre-tokenizer cuts text into the words tiktoken's o200k
    pattern does (its pattern read from tiktoken, without its BPE file)."""
    import regex
    from tiktoken_ext import openai_public

    from edgetp.models.gguf_vocab import byte_level_bpe_from_gguf, bytes_to_unicode

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *_, **__: {})
    pattern = openai_public.o200k_base()["pat_str"]
    spelling = bytes_to_unicode()
    metadata = {
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": [*spelling.values(), "ĠĠ"],
        "tokenizer.ggml.merges": ["Ġ Ġ"],
    }
    engine = byte_level_bpe_from_gguf(metadata, "model.gguf")
    text = "Hello WORLDs'RE it's 12345 a/b/\r\n\n  x  ÉcolePARISien don'T ½ 3.14\tfooBar"
    pieces = [p for p, _ in engine._backend.pre_tokenizer.pre_tokenize_str(text)]
    words = regex.findall(pattern, text)
    assert pieces == ["".join(spelling[b] for b in w.encode()) for w in words]
    assert len(words) > 20  # the pattern cut the text


def test_a_harmony_vocabulary_ends_a_turn_on_return_not_on_end(tmp_path):
    """gpt-oss ends each message with <|end|>, its reasoning's too: it stops on <|return|>,
    <|call|> and <|endoftext|>, the ids its generation_config lists (200002, 200012, 199999),
    as the synthetic gpt-oss' tokenizer has them."""
    from edgetp.master.bench.synth import _write_tokenizer
    from edgetp.models.chat_template import render_chat
    from edgetp.models.tokenizer import Tokenizer

    _write_tokenizer(tmp_path, "gpt-oss-20b")
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.eos_ids == {200002, 200012, 199999}
    assert tokenizer.token_to_id("<|end|>") == 200007
    text = render_chat(tokenizer.chat_template, [{"role": "user", "content": "Hi"}],
                       bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)  # fmt: skip
    assert text == "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    assert tokenizer.encode(text)[:2] == [200006, tokenizer.encode("user")[0]]
