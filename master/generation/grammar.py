"""Constrained decoding: which tokens a grammar lets a sequence take next.

A request's `response_format` (JSON mode, a JSON schema) or a forced tool call becomes a
grammar in llguidance's form (`SamplingParams.grammar`, built by the bridge with
`json_schema_grammar` or `llguidance.LLMatcher.grammar_from_lark`). Its sequence's sampler
masks the logits with it at every token, on the master alone: nodes compute logits as ever.
Under speculation a draft the grammar forbids is not proposed (`Constraint.allowed_prefix`), and
each kept draft is checked against the mask at its own place, so the output is what sampling
without drafts would have produced.

llguidance matches the grammar on bytes: its tokenizer is the model's own, given as each
token's bytes (`Tokenizer.token_bytes`) with its special tokens marked, so any vocabulary a
model ships with (byte-level BPE, sentencepiece) works the same.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from edgetp.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# llguidance marks a special token by this first byte: no text can hold it, so no grammar
# matches such a token as text.
SPECIAL_MARK = b"\xff"


JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A grammar llguidance cannot compile, or a schema it cannot turn into one."""


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of JSON values that validate against `schema`; any JSON object for None
    (JSON mode). Written on one line, `{"a": 1, "b": [2, 3]}`: free whitespace let a small
    model emit newlines until max_tokens (SmolLM2, greedy, 1 of 40 random schemas)."""
    if schema is None:
        schema = {"type": "object"}
    try:
        return str(
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_LAYOUT)
        )
    except ValueError as exc:
        raise GrammarError(f"the JSON schema cannot be used: {exc}") from exc


def grammar_error(tokenizer: Tokenizer, grammar: str) -> str | None:
    """Why `grammar` cannot constrain this model's output, or None when it can."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, _ll_tokenizer(tokenizer)
    )
    return messages[0] if is_error else None


class Constraint:
    """One sequence's place in its grammar: the tokens it may take next, as a mask over the
    logits, and the tokens it took."""

    def __init__(self, tokenizer: Tokenizer, grammar: str) -> None:
        ll = _ll_tokenizer(tokenizer)
        self._matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())
        self._bits = np.zeros((ll.vocab_size + 31) // 32, dtype=np.int32)
        self._allowed: np.ndarray | None = None  # the mask at the current place, once computed

    def allowed(self, vocab: int) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar takes next. Past the tokenizer's vocabulary
        (logits padded wider), none."""
        if self._allowed is None:
            self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            self._allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little").astype(bool)
        mask = self._allowed
        if len(mask) >= vocab:
            return mask[:vocab]
        return np.concatenate([mask, np.zeros(vocab - len(mask), dtype=bool)])

    def accept(self, token: int) -> None:
        """Move past `token`, which the mask allowed."""
        if not self._matcher.consume_token(token):
            raise GrammarError(
                f"token {token} does not follow the grammar: {self._matcher.get_error()}"
            )
        self._allowed = None

    def allowed_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The longest first part of `tokens` (drafts) the grammar takes from here."""
        return list(tokens[: self._matcher.validate_tokens(list(tokens))])

    @property
    def finished(self) -> bool:
        """Whether the grammar is complete and takes nothing more (only an end of sequence)."""
        return bool(self._matcher.is_stopped())


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of the model's vocabulary: ~0.2 s to build for 49,152 tokens, once
    per served model."""
    return llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_Vocabulary(tokenizer)),
        eos_token=sorted(tokenizer.eos_ids),
    )


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads from a tokenizer: each token's bytes (a special
    token's marked) and how text is tokenized."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        special = tokenizer.special_ids() | tokenizer.eos_ids
        self.tokens = [
            SPECIAL_MARK + b if i in special else b for i, b in enumerate(tokenizer.token_bytes())
        ]
        self.special_token_ids = sorted(special)
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else -1
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_bos=False)
