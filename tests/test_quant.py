"""GGUF's block formats as shard dtypes: the file's own blocks survive a split byte for byte, and
a block matrix multiplies and embeds as the float values it stands for."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from models.gguf_file import GGUFFile
from models.kernels import dtype_name, embed, linear_rows, quantize
from models.quant import FORMATS, block_format, matrix_size

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
        raw = f.stored(name)
        blocks = torch.from_numpy(raw).view(raw.shape[0], -1, FORMATS[fmt].block_bytes)
        stored = quantize(f.tensor(name), fmt)[""]
        assert torch.equal(stored, blocks), name
        seen[fmt] += 1
    assert seen == {"q4_1": 210, "q8_0": 1}, seen


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_block_matrix_multiplies_and_embeds_as_its_float_values(fmt):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen)
    stored = quantize(w, fmt)[""]
    assert stored.dtype == torch.uint8 and block_format(stored).name == dtype_name(stored) == fmt
    assert matrix_size(stored) == (96, 128)
    values = FORMATS[fmt].dequantize(stored)
    # The format's own rounding: at most half a step of a block's range.
    assert (values - w).abs().max() <= (w.abs().max() / (7 if fmt != "q8_0" else 127)).item()
    x = torch.randn(3, 128, generator=gen).numpy()
    want = x.astype(np.float64) @ values.double().numpy().T
    np.testing.assert_allclose(linear_rows(x, stored), want, rtol=1e-4, atol=1e-4)
    ids = torch.tensor([[5, 0, 95]])
    assert torch.equal(embed(ids, stored), values[ids])


def test_a_width_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="q4_1 needs rows of a multiple of 32, got 40"):
        quantize(torch.zeros(4, 40), "q4_1")
