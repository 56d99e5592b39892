"""The shard dtypes by name, without torch: the command line lists them before loading it.

Plain dtypes are stored as torch tensors of that dtype (int8 with per-channel scales); block
dtypes are GGUF's quantized blocks (models/quant.py).
"""

PLAIN_DTYPES = ("f32", "f16", "bf16", "int8")
BLOCK_DTYPES = ("q8_0", "q4_1", "q4_0")
SHARD_DTYPES = (*PLAIN_DTYPES, *BLOCK_DTYPES)


def embedding_dtype(dtype: str) -> str:
    """How the embedding and lm_head are stored when the layers are `dtype`: a 4-bit model keeps
    them at 8 bits, as llama.cpp's files do (SmolLM2's Q4_1 file has a Q8_0 embedding). The
    lm_head's rounding moves the top token more than any layer's does."""
    return "q8_0" if dtype in ("q4_0", "q4_1") else dtype
