"""Gemma 4 (text) split across nodes answers as transformers' Gemma4ForCausalLM does.

Two small random-weight models. A dense one with every feature of the family's dense text layer:
local layers of a window the prompt outgrows and global ones with proportional RoPE, heads twice
as wide and one KV head whose values are its keys (K = V), the last two layers sharing the KV of
earlier ones with FFNs twice as wide, per-layer input embeddings, layer scales and soft-capped
logits. And a mixture (26B-A4B's layer): a dense MLP beside experts routed by a scaled router.
Each saved as an HF folder and as a GGUF file under llama.cpp's names and keys (as the `gguf`
package gives them): its logits at every position of a prefill and its decode steps at 1 to 4
nodes in this process and on 3 real node processes, its greedy continuation against
`generate`, and with lookup drafts. Then what a sharing layer holds, what is refused, and
`synth`'s Gemma 4 E2B.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from test_families import (
    _assert_close_logits,
    _generated,
    _greedy,
    _ours,
    _randomize,
    _reference,
    _windowed,
)

from edgetp.master.cluster.engine import Engine
from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import SamplingParams
from edgetp.models.config_files import config_from_hf
from edgetp.models.errors import ModelError
from edgetp.models.gemma4 import kv_source
from edgetp.models.layers import Slice
from edgetp.models.source import open_model
from edgetp.node.kvcache import KVCache

pytestmark = pytest.mark.slow

PROMPT_LENGTH = 40
NODES = (1, 2, 3, 4)
CONTEXT = 128
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # fewer than the nodes: KV heads replicated at 3 and 4
    "head_dim": 32,
    "global_head_dim": 64,  # the global layers' heads twice as wide, and one KV head (K = V)
    "num_global_key_value_heads": 1,
    "vocab_size": 320,
    "vocab_size_per_layer_input": 320,
    "hidden_size_per_layer_input": 16,
    "max_position_embeddings": 256,
    "sliding_window": 16,  # the 40-token prompt outgrows it
    "layer_types": LAYER_TYPES,
    "num_kv_shared_layers": 2,  # layer 4 reads layer 3's KV (local), layer 5 layer 2's (global)
    "attention_k_eq_v": True,
    "use_double_wide_mlp": True,  # the sharing layers' FFNs twice as wide
    "final_logit_softcapping": 30.0,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1e6,
        },
    },
}


# The mixture (26B-A4B's layer): beside a dense MLP, 8 experts of 64 columns (2 blocks of 32:
# 4 nodes hold a slice of each), 2 a token, routed by its scaled router; 3 layers, no sharing.
SMALL_MOE = {
    **{k: v for k, v in SMALL.items() if k not in ("num_kv_shared_layers", "use_double_wide_mlp")},
    "num_hidden_layers": 3,
    "layer_types": LAYER_TYPES[:3],
    "intermediate_size": 96,
    "enable_moe_block": True,
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 64,
}
MODELS = {"dense": SMALL, "moe": SMALL_MOE}
_BUILT: dict[str, tuple] = {}


@pytest.fixture(scope="module", params=sorted(MODELS))
def gemma4(request, tmp_path_factory):
    """(transformers model, its HF folder with model.gguf beside it, a prompt), once each."""
    return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _built("dense", tmp_path_factory)


def _built(name: str, tmp_path_factory) -> tuple:
    import transformers

    if name not in _BUILT:
        config = transformers.Gemma4TextConfig(**MODELS[name])
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.float32
        )
        _randomize(model, seed=4)  # norms, scales and layer scales around 1, not the initial 1
        _round_sharing_queries(model)
        model.eval()
        folder = tmp_path_factory.mktemp(f"gemma4-{name}")
        model.save_pretrained(folder)
        _write_gguf(model, folder / "model.gguf")
        prompt = torch.randint(
            0, config.vocab_size, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(0)
        )
        _BUILT[name] = (model, folder, prompt.tolist())
    return _BUILT[name]


def _round_sharing_queries(model) -> None:
    """The KV-sharing layers' query projections rounded to what Q8_0 holds, which the GGUF
    file stores them as: the HF folder and the file are the same model."""
    c = model.config
    first_shared = c.num_hidden_layers - c.num_kv_shared_layers
    with torch.no_grad():
        for layer in model.model.layers[first_shared:]:
            w = layer.self_attn.q_proj.weight
            blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
            w.copy_(
                torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))
            )


def _write_gguf(model, path) -> None:
    """The model as llama.cpp's converter writes a `gemma4`, f32: its keys, its norms as they
    are (no 1 added, unlike Gemma 3's), proportional RoPE as a `rope_freqs` tensor (1 for the
    pairs that turn, 1e30 for the rest), tensors under the names the gguf package maps."""
    c = model.config
    arch = gguf.MODEL_ARCH.GEMMA4
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    local = [t == "sliding_attention" for t in c.layer_types]
    layers = [c.per_layer_config[i] for i in range(c.num_hidden_layers)]  # their heads differ
    head_dim, global_head_dim = layers[local.index(True)].head_dim, layers[-1].head_dim
    first_shared = c.num_hidden_layers - c.num_kv_shared_layers
    writer.add_block_count(c.num_hidden_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(
        [c.intermediate_size * (1 if i < first_shared else 2) for i in range(len(local))]
    )
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv([layer.num_key_value_heads for layer in layers])
    writer.add_key_length(global_head_dim)
    writer.add_value_length(global_head_dim)
    writer.add_key_length_swa(head_dim)
    writer.add_value_length_swa(head_dim)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_shared_kv_layers(c.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input)
    writer.add_sliding_window_pattern(local)
    writer.add_sliding_window(c.sliding_window)
    rope = c.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(global_head_dim)
    writer.add_rope_dimension_count_swa(head_dim)
    writer.add_final_logit_softcapping(c.final_logit_softcapping)
    writer.add_vocab_size(c.vocab_size)
    if c.enable_moe_block:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.top_k_experts)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    turned = int(global_head_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    factors = [1.0] * turned + [1e30] * (global_head_dim // 2 - turned)
    writer.add_tensor("rope_freqs.weight", torch.tensor(factors).numpy())
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    # the router's scales, which llama.cpp's converter renames itself
    scales = {
        "router.scale": "ffn_gate_inp.scale",
        "router.per_expert_scale": "ffn_down_exps.scale",
    }
    for key, t in model.state_dict().items():
        if key == "lm_head.weight":  # tied: the embedding
            continue
        i, _, rest = key.removeprefix("model.layers.").partition(".")
        if rest in scales:
            name = f"blk.{i}.{scales[rest]}"
        else:
            base = names.get_name(key.removesuffix(".weight"))
            assert base is not None, key
            name = f"{base}.weight"
        values = t.detach().float().contiguous().numpy()
        if name.endswith("attn_q.weight") and int(i) >= first_shared:  # as rounded above
            q8_0 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(values, q8_0), raw_dtype=q8_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_logits_equal_transformers_at_every_position_on_every_node_count(gemma4, source):
    model, folder, prompt = gemma4
    expected, continuation = _reference(model, prompt)
    model_source = open_model(folder if source == "hf" else folder / "model.gguf")
    config = model_source.config
    assert config.k_eq_v and config.ple_dim == 16 and config.global_head_dim == 64
    if source == "gguf" and config.kv_shared:  # no K or V: the queries' Q8_0 for all three
        assert model_source.matrix_dtypes(4, "auto")["wqkv"] == "q8_0"
    if config.moe:
        assert (config.n_experts, config.ffn_hidden, config.dense_ffn) == (8, 64, 96)
    else:
        assert config.kv_shared == 2 and config.wide_ffn and config.global_kv_heads == 1
    for n in NODES:
        engine = Engine.local(model_source, (1.0,) * n, max_context=CONTEXT)
        ours = _ours(engine, prompt, continuation)
        what = f"gemma4 {'moe' if config.moe else 'dense'} {source} {n} node(s)"
        _assert_close_logits(ours, expected, what)


def test_a_batch_of_two_answers_as_each_alone(gemma4):
    """Two sequences of different lengths in one step, then a decode step of both, at 3 nodes:
    each one's logits are those it has alone (a sharing layer reads each sequence's own keys
    from the earlier layer's cache, at its own positions)."""
    from edgetp.models.layers import StepBatch

    _, folder, prompt = gemma4
    source = open_model(folder)
    first, second = prompt, prompt[5:29]
    alone = []
    engine = Engine.local(source, (1.0,) * 3, max_context=CONTEXT, slots=2)
    for ids in (first, second):
        prefill = engine.forward([ids], StepBatch((0,), (0,), (len(ids),)), all_logits=True)
        decode = engine.forward([[7]], StepBatch((0,), (len(ids),), (1,)))
        alone.append((prefill[0, : len(ids)], decode[0]))
    batch = StepBatch((0, 1), (0, 0), (len(first), len(second)))
    prefill = engine.forward([first, second], batch, all_logits=True)
    decode = engine.forward([[7], [7]], StepBatch((0, 1), (len(first), len(second)), (1, 1)))
    for b, ids in enumerate((first, second)):
        _assert_close_logits(prefill[b, : len(ids)], alone[b][0], f"sequence {b}'s prompt")
        _assert_close_logits(decode[b], alone[b][1], f"sequence {b}'s decode step")


