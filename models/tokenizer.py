"""Text to token ids and back, for the vocabularies a model can ship with.

Three sources, two engines:

- a GGUF "gpt2" vocabulary (byte-level BPE, e.g. SmolLM2, Llama 3, Qwen2) is rebuilt as a
  `tokenizers` BPE from the file's tokens and merges;
- a GGUF "llama" vocabulary (sentencepiece, e.g. Llama 2, TinyLlama, Gemma) is rebuilt as a
  sentencepiece model in memory from the file's tokens, scores and token types;
- an HF folder is read as it is: `tokenizer.json` with `tokenizers`, else `tokenizer.model` with
  `sentencepiece`.

Whatever the engine, special tokens written in the text (`<|im_start|>`, `<start_of_turn>`) are
matched whole, as transformers does, because chat templates render them as text and the model was
trained on them as single tokens. `decode` renders them back, so `decode(encode(s)) == s`.

The file is long (about 600 lines) because rebuilding both engines from GGUF metadata is most of
it; they stay next to the one `Tokenizer` they serve, so the special-token rule above is kept in
one place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import sentencepiece
import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers

from models.errors import ModelError

# Tokens that end an assistant turn. A chat model stops on these as well as on its EOS: many
# instruct models keep their pretraining EOS (`<|endoftext|>`) and end turns with another token.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
)

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
}

_SPACE = "\u2581"  # sentencepiece's visible space


class _Engine(Protocol):
    """What Tokenizer needs from a tokenizing library, special tokens included."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None: ...


