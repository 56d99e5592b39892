"""Each supported model family against transformers' implementation of the same weights.

transformers builds a small model of the family's real layout (GQA groups, a head_dim that is
not hidden / heads where the family has one) with random weights; it is saved as an HF folder
and as a GGUF file, and our logits are compared with transformers' at every position of a
prefill and of 16 decode steps, for 1 to 4 nodes (more than the KV heads), f32.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from gguf_copy import write_shape

from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.local import local_engine
from edgetp.memory.budget import MemoryOptions
from edgetp.models import block_math
from edgetp.models.config_files import config_from_hf
from edgetp.models.layers import StepBatch
from edgetp.models.source import _GGUF_LAYER, _HF_LAYER, open_model

pytestmark = pytest.mark.slow

PROMPT_LENGTH = 40
DECODE_STEPS = 16
NODES = (1, 2, 3, 4)  # the models below have 2 KV heads

SMALL = {
    "hidden_size": 96,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}

PHI_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # within the vocabulary
# family -> (transformers config class name, the config's family-specific keys, GGUF arch)
FAMILIES = {
    "qwen3": ("Qwen3Config", {"head_dim": 32, "rope_theta": 1e6}, "qwen3"),
    "llama3-rope": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            # original context 64 < the 56 positions used: every band of the scaling is hit
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        "llama",
    ),
    "qwen2-yarn": (
        "Qwen2Config",
        {
            "rope_theta": 10000.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        "qwen2",
    ),
    # Phi-4-mini's layout: a quarter of each head unrotated, LongRoPE, tied embeddings. The
    # sequences are past the original context of 32: the long factors, on both sides.
    "phi4-mini": (
        "Phi3Config",
        {
            "partial_rotary_factor": 0.75,
            "tie_word_embeddings": True,
            **PHI_TOKENS,
            "original_max_position_embeddings": 32,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.5],
                "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0],
            },
        },
        "phi3",
    ),
    # Phi-3.5-mini's: whole heads rotated, LongRoPE run within the original context of 80 (the
    # KV cache holds 80 positions): the short factors.
    "phi3.5-mini": (
        "Phi3Config",
        {
            **PHI_TOKENS,
            "original_max_position_embeddings": 80,
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
                "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0],
            },
        },
        "phi3",
    ),
    # Gemma 3's layout: one KV head, head_dim 32 with a query scale of its own, 6 layers of which
    # the 6th is global (as llama.cpp reads a GGUF file), a local window of 16 (the prompt is
    # 40), the global layers' RoPE scaled as the 4B and larger models have it.
    "gemma3": (
        "Gemma3TextConfig",
        {
            "num_hidden_layers": 6,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 16,
            "rope_parameters": {
                "full_attention": {
                    "rope_type": "linear",
                    "factor": 8.0,
                    "rope_theta": 1000000.0,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            **PHI_TOKENS,
        },
        "gemma3",
    ),
    # SmolLM3's layout: every 4th layer unrotated (the 4th of 4 here, as llama.cpp reads a GGUF
    # file), tied embeddings
    "smollm3": (
        "SmolLM3Config",
        {"num_hidden_layers": 4, "rope_theta": 2e6, **PHI_TOKENS},
        "smollm3",
    ),
}
# Gemma 3 27B's scores are scaled by query_pre_attn_scalar = hidden / heads, not head_dim. A GGUF
# file holds no scale (llama.cpp tells the 27B by its layer count): an HF folder only.
FAMILIES["gemma3-27b-scale"] = (
    "Gemma3TextConfig",
    FAMILIES["gemma3"][1] | {"query_pre_attn_scalar": 24},
    "gemma3",
)
# A Llama with attention_bias: transformers gives its Q, K, V and O projections biases; a GGUF
# file has their tensors and no key for them.
FAMILIES["llama-attention-bias"] = ("LlamaConfig", {"attention_bias": True}, "llama")
HF_ONLY = {"gemma3-27b-scale"}
# KV cache positions where a family's RoPE depends on them (default: the model's context)
CONTEXT = {"phi3.5-mini": 80}
# llama.cpp's names of Gemma 3's norms (its "post_attention" norm is after attention)
GGUF_GEMMA_NORMS = {
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# llama.cpp's names of the fused matrices
GGUF_FUSED = {
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights at a scale where every part of the layer moves the logits: norms around 1 (not
    the initial ones a wrong reading would not notice), matrices at 1/sqrt(fan-in)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _llama_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order (interleaved RoPE pairs), which GGUF files hold."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(model, arch: str, path: Path) -> None:
    """The model's weights as a GGUF file of architecture `arch`, f32, as llama.cpp's converter
    names and orders them."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    write_shape(writer, c)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers'
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "gemma3":
        writer.add_sliding_window(c.sliding_window)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "longrope":
        # llama.cpp's converter: the factors as tensors, the rotated dims and the attention factor
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(model.model.rotary_emb.attention_scaling)
        for kind in ("short", "long"):
            factors = torch.tensor(rope[f"{kind}_factor"], dtype=torch.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors.numpy())
    if rope.get("rope_type") == "llama3":
        # llama.cpp's converter stores Llama 3 scaling as a divisor per frequency
        rotary = model.model.rotary_emb
        default = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2).double() / head_dim)
        writer.add_tensor("rope_freqs.weight", (default / rotary.inv_freq.double()).float().numpy())
    writer.add_vocab_size(c.vocab_size)
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    if arch == "gemma3":  # llama.cpp's converter stores Gemma's norms as 1 + weight
        state = {k: v + 1 if k.endswith("norm.weight") else v for k, v in state.items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    if not c.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"].numpy())
    names = {hf: _GGUF_LAYER[canonical] for canonical, hf in _HF_LAYER.items()} | GGUF_FUSED
    if arch == "gemma3":
        names |= GGUF_GEMMA_NORMS
    heads = {"attn_q.weight": c.num_attention_heads, "attn_k.weight": c.num_key_value_heads}
    heads |= {"attn_q.bias": c.num_attention_heads, "attn_k.bias": c.num_key_value_heads}
    for key, t in state.items():
        if not key.startswith("model.layers."):
            continue
        i, hf = key.removeprefix("model.layers.").split(".", 1)
        name = names[hf]
        if arch in ("llama", "smollm3") and name in heads:
            t = _llama_permute(t, heads[name])
        writer.add_tensor(f"blk.{i}.{name}", t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_BUILT: dict[str, tuple] = {}


def _build(name: str, tmp_path_factory) -> tuple:
    """(family name, transformers model, its HF folder (with model.gguf but for HF_ONLY), a
    prompt), once."""
    import transformers

    if name not in _BUILT:
        config_class, extra, arch = FAMILIES[name]
        config = getattr(transformers, config_class)(**(SMALL | extra))
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.float32
        )
        _randomize(model, seed=len(name))
        model.eval()
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        if name not in HF_ONLY:
            _write_gguf(model, arch, folder / "model.gguf")
        prompt = torch.randint(
            0, config.vocab_size, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(0)
        )
        _BUILT[name] = (name, model, folder, prompt.tolist())
    return _BUILT[name]


@pytest.fixture(scope="module", params=sorted(set(FAMILIES) - HF_ONLY))
def family(request, tmp_path_factory):
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The family whose layer has the most tensors of its own (query and key norms)."""
    return _build("qwen3", tmp_path_factory)


# (model, prompt) -> its reference: a model's every test (HF folder and GGUF file, in this
# process and on real nodes, each block dtype) compares with the same one
_REFERENCES: dict[tuple[torch.nn.Module, tuple[int, ...]], tuple[torch.Tensor, list[int]]] = {}


@torch.inference_mode()
def _reference(model, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits at every position of prompt + its greedy continuation, and that
    continuation (DECODE_STEPS tokens), computed once per model and prompt."""
    key = (model, tuple(prompt))
    if key not in _REFERENCES:
        ids = list(prompt)
        for _ in range(DECODE_STEPS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        _REFERENCES[key] = model(torch.tensor([ids])).logits[0], ids[len(prompt) :]
    return _REFERENCES[key]


@torch.inference_mode()
def _ours(engine: Engine, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Our logits for the prompt (one prefill step) and then the continuation, one decode step
    a token (the decode path), fed the reference's tokens so both see the same sequence."""
    logits = [engine.forward([prompt], StepBatch((0,), (0,), (len(prompt),)), all_logits=True)[0]]
    for i, token in enumerate(continuation):
        step = StepBatch((0,), (len(prompt) + i,), (1,))
        logits.append(engine.forward([[token]], step))
    return torch.cat(logits)


def _assert_close_logits(ours: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    worst = float((ours - expected).abs().max())
    bound = 1e-3 * float(expected.abs().max())
    print(f"{what}: max|logit difference| {worst:.2e}, bound {bound:.2e}")
    assert worst <= bound, f"{what}: {worst} > {bound}"


@pytest.mark.parametrize(
    ("family", "source"),
    [(f, s) for f in sorted(FAMILIES) for s in ("hf", "gguf") if s == "hf" or f not in HF_ONLY],
    indirect=["family"],
)
def test_logits_equal_transformers_at_every_position_on_every_node_count(family, source):
    name, model, folder, prompt = family
    expected, continuation = _reference(model, prompt)
    model_source = open_model(folder if source == "hf" else folder / "model.gguf")
    assert model_source.config.n_kv_heads < max(NODES)
    for n in NODES:
        engine = Engine.local(model_source, (1.0,) * n, max_context=CONTEXT.get(name))
        ours = _ours(engine, prompt, continuation)
        _assert_close_logits(ours, expected, f"{name} {source} {n} node(s)")


@torch.inference_mode()
@torch.inference_mode()
def _in_tiles(engine: Engine, prompt: list[int], continuation: list[int]) -> list[torch.Tensor]:
    """Our logits for `prompt` + `continuation`'s first token, three ways that attend in tiles
    (`block_math._attend_tiles`): the prompt in two steps, the second continuing the first
    (start > 0); the same whole in one step beside that first token, a sequence of its own
    (a batch of a long prompt); and in slot 2, the whole prompt from its start."""
    cut = len(prompt) // 3
    two_steps = torch.cat(
        [
            engine.forward([prompt[:cut]], StepBatch((0,), (0,), (cut,)), all_logits=True)[0],
            engine.forward(
                [prompt[cut:]], StepBatch((0,), (cut,), (len(prompt) - cut,)), all_logits=True
            )[0],
        ]
    )
    step = StepBatch((1, 0), (0, len(prompt)), (len(prompt), 1))
    batched = engine.forward([prompt, continuation[:1]], step, all_logits=True)
    whole = engine.forward([prompt], StepBatch((2,), (0,), (len(prompt),)), all_logits=True)[0]
    return [two_steps, torch.cat([batched[0], batched[1, :1]]), whole]


def check_tiles(source, model, prompt: list[int], what: str, monkeypatch) -> None:
    """At 1 and 2 nodes, with tiles of 7 queries (a prompt of 40 spans 6), each of
    `_in_tiles`' ways equals transformers at every position."""
    monkeypatch.setattr(block_math, "PROMPT_TILE", 7)
    expected, continuation = _reference(model, prompt)
    for n in (1, 2):
        engine = Engine.local(source, (1.0,) * n, slots=3)
        ways = _in_tiles(engine, prompt, continuation)
        for way, ours in zip(("two steps", "batched", "whole"), ways, strict=True):
            want = expected[: ours.shape[0]]
            _assert_close_logits(ours, want, f"{what} {n} node(s), tiles of 7, {way}")


@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_attention_in_tiles_equals_transformers(name, tmp_path_factory, monkeypatch):
    """Gemma 3's layout (local layers with a window of 16, a global layer) and Qwen3's (every
    layer global): a prompt's attention in tiles, continued, batched and whole."""
    name, model, folder, prompt = _build(name, tmp_path_factory)
    check_tiles(open_model(folder / "model.gguf"), model, prompt, name, monkeypatch)


def _generated(model, prompt: list[int], steps: int = 32) -> list[int]:
    """transformers' `generate`: the greedy tokens after `prompt` (every position attended: a
    random prompt may hold the pad id)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def _greedy(engine: Engine, prompt: list[int], steps: int = 32) -> list[int]:
    """Our greedy tokens after `prompt`: one prefill step, then a decode step a token."""
    ids = list(prompt)
    logits = engine.forward([ids], StepBatch((0,), (0,), (len(ids),)))
    for _ in range(steps):
        ids.append(int(logits[0].argmax()))
        logits = engine.forward([[ids[-1]]], StepBatch((0,), (len(ids) - 1,), (1,)))
    return ids[len(prompt) :]


def test_greedy_32_tokens_equal_transformers_generate(family):
    name, model, folder, prompt = family
    expected = _generated(model, prompt)
    for n in (1, 3):
        engine = Engine.local(open_model(folder), (1.0,) * n, max_context=CONTEXT.get(name))
        assert _greedy(engine, prompt) == expected, f"{name}, {n} node(s)"


def _windowed(
    source,
    nodes: int,
    dtype: str,
    prompt: list[int],
    continuation: list[int],
    context: int,
    attention: str = "split",
):
    """Our logits from `nodes` real processes, each streaming its slice one layer at a time
    from shards of `dtype`, attention split across them or on the master alone (`attention`)."""
    memory = MemoryOptions(window=1, dtype=dtype, attention=attention)
    with local_engine(source, nodes, context=context, memory=memory) as engine:
        return _ours(engine, prompt, continuation)


@pytest.mark.parametrize("attention", ["split", "master"])
def test_real_nodes_streaming_f32_shards_equal_transformers(family, attention):
    """Attention split across the nodes, or every head on the master (one sum a layer)."""
    name, model, folder, prompt = family
    expected, continuation = _reference(model, prompt)
    context = CONTEXT.get(name, 128)
    ours = _windowed(open_model(folder), 3, "f32", prompt, continuation, context, attention)
    _assert_close_logits(ours, expected, f"{name} 3 real nodes, window 1, attention {attention}")


@pytest.mark.parametrize("dtype", ["q8_0", "q4_1"])
def test_block_shards_split_across_real_nodes_equal_one_node(qwen3, dtype):
    """The family's own tensors survive each block dtype's shards: the split gives what one
    node gives on the same quantized weights."""
    name, model, folder, prompt = qwen3
    _, continuation = _reference(model, prompt)
    source = open_model(folder)
    one = _windowed(source, 1, dtype, prompt, continuation, 128)
    three = _windowed(source, 3, dtype, prompt, continuation, 128)
    _assert_close_logits(three, one, f"{name} {dtype} 3 real nodes against 1")


@pytest.mark.parametrize(
    "values",
    [{}, {"no_rope_layer_interval": 3}, {"no_rope_layers": [0, 1, 1, 1, 1, 0, 1, 0]}],
    ids=["default", "interval", "flags"],
)
def test_smollm3_leaves_unrotated_the_layers_transformers_does(values):
    import transformers

    values = SMALL | {"num_hidden_layers": 8, **PHI_TOKENS} | values
    flags = transformers.SmolLM3Config(**values).no_rope_layers
    config = config_from_hf({"architectures": ["SmolLM3ForCausalLM"], **values}, "c.json")
    assert config.unrotated_layers == tuple(i for i, rotated in enumerate(flags) if not rotated)
    assert config.unrotated_layers  # each case leaves some


def test_smollm3_flags_for_other_layers_are_refused():
    from edgetp.models.errors import ModelError

    values = {"architectures": ["SmolLM3ForCausalLM"], **SMALL, "no_rope_layers": [1, 0, 1]}
    with pytest.raises(ModelError, match="no_rope_layers has 3 flags for 2 layers"):
        config_from_hf(values, "config.json")


# A long-context configuration as Qwen2.5's are served past 32k: YaRN stretching an original
# context of 8,192 four times. Its prompt runs past the original context, where the stretched
# rotations are the only ones the model has (a tiny model: the length is what is under test).
YARN_32K = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
}
YARN_PROMPT = 8192 + 256


@torch.inference_mode()
def test_a_32k_yarn_config_equals_transformers_past_its_original_context(tmp_path):
    """The logits of the positions past the original 8,192 (a split's equal one node's: the
    tests above)."""
    import transformers

    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**YARN_32K)).eval()
    _randomize(model, seed=32)
    model.save_pretrained(tmp_path)
    prompt = torch.randint(0, 320, (YARN_PROMPT,), generator=torch.Generator().manual_seed(1))
    past = slice(8192, YARN_PROMPT)
    expected = model(prompt[None]).logits[0, past]  # SDPA: no T x T matrix of its own
    source = open_model(tmp_path)
    assert source.config.rope_scaling is not None and source.config.rope_scaling.kind == "yarn"
    engine = Engine.local(source, max_context=YARN_PROMPT)
    batch = StepBatch((0,), (0,), (YARN_PROMPT,))
    ours = engine.forward([prompt.tolist()], batch, all_logits=True)[0][past]
    _assert_close_logits(ours, expected, f"yarn 32k, positions 8192-{YARN_PROMPT}")