def test_greedy_32_tokens_equal_transformers_generate(gemma4):
    model, folder, prompt = gemma4
    expected = _generated(model, prompt)
    source = open_model(folder)
    for n in (1, 3):
        engine = Engine.local(source, (1.0,) * n, max_context=CONTEXT)
        assert _greedy(engine, prompt) == expected, f"{n} node(s)"


def test_greedy_tokens_are_the_same_with_lookup_drafts_and_on_every_node_count(
    dense, smollm2_tokenizer
):
    """A prompt that repeats itself, where lookup drafts: the tokens stay those of one node
    without drafts, at every node count, the local layers' KV rings taking back what rejected
    drafts wrote (node/kvcache.py, RingUndo). (SmolLM2's vocabulary stands in to detokenize:
    the ids are below 320.)"""
    from test_speculate import SlowLinkSpeculator

    _, folder, prompt = dense
    repeating = prompt[:12] * 3
    source = open_model(folder)
    one = _looped(Engine.local(source, max_context=CONTEXT), repeating, smollm2_tokenizer)
    for n in NODES:
        engine = Engine.local(source, (1.0,) * n, max_context=CONTEXT)
        speculator = SlowLinkSpeculator()
        assert _looped(engine, repeating, smollm2_tokenizer, speculator) == one, f"{n} nodes"
        print(f"\n{n} node(s): {speculator.figures()}")
        assert speculator.figures()["drafted"] > 0, f"{n} nodes"
        assert _looped(engine, repeating, smollm2_tokenizer) == one, f"{n} nodes"