class Tokenizer:
    """A model's tokenizer: `encode` text to ids, `decode` ids to text, plus the ids that matter."""

    def __init__(
        self,
        engine: _Engine,
        *,
        vocab_size: int,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        source: str,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self._engine = engine
        self.source = source
        self.vocab_size = vocab_size
        for name, token_id in (("bos", bos_id), ("eos", eos_id)):
            if token_id is not None and not 0 <= token_id < vocab_size:
                raise ModelError(
                    f"{source}: the {name} token id {token_id} is outside the vocabulary "
                    f"(0..{vocab_size - 1})"
                )
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.bos_token = engine.id_to_token(bos_id) if bos_id is not None else None
        self.eos_token = engine.id_to_token(eos_id) if eos_id is not None else None
        if add_bos and bos_id is None:
            raise ModelError(f"{source}: the tokenizer asks for a BOS token but defines none")
        self.add_bos = add_bos
        self.chat_template = chat_template
        ends = {eos_id} if eos_id is not None else set()
        ends.update(i for i in extra_eos_ids if 0 <= i < vocab_size)
        for token in END_OF_TURN_TOKENS:
            token_id = engine.token_to_id(token)
            if token_id is not None:
                ends.add(token_id)
        self.eos_ids: frozenset[int] = frozenset(ends)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids for `text`; special tokens written in it are matched as single tokens.

        `add_bos=None` follows the model's own default (`self.add_bos`).
        """
        if add_bos is None:
            add_bos = self.add_bos
        ids = self._engine.encode(text)
        if add_bos:
            if self.bos_id is None:
                raise ModelError(f"{self.source}: cannot add a BOS token, the model has none")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens written out as their text."""
        ids = list(ids)
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise ModelError(
                    f"{self.source}: cannot decode token id {token_id}, the vocabulary has "
                    f"{self.vocab_size} tokens"
                )
        return self._engine.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        """The id of the token spelled `token` in the vocabulary, or None."""
        token_id = self._engine.token_to_id(token)
        if token_id is None or not 0 <= token_id < self.vocab_size:
            return None
        return token_id

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's spelling of `token_id` (e.g. "Ġthe", "▁the"), or None."""
        if not 0 <= token_id < self.vocab_size:
            return None
        return self._engine.id_to_token(token_id)

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str) -> Tokenizer:
        """The tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind is None:
            raise ModelError(f"{source}: no tokenizer.ggml.model key, the file has no tokenizer")
        tokens = _metadata_list(metadata, "tokenizer.ggml.tokens", source)
        if kind == "gpt2":
            engine: _Engine = _byte_level_bpe_from_gguf(metadata, source)
            default_add_bos = False
        elif kind == "llama":
            proto = _sentencepiece_proto_from_gguf(metadata, source)
            engine = _SentencePieceEngine(proto, source)
            # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
            default_add_bos = True
        else:
            raise ModelError(
                f"{source}: tokenizer.ggml.model is {kind!r}; supported are 'gpt2' "
                f"(byte-level BPE) and 'llama' (sentencepiece)"
            )
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)
        extra_eos = [
            metadata[key]
            for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if key in metadata
        ]
        return cls(
            engine,
            vocab_size=len(tokens),
            bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(add_bos),
            chat_template=metadata.get("tokenizer.chat_template"),
            source=source,
            extra_eos_ids=extra_eos,
        )

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer:
        """The tokenizer of an HF model folder: tokenizer.json, else tokenizer.model.

        tokenizer_config.json (optional) gives the BOS/EOS tokens, whether to add BOS and the chat
        template; a chat_template.jinja file, as newer transformers saves, overrides the latter.
        """
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        bos_token = _token_text(config.get("bos_token", special_map.get("bos_token")))
        eos_token = _token_text(config.get("eos_token", special_map.get("eos_token")))
        chat_template = _chat_template_from_config(config, folder)

        json_path = folder / "tokenizer.json"
        model_path = folder / "tokenizer.model"
        if json_path.is_file():
            try:
                backend = tokenizers.Tokenizer.from_file(str(json_path))
            except Exception as exc:
                raise ModelError(f"{json_path} cannot be read as a tokenizer ({exc})") from exc
            engine: _Engine = _TokenizersEngine(backend)
            source = str(json_path)
            vocab_size = backend.get_vocab_size(with_added_tokens=True)
            bos_id = _named_token_id(engine, bos_token, "bos_token", json_path)
            eos_id = _named_token_id(engine, eos_token, "eos_token", json_path)
            add_bos = config.get("add_bos_token")
            if add_bos is None:
                # No flag: the tokenizer.json post-processor is what adds BOS, if anything.
                with_specials = backend.encode("", add_special_tokens=True).ids
                add_bos = bos_id is not None and with_specials[:1] == [bos_id]
        elif model_path.is_file():
            proto = _read_sentencepiece_proto(model_path)
            engine = _SentencePieceEngine(proto, str(model_path))
            source = str(model_path)
            vocab_size = len(proto.pieces)
            bos_id = _sentencepiece_special_id(proto, bos_token, "bos")
            eos_id = _sentencepiece_special_id(proto, eos_token, "eos")
            add_bos = config.get("add_bos_token", True)
        else:
            raise ModelError(
                f"{folder} has neither tokenizer.json nor tokenizer.model; one of them is needed "
                f"to tokenize text for this model"
            )
        return cls(
            engine,
            vocab_size=vocab_size,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=bool(add_bos),
            chat_template=chat_template,
            source=source,
        )


# -------------------------------------------------------------------- tokenizers engine


class _TokenizersEngine:
    """A `tokenizers.Tokenizer`. Its added tokens are matched in text whatever the flags say."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend

    def encode(self, text: str) -> list[int]:
        # BOS is the caller's decision; the post-processor must not add it a second time.
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)


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


def _byte_level_bpe_from_gguf(metadata: Mapping[str, Any], source: str) -> _TokenizersEngine:
    tokens = _metadata_list(metadata, "tokenizer.ggml.tokens", source)
    token_types = _token_types(metadata, len(tokens), source)
    merges_text = _metadata_list(metadata, "tokenizer.ggml.merges", source)
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
    return _TokenizersEngine(backend)


# ----------------------------------------------------------------- sentencepiece engine


def _model_pb2() -> Any:
    try:
        from sentencepiece import sentencepiece_model_pb2
    except Exception as exc:  # ImportError, or protobuf's runtime version check
        raise ModelError(
            f"cannot build a sentencepiece model: sentencepiece's protobuf schema does not load "
            f"({exc}); install protobuf matching the sentencepiece package"
        ) from exc
    return sentencepiece_model_pb2


