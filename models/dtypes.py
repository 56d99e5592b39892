"""The shard dtypes by name, without torch: the command line lists them before loading it.

Plain dtypes are stored as torch tensors of that dtype (int8 with per-channel scales); block
dtypes are GGUF's quantized blocks (models/quant.py). `auto` keeps each matrix as the source
stores it, byte for byte, so a split of a file answers as the file's own model does.
"""

PLAIN_DTYPES = ("f32", "f16", "bf16", "int8")
# GGUF's block types (models/quant.py), widest first; float weights can be stored in each.
BLOCK_DTYPES = (
    "q8_0", "q6_k", "q5_1", "q5_0", "q5_k", "q4_1", "q4_k", "iq4_nl", "iq4_xs", "q4_0", "mxfp4",
    "q3_k", "q2_k",
)  # fmt: skip
SHARD_DTYPES = (*PLAIN_DTYPES, *BLOCK_DTYPES)
AUTO = "auto"
# What `--dtype` offers: `auto`, and every dtype any source's weights can be stored in.
DTYPE_CHOICES = (AUTO, *SHARD_DTYPES)

# What a source's stored type (GGUF's type names; safetensors' F32, F16, BF16) becomes under
# `auto`: itself, byte for byte.
_NEAREST = {
    "F32": "f32", "F16": "f16", "BF16": "bf16",
    **{name.upper(): name for name in BLOCK_DTYPES},
}  # fmt: skip
SOURCE_TYPES = tuple(_NEAREST)
# Widest first: a fused matrix (q, k and v; gate and up) whose parts are stored in several
# dtypes takes one that holds each part's values exactly, else f32.
_WIDEST_FIRST = ("f32", "bf16", "f16", "int8", *BLOCK_DTYPES)
# Block formats one converts into another exactly (models.quant.widen): the same scale, the
# integers widened (q4_0's w = d (q - 8), q5_0's w = d (q - 16) and iq4_nl's w = d table[q],
# the table's entries int8, are q8_0's w = d q'). Gemma 3's files store q and k in Q5_0 and some
# layers' v in Q8_0: their fused matrix keeps all three.
EXACT_WIDENING = {("q4_0", "q8_0"), ("q5_0", "q8_0"), ("iq4_nl", "q8_0")}


def nearest_dtype(stored_type: str) -> str:
    """The shard dtype `auto` stores a source tensor of this type in."""
    if stored_type not in _NEAREST:
        raise ValueError(
            f"{stored_type} is none of the types edgetp reads: {', '.join(SOURCE_TYPES)}"
        )
    return _NEAREST[stored_type]


# llama.cpp's stand-ins for a format of blocks of 256 where a matrix's rows are not whole blocks
# of it (`llama_tensor_get_type`: SmolLM2's 576-wide rows, say): blocks of 32, as many bits or more
STAND_INS = {"q2_k": "iq4_nl", "q3_k": "iq4_nl", "iq4_xs": "iq4_nl", "q4_k": "q5_0",
             "q5_k": "q5_1", "q6_k": "q8_0"}  # fmt: skip
SUPER_BLOCK = 256


def fitting_dtype(dtype: str, columns: int) -> str:
    """`dtype`, or its stand-in (`STAND_INS`) where rows of `columns` weights are not whole
    blocks of it."""
    if dtype in STAND_INS and columns % SUPER_BLOCK:
        return STAND_INS[dtype]
    return dtype


def matrix_dtype(requested: str, stored_types: list[str]) -> str:
    """The shard dtype of a matrix fused from source tensors of these stored types."""
    if requested != AUTO:
        return requested
    return common_dtype({nearest_dtype(t) for t in stored_types})


def common_dtype(dtypes: set[str]) -> str:
    """The one shard dtype that holds matrices of all these dtypes exactly: theirs when they
    agree, the widest where the others widen into it exactly, else f32."""
    if len(dtypes) == 1:
        return next(iter(dtypes))
    widest = min(dtypes, key=_WIDEST_FIRST.index)
    if all(d == widest or (d, widest) in EXACT_WIDENING for d in dtypes):
        return widest
    return "f32"


def embedding_dtype(dtype: str, stored_type: str = "F32") -> str:
    """How the embedding and lm_head are stored when the layers are `dtype`: a 4- or 5-bit model
    keeps them at 8 bits (6 for the K-quants), as llama.cpp's files do (SmolLM2's Q4_1 file has
    a Q8_0 embedding). The lm_head's rounding moves the top token more than any layer's does.
    Under `auto`, as the source stores it."""
    if dtype == AUTO:
        return nearest_dtype(stored_type)
    if dtype in ("q2_k", "q3_k", "q4_k", "q5_k", "iq4_xs"):  # as llama.cpp's files of these
        return "q6_k"  # types (Q4_K_M, Q3_K_M, ...) keep their output
    return "q8_0" if dtype in ("q4_0", "q4_1", "q5_0", "q5_1", "mxfp4", "iq4_nl") else dtype