def _looped(engine: Engine, prompt: list[int], tokenizer, speculator=None) -> list[int]:
    """32 greedy tokens after `prompt` by the generation loop, with drafts where given."""
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    seqs = start(engine, [prompt], [params])
    for _ in stream(engine, tokenizer, seqs, speculator):
        pass
    return seqs[0].tokens


def test_a_published_multimodal_folder_runs_its_text_model(tmp_path):
    """Gemma 4 as published, a Gemma4ForConditionalGeneration (here with a small vision tower):
    its text model's config under text_config, its tensors under model.language_model, its
    logits on text alone equal to its own, at 1 and 3 nodes."""
    import transformers

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
    config = transformers.Gemma4Config(text_config=SMALL, vision_config=vision, audio_config=None)
    model = transformers.Gemma4ForConditionalGeneration(config).to(torch.float32).eval()
    _randomize(model, seed=5)
    model.save_pretrained(tmp_path)
    prompt = torch.randint(0, 320, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(1))
    expected, continuation = _reference(model, prompt.tolist())
    source = open_model(tmp_path)
    assert source.config.architecture == "Gemma4ForCausalLM"  # read as its text model
    for n in (1, 3):
        engine = Engine.local(source, (1.0,) * n, max_context=CONTEXT)
        ours = _ours(engine, prompt.tolist(), continuation)
        _assert_close_logits(ours, expected, f"gemma4 multimodal folder's text, {n} node(s)")


@pytest.mark.parametrize("attention", ["split", "master"])
def test_real_nodes_streaming_f32_shards_equal_transformers(gemma4, attention):
    """3 real node processes, each streaming its slice a layer at a time: the master's PLE
    tensors, layer scales and a mixture's dense MLP and router scales go through the split's
    globals, the routing crosses the wire, the sharing layers' KV is read from the node's own
    cache of the earlier layer (the master's alone with `attention` master)."""
    model, folder, prompt = gemma4
    expected, continuation = _reference(model, prompt)
    source = open_model(folder)
    ours = _windowed(source, 3, "f32", prompt, continuation, CONTEXT, attention)
    what = "moe" if source.config.moe else "dense"
    _assert_close_logits(ours, expected, f"gemma4 {what} 3 real nodes, attention {attention}")