class _SentencePieceEngine:
    """A sentencepiece model, adjusted so that special pieces are matched in text and decoded.

    sentencepiece never matches CONTROL pieces (`<bos>`, `<start_of_turn>`) in text and decodes
    them to nothing. Marking them USER_DEFINED gives both: user-defined pieces are matched whole,
    longest first, wherever they appear, and decode to their own text. The UNKNOWN piece is made
    user-defined as well (`<unk>` typed in text is that token, as in transformers), and a stand-in
    UNKNOWN piece, which sentencepiece requires, is appended past the end of the vocabulary.
    """

    def __init__(self, proto: Any, source: str) -> None:
        pb2 = _model_pb2()
        Piece = pb2.ModelProto.SentencePiece
        adjusted = pb2.ModelProto()
        adjusted.CopyFrom(proto)
        self._pieces = [p.piece for p in proto.pieces]
        self._ids = {piece: i for i, piece in reversed(list(enumerate(self._pieces)))}
        self._unk_id: int | None = None
        for index, piece in enumerate(adjusted.pieces):
            if piece.type == Piece.UNKNOWN:
                self._unk_id = index
                piece.type = Piece.USER_DEFINED
            elif piece.type == Piece.CONTROL:
                piece.type = Piece.USER_DEFINED
        if self._unk_id is None:
            raise ModelError(f"{source}: the sentencepiece vocabulary has no unknown token")
        self._stand_in_unk = len(adjusted.pieces)
        adjusted.pieces.add(piece="<edgetp-unknown>", score=0.0, type=Piece.UNKNOWN)
        self._processor = sentencepiece.SentencePieceProcessor()
        try:
            self._processor.LoadFromSerializedProto(adjusted.SerializeToString())
        except Exception as exc:
            raise ModelError(f"{source}: sentencepiece rejects the vocabulary ({exc})") from exc

    def encode(self, text: str) -> list[int]:
        ids = self._processor.EncodeAsIds(text)
        if self._stand_in_unk in ids:
            ids = [self._unk_id if i == self._stand_in_unk else i for i in ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._processor.DecodeIds(ids)

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        if 0 <= token_id < len(self._pieces):
            return self._pieces[token_id]
        return None


def sentencepiece_model_from_gguf(metadata: Mapping[str, Any], source: str) -> bytes:
    """The sentencepiece model a GGUF "llama" vocabulary describes, serialized as tokenizer.model.

    It is the model `Tokenizer.from_gguf_metadata` runs, so a folder holding it tokenizes alike.
    """
    return _sentencepiece_proto_from_gguf(metadata, source).SerializeToString()


def _sentencepiece_proto_from_gguf(metadata: Mapping[str, Any], source: str) -> Any:
    pb2 = _model_pb2()
    Piece = pb2.ModelProto.SentencePiece
    tokens = _metadata_list(metadata, "tokenizer.ggml.tokens", source)
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


def _read_sentencepiece_proto(path: Path) -> Any:
    pb2 = _model_pb2()
    proto = pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as exc:
        raise ModelError(f"{path} cannot be read as a sentencepiece model ({exc})") from exc
    if not proto.pieces:
        raise ModelError(f"{path} is a sentencepiece model without pieces")
    return proto


def _named_token_id(engine: _Engine, token: str | None, key: str, path: Path) -> int | None:
    if token is None:
        return None
    token_id = engine.token_to_id(token)
    if token_id is None:
        raise ModelError(
            f"{path.parent}: tokenizer_config.json names {key} {token!r}, which {path.name} "
            f"does not have"
        )
    return token_id


def _sentencepiece_special_id(proto: Any, token: str | None, field: str) -> int | None:
    """The id of `token` (from tokenizer_config), else the model's own bos/eos id."""
    if token is not None:
        for index, piece in enumerate(proto.pieces):
            if piece.piece == token:
                return index
    token_id = getattr(proto.trainer_spec, f"{field}_id")
    return token_id if 0 <= token_id < len(proto.pieces) else None


# ------------------------------------------------------------------------ helpers


def _metadata_list(metadata: Mapping[str, Any], key: str, source: str) -> list[Any]:
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


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ModelError(f"{path} should hold a JSON object, not {type(value).__name__}")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_from_config(config: Mapping[str, Any], folder: Path) -> str | None:
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: "default" is the one for plain chat.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
