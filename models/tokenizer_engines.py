"""The tokenizing libraries behind `models.tokenizer.Tokenizer`, each adapted to one interface.

`Tokenizer` keeps one rule whatever the library: special tokens written in the text are matched
whole and decoded back as their text. `tokenizers` does so for its added tokens once BOS is left
to the caller; sentencepiece never matches its CONTROL pieces, so its model is adjusted before it
loads (`SentencePieceEngine`). The vocabularies come from elsewhere: an HF folder's files
(`models.tokenizer`) or a GGUF file's metadata (`models.gguf_vocab`).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Protocol

import sentencepiece
import tokenizers

from edgetp.models.errors import ModelError


class Engine(Protocol):
    """What Tokenizer needs from a tokenizing library, special tokens included."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def token_bytes(self) -> list[bytes]:
        """Every token's bytes as it adds them to text, by id (a special token's, its name)."""
        ...

    def special_ids(self) -> frozenset[int]:
        """The tokens that are markup (`<|im_start|>`, `<bos>`), not text."""
        ...


@functools.cache
def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level BPE spells byte b as one printable character (its bytes_to_unicode)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def piece_bytes(piece: str) -> bytes:
    """A sentencepiece-style piece's bytes: `<0xNN>` is one byte, `▁` a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode()


class TokenizersEngine:
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

    def token_bytes(self) -> list[bytes]:
        # A byte-level vocabulary spells each byte as a printable character; any other (a
        # Metaspace one, Gemma's or Llama 2's) spells a space as ▁ and a lone byte as <0xNN>.
        decoder = json.loads(self._backend.to_str()).get("decoder") or {}
        byte_level = "ByteLevel" in json.dumps(decoder)
        table = byte_of_char()
        added = self._backend.get_added_tokens_decoder()
        out = []
        for token_id in range(self._backend.get_vocab_size(with_added_tokens=True)):
            spelled = self._backend.id_to_token(token_id) or ""
            if token_id in added:
                out.append(added[token_id].content.encode())
            elif byte_level and all(c in table for c in spelled):
                out.append(bytes(table[c] for c in spelled))
            else:
                out.append(piece_bytes(spelled))
        return out

    def special_ids(self) -> frozenset[int]:
        added = self._backend.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)


def sentencepiece_pb2() -> Any:
    """sentencepiece's protobuf schema, which its models are built and read with."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except Exception as exc:  # ImportError, or protobuf's runtime version check
        raise ModelError(
            f"cannot build a sentencepiece model: sentencepiece's protobuf schema does not load "
            f"({exc}); install protobuf matching the sentencepiece package"
        ) from exc
    return sentencepiece_model_pb2


class SentencePieceEngine:
    """A sentencepiece model, adjusted so that special pieces are matched in text and decoded.

    sentencepiece never matches CONTROL pieces (`<bos>`, `<start_of_turn>`) in text and decodes
    them to nothing. Marking them USER_DEFINED gives both: user-defined pieces are matched whole,
    longest first, wherever they appear, and decode to their own text. The UNKNOWN piece is made
    user-defined as well (`<unk>` typed in text is that token, as in transformers), and a stand-in
    UNKNOWN piece, which sentencepiece requires, is appended past the end of the vocabulary.
    """

    def __init__(self, proto: Any, source: str) -> None:
        pb2 = sentencepiece_pb2()
        Piece = pb2.ModelProto.SentencePiece
        adjusted = pb2.ModelProto()
        adjusted.CopyFrom(proto)
        self._pieces = [p.piece for p in proto.pieces]
        self._special = frozenset(
            i for i, p in enumerate(proto.pieces) if p.type in (Piece.CONTROL, Piece.UNKNOWN)
        )
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

    def token_bytes(self) -> list[bytes]:
        return [piece_bytes(piece) for piece in self._pieces]

    def special_ids(self) -> frozenset[int]:
        return self._special