def test_q8_0_shards_on_real_nodes_equal_one_node_and_keep_the_ple_table_q8_0(dense, tmp_path):
    """Split as q8_0, the table of per-layer inputs is kept like the embedding (its blocks),
    not float32 (E2B's is 2.3 B values), and 3 real nodes give what one does (int8 would not:
    its scales are a slice's columns', which differ by node count)."""
    from edgetp.master.cluster.plan import plan_slices
    from edgetp.memory.shards import ShardStore, tensor_specs
    from edgetp.memory.splitter import split_model
    from edgetp.models.gemma4 import PLE_EMBEDDING

    model, folder, prompt = dense
    _, continuation = _reference(model, prompt)
    source = open_model(folder)
    store = ShardStore(tmp_path)
    manifest = split_model(source, plan_slices(source.config, (1.0,)), store, dtype="q8_0")
    specs = tensor_specs(store.path(manifest.globals))
    assert specs[PLE_EMBEDDING] == specs["embedding"][:1] + ((320, 3, 34),)  # 96 = 3 blocks
    one = _windowed(source, 1, "q8_0", prompt, continuation, CONTEXT)
    three = _windowed(source, 3, "q8_0", prompt, continuation, CONTEXT)
    _assert_close_logits(three, one, "gemma4 q8_0 3 real nodes against 1")


def test_a_layer_that_shares_kv_holds_none(dense):
    """Layers 4 and 5 read layers 3's and 2's KV: they hold no cache, layer 3 (local) keeps
    its whole context for layer 4 instead of a ring of its window, the global layer 2 its one
    KV head of 64, and the sizes the memory budget counts say so."""
    _, folder, _ = dense
    config = open_model(folder).config
    assert [kv_source(config, i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    s = Slice.whole(config)
    cache = KVCache(config, s, slots=1, max_context=CONTEXT)
    assert [tuple(k.shape[1:]) for k in cache.keys] == [
        (2, 16, 32), (2, 16, 32), (1, CONTEXT, 64), (2, CONTEXT, 32), (2, 0, 32), (1, 0, 64)
    ]  # fmt: skip
    local, global_ = 2 * 2 * 32 * 4, 2 * 1 * 64 * 4  # K and V, heads, head size, float32
    assert KVCache.bytes_per_token(config, s) == local + global_  # layers 3 and 2
    assert KVCache.window_bytes(config, s) == 2 * 16 * local  # layers 0 and 1


GEMMA4_HF = {"architectures": ["Gemma4ForCausalLM"], **SMALL, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"enable_moe_block": True}, "num_experts"),
        (
            SMALL_MOE
            | {
                "layer_types": ["full_attention", *LAYER_TYPES[1:3]],
                "num_kv_shared_layers": 1,
                "use_double_wide_mlp": True,
            },
            "double-wide",
        ),
        ({"num_kv_shared_layers": 5}, "share KV"),
        ({"per_layer_config": {"0": {"head_dim": 64}}}, "layers of one kind different heads"),
    ],
    ids=[
        "moe-without-experts",
        "moe-double-wide",
        "sharing-without-source",
        "one-local-layer-of-its-own",
    ],  # fmt: skip
)
def test_what_edgetp_cannot_run_yet_is_refused_with_why(change, named):
    with pytest.raises(ModelError, match=named):
        config_from_hf(GEMMA4_HF | change, "config.json")


@pytest.mark.parametrize("layers", [5, 10, 35])
def test_synth_gemma4_e2b_writes_the_tensors_transformers_holds(layers):
    """`edgetp synth --shape gemma4-e2b`'s plan: every tensor transformers' Gemma4ForCausalLM
    holds for the written config (its kinds of layer and KV sharing cut to `layers`), at its
    shape, and no other (built on the meta device: E2B's embeddings alone are GBs)."""
    import transformers

    from edgetp.master.bench.synth import _layers_of, _shard_plan
    from edgetp.master.bench.synth_models import SHAPES

    config = _layers_of(SHAPES["gemma4-e2b"], layers)
    model = config_from_hf(config, "config.json")
    assert model.global_head_dim == 512 and model.wide_ffn == (layers > 5)
    assert model.kv_shared == {5: 0, 10: 5, 35: 20}[layers]
    values = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(
            transformers.Gemma4TextConfig(**values)
        )
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    del expected["lm_head.weight"]  # tied: the embedding
    written = {t.name: t.shape for specs in _shard_plan(SHAPES["gemma4-e2b"], layers).values()
               for t in specs}  # fmt: skip
    assert written == expected
