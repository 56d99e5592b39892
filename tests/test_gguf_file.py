"""The GGUF reader against files written by the gguf package's own writer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from edgetp.models.errors import ModelError
from edgetp.models.gguf_file import GGUFFile

METADATA = {
    "general.name": "tiny",
    "tiny.block_count": 3,
    "tiny.rope.freq_base": 10000.5,
    "tiny.use_parallel_residual": True,
    "tokenizer.ggml.tokens": ["<s>", "hello", "wörld", ""],
    "tokenizer.ggml.token_type": [3, 1, 1, 1],
    "tokenizer.ggml.scores": [0.0, -1.5, -2.25, -3.0],  # exact in float32
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    rng = np.random.default_rng(0)
    plain = rng.standard_normal((6, 64)).astype(np.float32)
    quantized = rng.standard_normal((5, 64)).astype(np.float32)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "tiny")
    for key, value in METADATA.items():
        if key != "general.architecture":
            writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    writer.add_tensor("plain.weight", plain)
    q8 = gguf.quants.quantize(quantized, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, plain, gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)


def test_metadata_and_tensors_read_back(written):
    path, plain, q8 = written
    f = GGUFFile(path)
    assert f.metadata["general.architecture"] == "tiny"
    for key, value in METADATA.items():
        got = f.metadata[key]
        assert got == (pytest.approx(value) if isinstance(value, float) else value)
        assert type(got) is type(value)
    assert f.tensor_names() == ["plain.weight", "q8.weight"]
    assert np.array_equal(f.tensor("plain.weight").numpy(), plain)
    assert np.array_equal(f.tensor("q8.weight").numpy(), q8.reshape(5, 64))
    with pytest.raises(ModelError, match="no tensor named"):
        f.tensor("missing.weight")


def test_any_cut_is_a_clear_error(written, tmp_path):
    """A file cut anywhere before its last tensor's last byte (the writer pads past it)."""
    path = written[0]
    data = path.read_bytes()
    whole = GGUFFile(path)
    end = max(t.data_offset + t.n_bytes for t in whole._tensors.values())
    for size in [0, 3, 4, 8, 20, *range(24, end, 37), end - 1]:
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ModelError, match="not a GGUF|truncated"):
            GGUFFile(cut)
