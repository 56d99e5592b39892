"""The shard dtypes by name, without torch: the command line lists them before loading it.

Plain dtypes are stored as torch tensors of that dtype (int8 with per-channel scales); block
dtypes are GGUF's quantized blocks (models/quant.py). `auto` keeps each matrix as the source
stores it: a block format the engine multiplies is carried over byte for byte, any other is
stored in the nearest shard dtype (`nearest_dtype`).
"""

PLAIN_DTYPES = ("f32", "f16", "bf16", "int8")
BLOCK_DTYPES = ("q8_0", "q4_1", "q4_0")
SHARD_DTYPES = (*PLAIN_DTYPES, *BLOCK_DTYPES)
AUTO = "auto"
DTYPE_CHOICES = (AUTO, *SHARD_DTYPES)

# What a source's stored type (GGUF's type names; safetensors' F32, F16, BF16) becomes under
# `auto`: itself where the engine multiplies it, else the nearest format that loses nothing more
# than the source did (llama.cpp's K-quants carry a scale and a minimum per 32 weights in 4.5 to
# 6.6 bits: 2-4 bits become q4_1, 5 and 6 bits q8_0).
_NEAREST = {
    "F32": "f32", "F16": "f16", "BF16": "bf16",
    "Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1",
    "Q5_0": "q8_0", "Q5_1": "q8_0", "Q6_K": "q8_0", "Q5_K": "q8_0",
    "Q4_K": "q4_1", "Q3_K": "q4_1", "Q2_K": "q4_1",
}  # fmt: skip
SOURCE_TYPES = tuple(_NEAREST)
# Widest first: a fused matrix (q, k and v; gate and up) takes the widest of its parts' dtypes.
_WIDEST_FIRST = ("f32", "bf16", "f16", "q8_0", "int8", "q4_1", "q4_0")


def nearest_dtype(stored_type: str) -> str:
    """The shard dtype `auto` stores a source tensor of this type in."""
    if stored_type not in _NEAREST:
        raise ValueError(
            f"{stored_type} is none of the types edgetp reads: {', '.join(SOURCE_TYPES)}"
        )
    return _NEAREST[stored_type]


def matrix_dtype(requested: str, stored_types: list[str]) -> str:
    """The shard dtype of a matrix fused from source tensors of these stored types."""
    if requested != AUTO:
        return requested
    found = {nearest_dtype(t) for t in stored_types}
    if {"f16", "bf16"} <= found:  # neither holds the other: keep both exactly
        return "f32"
    return min(found, key=_WIDEST_FIRST.index)


def embedding_dtype(dtype: str, stored_type: str = "F32") -> str:
    """How the embedding and lm_head are stored when the layers are `dtype`: a 4-bit model keeps
    them at 8 bits, as llama.cpp's files do (SmolLM2's Q4_1 file has a Q8_0 embedding). The
    lm_head's rounding moves the top token more than any layer's does. Under `auto`, as the
    source stores it."""
    if dtype == AUTO:
        return nearest_dtype(stored_type)
    return "q8_0" if dtype in ("q4_0", "q4_1") else dtype
