"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next, whose layers are mostly gated DeltaNet (linear
attention), split across nodes, answer as transformers' do; and the fixed-size state each node
keeps a sequence in place of those layers' KV cache lives as a KV cache does: a new sequence
starts from zeros, a rejected draft is taken back, a kept sequence is carried on from its end.

Small random-weight models (4 layers, 3 of them DeltaNet: 4 value heads reading 2 key heads,
so that 3 and 4 nodes split a key head's value heads and replicate it), saved as HF folders:
their logits at every position of a prefill and of decode steps at 1 to 4 nodes in this
process and on 3 real node processes, and their greedy continuation, against transformers'.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from cluster_threads import master_threads
from local_processes import local_workers
from test_families import (
    _assert_close_logits,
    _generated,
    _greedy,
    _ours,
    _randomize,
    _reference,
    _windowed,
)
from test_moe_serving import (
    assert_lookup_drafts_change_no_token,
    client_of,
    generation,
    greedy,
    streamed,
    write_tokenizer,
)
from test_prompt_reuse import (
    QUESTIONS,
    converse,
    steps,  # noqa: F401 (a fixture)
)
from test_speculate import PARAGRAPH

from edgetp.master.bench.cluster_figures import node_row
from edgetp.master.bench.cluster_report import print_nodes
from edgetp.master.bridge.client import start_server
from edgetp.master.bridge.schema import ClusterFigures
from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.figures import BatcherStats, cluster_figures
from edgetp.master.cluster.local import local_session
from edgetp.master.cluster.session import Session
from edgetp.master.generation.reuse import SlotPool, reusable
from edgetp.memory.budget import MemoryOptions
from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.config_files import config_from_hf
from edgetp.models.errors import ModelError
from edgetp.models.layers import MATRICES, Slice, StepBatch
from edgetp.models.quant import FORMATS
from edgetp.models.source import open_model
from edgetp.node.kvcache import KVCache

PROMPT_LENGTH = 40
NODES = (1, 2, 3, 4)
SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 4,  # linear, linear, linear, full
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
EXPERTS = {
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
# name -> (transformers config class, its values, GGUF architecture)
MODELS = {
    "qwen3_5": ("Qwen3_5TextConfig", SMALL | {"intermediate_size": 128}, "qwen35"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", SMALL | EXPERTS, "qwen35moe"),
    # its in-projections interleave each key head's rows (models/hf_source.py, _next_rows)
    "qwen3_next": ("Qwen3NextConfig", SMALL | EXPERTS | {"intermediate_size": 128}, "qwen3next"),
}
_BUILT: dict[str, tuple] = {}
CYCLE = 7  # words the chat model's answers cycle through (`chat_folder`)


@pytest.fixture(scope="module", params=sorted(MODELS))
def hybrid(request, tmp_path_factory):
    """(transformers model, its HF folder, a prompt)."""
    return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return _built("qwen3_5", tmp_path_factory)


def _built(name: str, tmp_path_factory) -> tuple:
    if name not in _BUILT:
        import transformers

        config_class, values, arch = MODELS[name]
        config = getattr(transformers, config_class)(vocab_size=320, **values)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.float32
        )
        _randomize(model, seed=7)
        model.eval()
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        _write_gguf(model, arch, folder / "model.gguf")
        prompt = torch.randint(0, 320, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(0))
        _BUILT[name] = model, folder, prompt.tolist()
    return _BUILT[name]


def _tiled(t: np.ndarray, axis: int, config, width: int) -> np.ndarray:
    """Value heads from transformers' grouped order (a key head's g side by side) to llama.cpp's
    tiled one (each key head's first, then each one's second, ...), along `axis`, as its
    converter's `_reorder_v_heads` does for qwen35: a reshape and a swap of two axes."""
    nk, g = (
        config.linear_num_key_heads,
        config.linear_num_value_heads // config.linear_num_key_heads,
    )
    shape = t.shape
    split = (*shape[:axis], nk, g, width, *shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(t.reshape(split), axis, axis + 1).reshape(shape))


def _write_gguf(model, arch: str, path: Path, blocks: bool = False) -> None:
    """The model as llama.cpp's converter writes a qwen35, qwen35moe or qwen3next, f32: norms
    as 1 + weight but the DeltaNet's own, A_log as -exp(A_log), the convolution's taps
    squeezed; qwen3next's qkvz cut into attn_qkv and attn_gate (its b and a kept as one),
    qwen35's value heads in the tiled order. With `blocks`, each layer's matrices whose rows
    are whole blocks of 32 are Q8_0."""
    c = model.config
    moe = arch != "qwen35"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.moe_intermediate_size if moe else c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_full_attention_interval(4)
    writer.add_vocab_size(c.vocab_size)
    if moe:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    state = {k: v.detach().float().contiguous().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"] + 1)
    writer.add_tensor("output.weight", state["lm_head.weight"])
    keys, dv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_value_head_dim
    for i in range(c.num_hidden_layers):
        p, blk = f"model.layers.{i}.", f"blk.{i}."
        tensors = {
            "attn_norm.weight": state[p + "input_layernorm.weight"] + 1,
            "post_attention_norm.weight": state[p + "post_attention_layernorm.weight"] + 1,
        }
        if c.layer_types[i] == "full_attention":
            for proj, short in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")):
                tensors[f"attn_{short}.weight"] = state[f"{p}self_attn.{proj}_proj.weight"]
            for norm in ("q", "k"):
                tensors[f"attn_{norm}_norm.weight"] = state[f"{p}self_attn.{norm}_norm.weight"] + 1
        else:
            la = p + "linear_attn."
            tensors |= {
                "ssm_conv1d.weight": state[la + "conv1d.weight"][:, 0],
                "ssm_a": -np.exp(state[la + "A_log"]),
                "ssm_dt.bias": state[la + "dt_bias"],
                "ssm_norm.weight": state[la + "norm.weight"],
                "ssm_out.weight": state[la + "out_proj.weight"],
            }
            if arch == "qwen3next":  # per key head: q, k, its values, its z
                g = c.linear_num_value_heads // c.linear_num_key_heads
                dk = c.linear_key_head_dim
                qkvz = state[la + "in_proj_qkvz.weight"].reshape(
                    c.linear_num_key_heads, -1, c.hidden_size
                )
                q, k, v, z = np.split(qkvz, np.cumsum([dk, dk, g * dv])[:3], axis=1)
                rows = [x.reshape(-1, c.hidden_size) for x in (q, k, v, z)]
                tensors["attn_qkv.weight"] = np.concatenate(rows[:3])
                tensors["attn_gate.weight"] = rows[3]
                tensors["ssm_ba.weight"] = state[la + "in_proj_ba.weight"]
            else:
                qkv = state[la + "in_proj_qkv.weight"]
                v = _tiled(qkv[2 * keys :], 0, c, dv)
                tensors["attn_qkv.weight"] = np.concatenate((qkv[: 2 * keys], v))
                tensors["attn_gate.weight"] = _tiled(state[la + "in_proj_z.weight"], 0, c, dv)
                tensors["ssm_beta.weight"] = _tiled(state[la + "in_proj_b.weight"], 0, c, 1)
                tensors["ssm_alpha.weight"] = _tiled(state[la + "in_proj_a.weight"], 0, c, 1)
                conv = tensors["ssm_conv1d.weight"]
                tensors["ssm_conv1d.weight"] = np.concatenate(
                    (conv[: 2 * keys], _tiled(conv[2 * keys :], 0, c, dv))
                )
                for name in ("ssm_a", "ssm_dt.bias"):
                    tensors[name] = _tiled(tensors[name], 0, c, 1)
                tensors["ssm_out.weight"] = _tiled(tensors["ssm_out.weight"], 1, c, dv)
        if moe:
            gate, up = np.split(state[p + "mlp.experts.gate_up_proj"], 2, axis=1)
            tensors |= {
                "ffn_gate_inp.weight": state[p + "mlp.gate.weight"],
                "ffn_gate_exps.weight": gate,
                "ffn_up_exps.weight": up,
                "ffn_down_exps.weight": state[p + "mlp.experts.down_proj"],
                "ffn_gate_inp_shexp.weight": state[p + "mlp.shared_expert_gate.weight"].reshape(-1),
            }
            for proj in ("gate", "up", "down"):
                tensors[f"ffn_{proj}_shexp.weight"] = state[
                    f"{p}mlp.shared_expert.{proj}_proj.weight"
                ]
        else:
            for proj in ("gate", "up", "down"):
                tensors[f"ffn_{proj}.weight"] = state[f"{p}mlp.{proj}_proj.weight"]
        for name, t in tensors.items():
            t = np.ascontiguousarray(t, dtype=np.float32)
            q8 = gguf.GGMLQuantizationType.Q8_0
            if blocks and t.ndim == 2 and "norm" not in name and t.shape[-1] % 32 == 0:
                writer.add_tensor(blk + name, gguf.quants.quantize(t, q8), raw_dtype=q8)
            else:
                writer.add_tensor(blk + name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_logits_equal_transformers_on_every_node_count(hybrid):
    model, folder, prompt = hybrid
    expected, continuation = _reference(model, prompt)
    source = open_model(folder)
    config = source.config
    assert config.linear_layers == (0, 1, 2) and config.attention_gate
    for n in NODES:
        engine = Engine.local(source, (1.0,) * n)
        assert sum(s.n_linear for s in engine.slices) == config.linear_v_heads
        # The C blocks run its gated DeltaNet layers (rows.c's rows_linear) and its gated
        # attention layer (rows_attention) a block at a call: the FFN decodes on NumPy.
        natives = [ex.native for ex in engine.executors]
        assert all(b is not None and b.linear is not None and not b.whole for b in natives)
        assert all(b is not None and list(b.attention_args) == [3] for b in natives)
        ours = _ours(engine, prompt, continuation)
        _assert_close_logits(ours, expected, f"{folder.name} {n} node(s)")


def test_a_model_of_gated_deltanet_layers_alone_decodes_them_in_c(hybrid):
    """A Qwen3.5 of fewer layers than its attention interval (`edgetp synth --layers 3`) has no
    attention layer: its DeltaNet layers still decode in C, and each step's logits are the same
    as the torch path's."""
    _, folder, prompt = hybrid
    source = open_model(folder)
    source.config = replace(source.config, n_layers=3)
    assert all(source.config.is_linear(i) for i in range(3))
    engine = Engine.local(source, (1.0, 1.0))
    assert all(ex.native is not None and not ex.native.attention_args for ex in engine.executors)
    reference = Engine.local(source, (1.0, 1.0))
    for ex in reference.executors:  # NumPy's and torch's paths for every block
        ex.backends = [b for b in ex.backends if b is not ex.native]
        ex.native = None
    for e in (engine, reference):
        e.forward([prompt], StepBatch((0,), (0,), (len(prompt),)))
    for step in range(3):
        batch = StepBatch((0,), (len(prompt) + step,), (1,))
        ours, theirs = (e.forward([[7 + step]], batch)[0] for e in (engine, reference))
        _assert_close_logits(ours, theirs, f"3 DeltaNet layers, decode step {step}")


def test_gguf_logits_equal_transformers_on_every_node_count(hybrid):
    """The same model from its GGUF file, under llama.cpp's names and orders."""
    model, folder, prompt = hybrid
    expected, continuation = _reference(model, prompt)
    source = open_model(folder / "model.gguf")
    hf = open_model(folder).config
    assert replace(source.config, architecture=hf.architecture, norm_eps=hf.norm_eps) == hf
    for n in NODES:
        ours = _ours(Engine.local(source, (1.0,) * n), prompt, continuation)
        _assert_close_logits(ours, expected, f"{folder.name} gguf {n} node(s)")


def test_greedy_32_tokens_equal_transformers_generate_on_every_node_count(hybrid):
    model, folder, prompt = hybrid
    expected = _generated(model, prompt)
    source = open_model(folder)
    for n in NODES:
        assert _greedy(Engine.local(source, (1.0,) * n), prompt, 32) == expected, f"{n} node(s)"


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["split", "master"])
def test_real_nodes_equal_transformers(qwen35, attention):
    """3 processes, each streaming its slice from f32 shards: the slices' value heads cross
    the wire in the plan, the states stay on the nodes; or the master holds every head of
    both kinds of layer and its state (`attention` master)."""
    model, folder, prompt = qwen35
    expected, continuation = _reference(model, prompt)
    ours = _windowed(open_model(folder), 3, "f32", prompt, continuation, 128, attention)
    _assert_close_logits(ours, expected, f"qwen3_5 3 real nodes, attention {attention}")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["q8_0", "q4_1"])
def test_block_shards_split_across_real_nodes_equal_one_node(tmp_path_factory, dtype):
    """The DeltaNet's fused in-projections and out-projection survive a block dtype's shards:
    on 3 real nodes what 1 gives on the same quantized weights (value and key heads of 32
    columns, a whole block each, as a real model's 128)."""
    import transformers

    heads = {"linear_key_head_dim": 32, "linear_value_head_dim": 32}
    wide = SMALL | heads | {"intermediate_size": 128}
    config = transformers.Qwen3_5TextConfig(vocab_size=320, **wide)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=5)
    folder = tmp_path_factory.mktemp("qwen3_5-wide")
    model.save_pretrained(folder)
    prompt, continuation = list(range(7, 47)), list(range(50, 58))
    source = open_model(folder)
    one = _windowed(source, 1, dtype, prompt, continuation, 128)
    three = _windowed(source, 3, dtype, prompt, continuation, 128)
    _assert_close_logits(three, one, f"qwen3_5 {dtype}, 3 real nodes against 1")


def _prefill(engine: Engine, tokens: list[int], slot: int = 0, start: int = 0) -> torch.Tensor:
    """The logits at every one of `tokens`, fed at `start` in `slot`."""
    batch = StepBatch((slot,), (start,), (len(tokens),))
    return engine.forward([tokens], batch, all_logits=True)[0]


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_a_step_after_rejected_drafts_answers_as_if_they_were_never_fed(qwen35, accepted):
    """A speculative step feeds the last token and 4 drafts; the next starts after the
    `accepted` of them that were kept: every node takes its state back to before that step
    and steps it over the kept ones. Its logits are a fresh sequence's, at 1 and 3 nodes."""
    _, folder, prompt = qwen35
    source = open_model(folder)
    fed = [7, 8, 9, 10, 11]  # the last token, then the drafts
    then = [12, 13]
    want = _prefill(Engine.local(source), prompt + fed[: 1 + accepted] + then)[-len(then) :]
    for n in (1, 3):
        engine = Engine.local(source, (1.0,) * n)
        _prefill(engine, prompt)
        _prefill(engine, fed, start=len(prompt))
        got = _prefill(engine, then, start=len(prompt) + 1 + accepted)
        _assert_close_logits(got, want, f"{accepted} drafts kept, {n} node(s)")


def test_decode_steps_of_several_sequences_and_after_drafts_run_their_deltanet_in_c(qwen35):
    """A decode step (a token a sequence) runs the gated DeltaNet layers in C (rows.c's
    rows_linear): three sequences in one step, each in its own slot, each answer as its whole
    text prefilled fresh (torch's chunked form); and a one-token step after a speculative step
    whose drafts were rejected starts from the state before them, at 1 and 3 nodes."""
    _, folder, prompt = qwen35
    source = open_model(folder)
    texts = [prompt[:20], prompt[3:30], prompt[7:25]]
    then = [[12, 13, 14, 15], [20, 21, 22, 23], [30, 31, 32, 33]]
    for n in (1, 3):
        engine = Engine.local(source, (1.0,) * n, slots=3)
        assert all(ex.native is not None and ex.native.linear for ex in engine.executors)
        for slot, text in enumerate(texts):
            _prefill(engine, text, slot=slot)
        for i in range(len(then[0])):
            starts = tuple(len(t) + i for t in texts)
            got = engine.forward([[t[i]] for t in then], StepBatch((0, 1, 2), starts, (1, 1, 1)))
            for slot, text in enumerate(texts):
                fresh = _prefill(Engine.local(source), text + then[slot][: i + 1])[-1:]
                _assert_close_logits(got[slot : slot + 1], fresh, f"slot {slot} step {i}, {n}")
        fed = [7, 8, 9, 10, 11]  # the last token, then 4 drafts: 1 kept
        _prefill(engine, prompt, slot=1)
        _prefill(engine, fed, slot=1, start=len(prompt))
        got = engine.forward([[12]], StepBatch((1,), (len(prompt) + 2,), (1,)))
        fresh = _prefill(Engine.local(source), prompt + fed[:2] + [12])[-1:]
        _assert_close_logits(got, fresh, f"a token after rejected drafts, {n} node(s)")


def test_tiled_value_heads_of_a_block_file_are_put_back_in_order_as_whole_blocks(tmp_path):
    """llama.cpp's converter stores a qwen35's value heads tiled (`models.source._tiled_order`).
    Put back in order as whole blocks (rows, and the out-projection's columns where a head is
    whole blocks), a Q8_0 file's DeltaNet matrices stay Q8_0 in the split, where they were read
    as float32 (four times the bytes a token). Every row range reads as the float rows do, and
    the model's logits are its float expansion's."""
    import transformers

    values = SMALL | {"intermediate_size": 128, "linear_value_head_dim": 32}
    config = transformers.Qwen3_5TextConfig(vocab_size=320, **values)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=3)
    _write_gguf(model.eval(), "qwen35", tmp_path / "q8.gguf", blocks=True)
    source = open_model(tmp_path / "q8.gguf")
    assert source.config.linear_group > 1  # the tiled order is not the grouped one
    q8 = FORMATS["q8_0"]
    for i in source.config.linear_layers:
        assert source.matrix_dtypes(i, "auto") == dict.fromkeys(MATRICES, "q8_0")
        for name in ("ssm_qkv", "ssm_z", "ssm_b", "ssm_a", "ssm_out"):
            rows = source.shape(i, name)[0]
            for start, stop in ((0, rows), (1, rows // 2), (rows // 3, rows)):
                floats = source.rows(i, name, start, stop)
                assert torch.equal(q8.dequantize(source.rows(i, name, start, stop, True)), floats)
    prompt, continuation = list(range(7, 27)), list(range(50, 54))
    blocks = _windowed(source, 1, "auto", prompt, continuation, 64)
    floats = _windowed(source, 1, "f32", prompt, continuation, 64)
    _assert_close_logits(blocks, floats, "a Q8_0 qwen35 file against its float expansion")


def test_a_slot_used_again_starts_from_a_zero_state(qwen35):
    """A new sequence in a slot another used (position 0) answers as in a fresh engine; and
    two sequences side by side in one step each as alone."""
    _, folder, prompt = qwen35
    source = open_model(folder)
    fresh = _prefill(Engine.local(source, (1.0, 1.0)), prompt[5:])
    engine = Engine.local(source, (1.0, 1.0), slots=2)
    _prefill(engine, prompt)
    _assert_close_logits(_prefill(engine, prompt[5:]), fresh, "a used slot, from 0")
    a, b = prompt[:30], prompt[5:]
    both = engine.forward([a, b], StepBatch((1, 0), (0, 0), (len(a), len(b))), all_logits=True)
    _assert_close_logits(both[1, : len(b)], fresh, "beside another sequence")


def test_a_kept_sequence_is_carried_on_from_its_end_or_its_prompts(qwen35):
    """Prompt reuse: a slot's state is known after its last token and at the end of its
    prompt, so a request reuses the longer of the two that its tokens carry on from, and
    answers as a fresh prefill; one that shares a shorter prefix reuses none. A step that
    starts where no state is known is refused."""
    _, folder, prompt = qwen35
    source = open_model(folder)
    kept, more = prompt[:30], prompt[30:]
    assert reusable(kept, kept + more, None, [30]) == len(kept)
    assert reusable(kept, kept[:20] + more, None, [30]) == 0
    assert reusable(kept, kept[:20] + more, None, [30, 18]) == 18  # a prompt's end, known
    assert reusable(kept, kept[:20] + more, None) == 20  # attention alone could reuse 20
    engine = Engine.local(source, (1.0, 1.0), slots=2)
    pool = SlotPool(2)
    pool.bind(engine)
    fresh = Engine.local(source)

    def answer(tokens: list[int], expected_start: int) -> torch.Tensor:
        taken = pool.take(tokens)
        assert (taken.slot, taken.start) == (0, expected_start)
        got = _prefill(engine, tokens[taken.start :], 0, taken.start)
        _assert_close_logits(got, _prefill(fresh, tokens)[taken.start :], f"from {taken.start}")
        return got

    answer(prompt[:24], 0)  # a prompt, then its answer a token a step
    for at in range(24, 30):
        _prefill(engine, [prompt[at]], 0, at)
    pool.give_back(0, kept)
    assert pool.take(prompt[:10] + more).slot == 1  # too short a prefix: the other slot
    answer(kept + more, len(kept))  # carries on from the end
    pool.give_back(0, kept + more)
    answer(prompt[:24] + [5] * 10, 24)  # another answer to the same prompt: from its end
    with pytest.raises(ModelError, match=r"state is at position 34, not at 20 .* position 0"):
        _prefill(engine, more, 0, 20)


def test_the_state_is_counted_beside_the_kv_cache(qwen35, tmp_path):
    """Each node's state is its value heads' share, fixed whatever the context, counted in
    what the budget takes as fixed, under its name; the DeltaNet layers hold no KV per
    token."""
    _, folder, _ = qwen35
    source = open_model(folder)
    config = source.config
    engine = Engine.local(source, (1.0, 1.0))
    for ex in engine.executors:
        s, states = ex.slice, ex.cache.linear
        assert states is not None
        held = sum(t.nbytes for kind in (states.states, states.conv) for t in kind.values())
        assert held == ex.cache.slots * 3 * 4 * (2 * 16 * 16 + (2 * 16 + 2 * 16) * 3)
        per_slot = KVCache.window_bytes(config, s)
        assert per_slot >= 3 * held  # the state, one kept to undo a step, one at a prompt end
        assert KVCache.bytes_per_token(config, s) == 2 * 1 * s.n_kv * 32 * 4  # the full layer
        assert all(ex.cache.keys[i].shape[2] == 0 for i in config.linear_layers)
    tiny = MemoryOptions(budget=50_000)
    with pytest.raises(ModelError) as err, Session(source, memory=tiny, state_dir=tmp_path) as one:
        one.start()
    assert "the gated DeltaNet layers' state" in str(err.value), err.value
    assert "KV rings" not in str(err.value)  # it has no local layers


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    """A Qwen3.5 HF folder with SmolLM2's vocabulary, tokenizer and chat template, writing
    only the words of test_speculate's paragraph, mostly the word after the last one in a
    cycle of CYCLE of them: it repeats itself, so that prompt-lookup drafts are sometimes kept
    and sometimes rejected (random layers alone never repeat: none would be kept)."""
    import transformers

    tokenizer = open_model(DEFAULT_MODEL).tokenizer()
    config = transformers.Qwen3_5TextConfig(
        **SMALL | {"intermediate_size": 128, "max_position_embeddings": 1024},
        vocab_size=tokenizer.vocab_size,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=7)
    words = sorted(set(tokenizer.encode(PARAGRAPH)))
    with torch.no_grad():  # each word's row of the head reads the word before it in a cycle
        head, embedding = model.lm_head.weight, model.model.embed_tokens.weight
        head.zero_()
        for i, word in enumerate(words):
            head[words[(i + 1) % CYCLE if i < CYCLE else i % CYCLE]] += 3 * embedding[word]
        for name, p in model.named_parameters():  # the layers' outputs weaker than that
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                p.mul_(0.3)
    folder = tmp_path_factory.mktemp("qwen3_5-chat")
    model.save_pretrained(folder)
    write_tokenizer(folder, tokenizer)
    return folder


@pytest.mark.slow
@master_threads(3)
def test_prompt_lookup_drafts_change_no_greedy_token_on_three_nodes(chat_folder, shared_state):
    """A rejected draft is taken back out of every node's DeltaNet state, too."""
    assert_lookup_drafts_change_no_token(chat_folder, shared_state)


@pytest.mark.slow
def test_a_conversation_on_three_nodes_reuses_each_earlier_prompt(
    chat_folder,
    steps,  # noqa: F811 (the fixture)
    tmp_path,
    capsys,
):
    """A conversation through the generation loop on 3 real nodes, the whole of it sent each
    turn: with prompt reuse each later turn starts after at least the earlier turn's prompt
    (where every node kept the state), and every answer is the one without reuse. What a
    sequence costs each node, as /v1/cluster and the bench show it, is its slice's state and
    KV per token, in the slots and context it was given."""
    source = open_model(chat_folder)
    tokenizer = source.tokenizer()
    with local_session(source, 3, context=1024, slots=2, state_dir=tmp_path) as session:
        off = converse(session, tokenizer, steps, False, QUESTIONS[:3])
        on = converse(session, tokenizer, steps, True, QUESTIONS[:3])
        _check_sequence_figures(session, capsys)
    assert [t.text for t in on] == [t.text for t in off]
    assert all(t.reused == 0 and t.start == 0 for t in off)
    for k in range(1, len(on)):
        t = on[k]
        print(f"turn {k + 1}: {t.prompt} prompt tokens, {t.reused} reused")
        assert t.start == t.reused >= on[k - 1].prompt and t.prefilled == t.prompt - t.reused


def _check_sequence_figures(session: Session, capsys) -> None:
    """Each node's state per sequence and KV per token, as it reported them with its step
    figures, in /v1/cluster's nodes and the bench's per-node table: what KVCache counts for
    its slice."""
    engine = session.engine
    assert engine is not None and engine.remote is not None
    members = list(engine.remote.members)
    slices = [engine.slices[0], *(Slice.from_dict(m.slice) for m in members)]
    rows = [node_row("master", engine.history), *(node_row(m.name, m.history) for m in members)]
    stats = BatcherStats(2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    view = ClusterFigures.model_validate(cluster_figures(session, "qwen3_5", stats))
    capsys.readouterr()
    print_nodes({"nodes": 3, "per_node": rows})
    table = capsys.readouterr().out.splitlines()
    assert " ".join(table[1].split()).endswith("state MB/seq KV KB/token slots x ctx"), table
    for s, row, node, line in zip(slices, rows, view.nodes, table[2:], strict=True):
        state = KVCache.window_bytes(session.config, s)
        kv = KVCache.bytes_per_token(session.config, s)
        assert state > 0 and kv > 0, s  # DeltaNet heads, and the full layer's KV heads
        assert (node.state_bytes_per_sequence, node.kv_bytes_per_token) == (state, kv), node
        assert (node.slots, node.context) == (2, session.max_context), node
        shown = (row["state_mb_per_sequence"], row["kv_kb_per_token"], row["slots"], row["context"])
        assert shown == (round(state / 1e6, 2), round(kv / 1e3, 1), 2, session.max_context), row
        assert line.split()[-5:] == [str(shown[0]), str(shown[1]), "2", "x", str(shown[3])]


@pytest.mark.slow
def test_a_node_lost_mid_answer_loses_nothing_of_it(chat_folder, shared_state):
    """The bridge on 3 nodes; a worker killed at the stream's 8th chunk of 120: the master
    re-plans on the nodes left and replays the answer so far from position 0, which zeroes
    every slot's state on the new plan's nodes, and the stream ends with the uninterrupted
    answer's text."""
    args = ["--model", str(chat_folder), "--local-nodes", "3", "--context", "512"]
    server = start_server([*args, "--state-dir", str(shared_state)], verbose=True, timeout=240)
    try:
        client = client_of(server)
        whole = client.chat.completions.create(**greedy(client, 120)).choices[0].message.content
        before = generation(server)
        workers = local_workers(server.proc.pid)
        assert sorted(workers) == ["local-1", "local-2"], workers

        def kill_at_the_8th_chunk(n: int) -> None:
            if n == 8:
                os.kill(workers["local-1"], signal.SIGKILL)

        text = streamed(client, 120, kill_at_the_8th_chunk)
        after = generation(server)
    finally:
        server.stop()
    assert after["recovered"] == before["recovered"] + 1, after  # the kill landed mid-answer
    assert whole.strip() and text == whole


def test_the_synthetic_qwen35_shape_writes_every_tensor_its_layers_are_read_by():
    """`edgetp synth --shape qwen3.5-35b-a3b`: a DeltaNet layer's and a full layer's tensors,
    experts and shared expert under the names and shapes `HFSource` reads (a layer is GBs:
    its plan is checked, not written)."""
    from edgetp.master.bench.synth import _shard_plan
    from edgetp.master.bench.synth_models import SHAPES
    from edgetp.models.layers import ROUTER, SHARED_ROUTER, full_layer_shapes, layer_tensor_names
    from edgetp.models.source import hf_layer_name

    shape = SHAPES["qwen3.5-35b-a3b"]
    config = config_from_hf(shape, "qwen3.5-35b-a3b")
    assert len(config.linear_layers) == 30 and config.n_experts == 256 and config.n_shared == 1
    written = {t.name: t.shape for specs in _shard_plan(shape, 4).values() for t in specs}
    for layer in (0, 3):  # a DeltaNet layer, a full one
        shapes = full_layer_shapes(config, layer)
        shapes[SHARED_ROUTER], shapes["ssm_conv"] = (1, config.hidden), (8192, 1, 4)
        for tensor in (*layer_tensor_names(config, layer), ROUTER, SHARED_ROUTER):
            name = hf_layer_name(layer, tensor, config.architecture)
            assert written.pop(name) == shapes[tensor], name
    assert {n for n in written if n.startswith(("model.layers.0.", "model.layers.3."))} == set()


def test_a_small_synthetic_qwen35_runs_on_three_nodes(tmp_path, monkeypatch):
    """The shape's writer end to end on a narrow copy of it: a folder that reads and runs."""
    from edgetp.master.bench import synth_models
    from edgetp.master.bench.synth import write_synthetic_model

    narrow = SMALL | EXPERTS | {"num_experts": 4, "num_hidden_layers": 40}
    shape = synth_models.SHAPES["qwen3.5-35b-a3b"] | narrow
    monkeypatch.setitem(synth_models.SHAPES, "qwen3.5-35b-a3b", shape)
    source = open_model(write_synthetic_model("qwen3.5-35b-a3b", 4, tmp_path / "q35", seed=1))
    assert source.config.linear_layers == (0, 1, 2) and source.config.n_shared == 1
    tokens = source.tokenizer().encode("Why is the sky blue?")
    one = Engine.local(source).forward([tokens], StepBatch((0,), (0,), (len(tokens),)))
    three = Engine.local(source, (1.0, 1.0, 1.0))
    _assert_close_logits(three.forward([tokens], StepBatch((0,), (0,), (len(tokens),))), one,
                         "a synthetic Qwen3.5-MoE, 3 nodes against 1")  # fmt: skip
    assert torch.isfinite(one).all()


@pytest.mark.slow  # runs the model end to end: not for `make test-fast`
def test_a_published_vision_language_folder_is_read_as_its_text_model(tmp_path):
    """Qwen3.5 is published as Qwen3_5ForConditionalGeneration: its text_config and its
    tensors under model.language_model. are read; text alone, its logits are the whole
    model's at 1 and 3 nodes."""
    import transformers

    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": 64}  # fmt: skip
    text = SMALL | {"intermediate_size": 128, "vocab_size": 320}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    model = transformers.Qwen3_5ForConditionalGeneration(config).float().eval()
    _randomize(model, seed=3)
    model.save_pretrained(tmp_path)
    prompt = list(range(3, 60, 2))
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0]
    source = open_model(tmp_path)
    assert source.config.architecture == "Qwen3_5ForCausalLM"
    for n in (1, 3):
        ours = _prefill(Engine.local(source, (1.0,) * n), prompt)
        _assert_close_logits(ours, expected, f"vision-language folder, {n} node(s)")
