"""Text to token ids and back, for the vocabularies a model can ship with.

Three sources, two engines (`models.tokenizer_engines`):

- a GGUF "gpt2" vocabulary (byte-level BPE) is rebuilt as a `tokenizers` BPE, and a GGUF "llama"
  vocabulary (sentencepiece) as a sentencepiece model, from the file's metadata
  (`models.gguf_vocab`);
- an HF folder is read as it is: `tokenizer.json` with `tokenizers`, else `tokenizer.model` with
  `sentencepiece` (here, with the folder's tokenizer_config.json).

Whatever the engine, special tokens written in the text (`<|im_start|>`, `<start_of_turn>`) are
matched whole, as transformers does, because chat templates render them as text and the model was
trained on them as single tokens. `decode` renders them back, so `decode(encode(s)) == s`. That
rule is kept in the one `Tokenizer` here, whichever source built its engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from edgetp.models.errors import ModelError
from edgetp.models.gguf_vocab import (
    byte_level_bpe_from_gguf,
    metadata_list,
    sentencepiece_proto_from_gguf,
)
from edgetp.models.tokenizer_engines import (
    Engine,
    SentencePieceEngine,
    TokenizersEngine,
    sentencepiece_pb2,
)

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
# The harmony format (gpt-oss) ends every message with <|end|>, its reasoning's included, and
# the answer with <|return|> (or a tool call with <|call|>): where a vocabulary has <|return|>,
# those end a turn and <|end|> does not (as llama.cpp decides it).
HARMONY_END_OF_TURN_TOKENS = ("<|return|>", "<|call|>")


class Tokenizer:
    """A model's tokenizer: `encode` text to ids, `decode` ids to text, plus the ids that matter."""

    def __init__(
        self,
        engine: Engine,
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
        harmony = engine.token_to_id(HARMONY_END_OF_TURN_TOKENS[0]) is not None
        for token in END_OF_TURN_TOKENS + (HARMONY_END_OF_TURN_TOKENS if harmony else ()):
            token_id = engine.token_to_id(token)
            if token_id is not None and not (harmony and token == "<|end|>"):
                ends.add(token_id)
        self.eos_ids: frozenset[int] = frozenset(ends)
        self._token_bytes: list[bytes] | None = None

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

    def token_bytes(self) -> list[bytes]:
        """Every token's bytes as it adds them to the text, by id; a special token's are its
        name's. What a grammar matches tokens with (master/generation/grammar.py), and the bytes of
        a
        token that holds part of a character (logprobs)."""
        if self._token_bytes is None:
            self._token_bytes = self._engine.token_bytes()[: self.vocab_size]
        return self._token_bytes

    def special_ids(self) -> frozenset[int]:
        """The tokens that are markup (`<|im_start|>`, `<bos>`), never text a grammar matches."""
        return self._engine.special_ids()

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str) -> Tokenizer:
        """The tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind is None:
            raise ModelError(f"{source}: no tokenizer.ggml.model key, the file has no tokenizer")
        tokens = metadata_list(metadata, "tokenizer.ggml.tokens", source)
        if kind == "gpt2":
            engine: Engine = byte_level_bpe_from_gguf(metadata, source)
            default_add_bos = False
        elif kind == "llama":
            proto = sentencepiece_proto_from_gguf(metadata, source)
            engine = SentencePieceEngine(proto, source)
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
            engine: Engine = TokenizersEngine(backend)
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
            engine = SentencePieceEngine(proto, str(model_path))
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


def _read_sentencepiece_proto(path: Path) -> Any:
    pb2 = sentencepiece_pb2()
    proto = pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as exc:
        raise ModelError(f"{path} cannot be read as a sentencepiece model ({exc})") from exc
    if not proto.pieces:
        raise ModelError(f"{path} is a sentencepiece model without pieces")
    return proto


def _named_token_id(engine: Engine, token: str | None, key: str, path: Path) -> int | None:
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
