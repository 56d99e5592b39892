"""A GGUF file's embedded vocabulary, rebuilt as the tokenizer its authors ran.

A GGUF file carries its tokenizer as metadata (`tokenizer.ggml.*`), not as a tokenizer file:

- a "gpt2" vocabulary (byte-level BPE, e.g. SmolLM2, Llama 3, Qwen2) is rebuilt as a
  `tokenizers` BPE from the file's tokens and merges, with the pre-tokenizer its `pre` names;
- a "llama" vocabulary (sentencepiece, e.g. Llama 2, TinyLlama, Gemma) is rebuilt as a
  sentencepiece model in memory from the file's tokens, scores and token types.

Most of the work of reading a GGUF tokenizer is here, apart from `models.tokenizer`, which only
picks the engine and keeps the special-token rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers

from edgetp.models.errors import ModelError
from edgetp.models.tokenizer_engines import TokenizersEngine, sentencepiece_pb2

# llama.cpp's token types (`tokenizer.ggml.token_type`), the same numbers as sentencepiece's.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# o200k's (gpt-oss' o200k_harmony, llama.cpp's "gpt-4o"): words keep their case runs apart
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> the regexes that cut text into words before byte-level BPE, applied in
# turn as llama.cpp does; they must be the ones the merges were learned with.
#
# "smollm" (and the StarCoder family it comes from) is split like plain GPT-2 here, as
# transformers' GGUF loader does; llama.cpp isolates numeric characters first
# (`(r"\p{N}", _GPT2_SPLIT)`), as the model's own tokenizer.json does. The two differ only where
# whitespace precedes a number: two or more whitespace characters before any digit ("a  1": here
# "Ġ","Ġ","1", in llama.cpp "ĠĠ","1"), or one before a non-ASCII numeral such as "½". We follow
# transformers so that our ids can be checked against a reference we can run.
_BYTE_LEVEL_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),  # llama.cpp's converter's name for GPT-2's split, and Phi-2's
    "phi-2": (_GPT2_SPLIT,),
    "gpt2": (_GPT2_SPLIT,),
    "smollm": (_GPT2_SPLIT,),
    "starcoder": (_GPT2_SPLIT,),
    "refact": (_GPT2_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "dbrx": (_LLAMA3_SPLIT,),
    "falcon3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    "gpt-4o": (_GPT4O_SPLIT,),
}

_SPACE = "\u2581"  # sentencepiece's visible space


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's spelling of bytes as printable characters, which byte-level vocabularies use."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def byte_level_bpe_from_gguf(metadata: Mapping[str, Any], source: str) -> TokenizersEngine:
    """The `tokenizers` BPE a GGUF "gpt2" vocabulary describes."""
    tokens = metadata_list(metadata, "tokenizer.ggml.tokens", source)
    token_types = _token_types(metadata, len(tokens), source)
    merges_text = metadata_list(metadata, "tokenizer.ggml.merges", source)
    pre = metadata.get("tokenizer.ggml.pre", "default")
    splits = _BYTE_LEVEL_SPLITS.get(pre)
    if splits is None:
        raise ModelError(
            f"{source}: tokenizer.ggml.pre is {pre!r}, a byte-level pre-tokenizer edgetp does not "
            f"know; known are {sorted(_BYTE_LEVEL_SPLITS)}"
        )

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    control: list[AddedToken] = []
    user_defined: list[AddedToken] = []
    for index, (token, token_type) in enumerate(zip(tokens, token_types, strict=True)):
        if set(token) <= alphabet:
            key = token
            # Matched whole in the raw text, before the byte-level pass, as llama.cpp does.
            if token_type == _CONTROL:
                control.append(AddedToken(token, special=True, normalized=False))
            elif token_type == _USER_DEFINED:
                user_defined.append(AddedToken(token, special=False, normalized=False))
        else:
            # A few files store a token as raw text rather than in the byte alphabet.
            key = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[key] = index

    merges: list[tuple[str, str]] = []
    for line in merges_text:
        left, sep, right = line.partition(" ")
        if not sep or not left or not right:
            raise ModelError(
                f"{source}: tokenizer.ggml.merges has {line!r}, expected two tokens and a space"
            )
        merges.append((left, right))

    try:
        model = tokenizers.models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
    except Exception as exc:
        raise ModelError(f"{source}: the vocabulary and merges do not form a BPE ({exc})") from exc
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
    return TokenizersEngine(backend)


def sentencepiece_model_from_gguf(metadata: Mapping[str, Any], source: str) -> bytes:
    """The sentencepiece model a GGUF "llama" vocabulary describes, serialized as tokenizer.model.

    It is the model `Tokenizer.from_gguf_metadata` runs, so a folder holding it tokenizes alike.
    """
    return sentencepiece_proto_from_gguf(metadata, source).SerializeToString()


def sentencepiece_proto_from_gguf(metadata: Mapping[str, Any], source: str) -> Any:
    """The sentencepiece ModelProto a GGUF "llama" vocabulary describes."""
    pb2 = sentencepiece_pb2()
    Piece = pb2.ModelProto.SentencePiece
    tokens = metadata_list(metadata, "tokenizer.ggml.tokens", source)
    token_types = _token_types(metadata, len(tokens), source)
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        # Without scores, a BPE vocabulary's order is its merge order, best first.
        scores = [-float(i) for i in range(len(tokens))]
    elif len(scores) != len(tokens):
        raise ModelError(
            f"{source}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
        )
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(token_types) if t == _UNKNOWN), None)
    if unk_id is None or not 0 <= unk_id < len(tokens):
        raise ModelError(
            f"{source}: a sentencepiece vocabulary needs an unknown token; "
            f"tokenizer.ggml.unknown_token_id is {unk_id!r}"
        )

    types = {
        _NORMAL: Piece.NORMAL,
        _CONTROL: Piece.CONTROL,
        _USER_DEFINED: Piece.USER_DEFINED,
        _UNUSED: Piece.UNUSED,
        _BYTE: Piece.BYTE,
    }
    # Gemma's runs of spaces ("  ".."<31 spaces>") are user-defined pieces, which sentencepiece
    # and llama.cpp match whole, longest first. transformers instead makes them plain pieces that
    # merge before any other, in vocabulary order; we do the same so that our ids match it. Both
    # give one piece for up to 31 spaces and differ only on longer runs (40 spaces: 31+9 there,
    # 16+24 here).
    best_score = max(
        (float(s) for s, t in zip(scores, token_types, strict=True) if t == _NORMAL), default=0.0
    )
    proto = pb2.ModelProto()
    seen: set[str] = set()
    for index, (token, token_type, score) in enumerate(
        zip(tokens, token_types, scores, strict=True)
    ):
        if index == unk_id:
            piece_type = Piece.UNKNOWN
        else:
            # Any other token marked unknown is special text all the same.
            piece_type = types.get(token_type, Piece.CONTROL)
        if token_type == _USER_DEFINED and " " in token:
            # llama.cpp writes the spaces of user-defined pieces as real spaces; sentencepiece
            # sees text whose spaces are already U+2581.
            token = token.replace(" ", _SPACE)
            if not token.strip(_SPACE):
                piece_type = Piece.NORMAL
                score = best_score + len(tokens) - index
        if token in seen or not token:
            # sentencepiece refuses a vocabulary with repeats; the later copy is unreachable
            # anyway, so it keeps its id under a name no text can produce.
            token = f"<edgetp-duplicate-{index}>"
            piece_type = Piece.UNUSED
        seen.add(token)
        proto.pieces.add(piece=token, score=score, type=piece_type)

    trainer = proto.trainer_spec
    trainer.model_type = pb2.TrainerSpec.BPE  # llama.cpp merges by score, i.e. BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = _BYTE in token_types
    trainer.unk_id = unk_id
    trainer.unk_piece = proto.pieces[unk_id].piece
    trainer.unk_surface = proto.pieces[unk_id].piece
    for field, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("pad", "padding_token_id"),
    ):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        valid = token_id is not None and 0 <= token_id < len(tokens)
        setattr(trainer, f"{field}_id", token_id if valid else -1)
        if valid:
            setattr(trainer, f"{field}_piece", proto.pieces[token_id].piece)

    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    # llama.cpp's default for a sentencepiece vocabulary that does not say.
    normalizer.add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        normalizer.precompiled_charsmap = bytes(charsmap)
    return proto


def metadata_list(metadata: Mapping[str, Any], key: str, source: str) -> list[Any]:
    """The non-empty list under `key`, or a ModelError naming the file and the key."""
    value = metadata.get(key)
    if not isinstance(value, list) or not value:
        raise ModelError(f"{source}: metadata key {key} is missing or not a non-empty list")
    return value


def _token_types(metadata: Mapping[str, Any], count: int, source: str) -> list[int]:
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is None:
        return [_NORMAL] * count
    if len(token_types) != count:
        raise ModelError(
            f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for {count} tokens"
        )
    return token_types
