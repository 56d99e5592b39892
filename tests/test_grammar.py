"""Grammar-constrained decoding (master/generation/grammar.py): the master's sampler masks every
token of a
sequence with its grammar, so what the bundled model writes always follows it.

The vocabulary llguidance matches bytes with is the model's own (`Tokenizer.token_bytes`): the
bytes of any text's tokens are the text's. Random JSON schemas, generated here, are answered by
the real SmolLM2 through the batcher, several sequences batched, on one process and on three
local nodes, with and without prompt-lookup drafts: every output validates.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from edgetp.master.cluster.local import local_session
from edgetp.master.cluster.session import Session
from edgetp.master.generation.batcher import Batcher, Delta, Event, Failed, Finished
from edgetp.master.generation.grammar import (
    Constraint,
    GrammarError,
    grammar_error,
    json_schema_grammar,
)
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.prompts import chat_tokens
from edgetp.master.generation.sampling import Sampler, sampler_for
from edgetp.master.generation.speculate import Speculator
from edgetp.memory.budget import FILE_TYPES
from edgetp.models.source import open_model

TEXTS = [
    'Hello, world! {"a": [1, 2.5e3, "\u00fc\u20ac\U0001f600"]}\n  indented\ttab',
    "  two  spaces, then a tab\tand a newline\n",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "<|im_start|>user\nhi<|im_end|>",
]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# Schemas per configuration of the random-schema test (4 configurations, 300 in all): 9-11 s each
# (Zen 5, 2 cores). EDGETP_SCHEMAS=300 runs 300 in each.
SCHEMAS = int(os.environ.get("EDGETP_SCHEMAS", "75"))
SLOTS = 8  # sequences batched: decode steps of more rows take a slower kernel path today
TIMEOUT = 300.0


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_token_bytes_spell_the_text(model):
    """Byte-level BPE (SmolLM2) and sentencepiece (Gemma 3): the bytes of a text's tokens are
    the text's, special tokens included (their names)."""
    tokenizer = open_model(model).tokenizer()
    spelled = tokenizer.token_bytes()
    assert len(spelled) == tokenizer.vocab_size
    for text in TEXTS:
        ids = tokenizer.encode(text, add_bos=False)
        assert b"".join(spelled[i] for i in ids) == text.encode(), (model, text)
    im_end = tokenizer.token_to_id("<|im_end|>")
    if im_end is not None:
        assert im_end in tokenizer.special_ids()


def test_a_constraint_masks_what_the_schema_forbids(smollm2_tokenizer):
    tok = smollm2_tokenizer
    c = Constraint(tok, json_schema_grammar(PERSON))
    vocab = tok.vocab_size + 64  # logits padded wider than the vocabulary: never allowed
    first = c.allowed(vocab)
    assert first.shape == (vocab,) and not first[tok.vocab_size :].any()
    assert {tok.decode([int(i)]) for i in np.flatnonzero(first)} <= {"{", '{"', '{"\n'}
    answer = tok.encode('{"name": "Ada", "age": 36}', add_bos=False)
    assert c.allowed_prefix([*answer, *answer]) == answer  # nothing after the closing brace
    for token in answer:
        assert c.allowed(vocab)[token]
        c.accept(token)
    assert c.finished
    assert set(np.flatnonzero(c.allowed(vocab))) == set(tok.eos_ids)  # only an end
    # a name the schema does not have stops the drafts where it starts
    wrong = tok.encode('{"nickname": "A"}', add_bos=False)
    fresh = Constraint(tok, json_schema_grammar(PERSON))
    kept = fresh.allowed_prefix(wrong)
    assert len(kept) < len(wrong) and tok.decode(kept) in ('{"', '{"n', "{")
    with pytest.raises(GrammarError, match="does not follow"):
        fresh.accept(tok.encode("]", add_bos=False)[0])


def test_bad_grammars_are_named(smollm2_tokenizer):
    assert grammar_error(smollm2_tokenizer, json_schema_grammar(PERSON)) is None
    assert "unknown name" in (grammar_error(smollm2_tokenizer, "start: missing") or "")
    with pytest.raises(GrammarError):
        Constraint(smollm2_tokenizer, "start: missing")
    dangling = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    assert "/nowhere" in (grammar_error(smollm2_tokenizer, json_schema_grammar(dangling)) or "")
    misspelled = json_schema_grammar({"type": "strin"})
    assert "strin" in (grammar_error(smollm2_tokenizer, misspelled) or "")


def test_the_sampler_draws_only_what_the_grammar_allows(smollm2_tokenizer):
    """Random logits, temperature 1, top-k, penalties and logprobs: every draw and every draft
    verified is allowed, and a grammar-free sampler is unchanged by the new code path."""
    tok = smollm2_tokenizer
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, top_k=50, presence_penalty=0.5, seed=1, logprobs=3)
    sampler = sampler_for(
        SamplingParams(**{**params.__dict__, "grammar": json_schema_grammar(PERSON)}), tok
    )
    output: list[int] = []
    for _ in range(40):
        logits = torch.from_numpy(rng.normal(size=tok.vocab_size).astype(np.float32))
        allowed = sampler.constraint.allowed(tok.vocab_size)  # type: ignore[union-attr]
        token = sampler(logits, output, output)
        assert allowed[token]
        entry = sampler.logprob(logits, output, token, output)
        assert all(allowed[t] for t, _ in entry.top)
        sampler.accept(token)
        output.append(token)
        if token in tok.eos_ids:
            break
    plain = [Sampler(params)(torch.ones(8), []) for _ in range(3)]
    assert plain == [Sampler(params)(torch.ones(8), []) for _ in range(3)]


@pytest.mark.slow  # runs the model end to end: not for `make test-fast`
def test_a_complete_answer_ends_even_with_ignore_eos(smollm2, smollm2_tokenizer, shared_state):
    """The bridge's ignore_eos asks for max_tokens tokens; past a complete JSON value the
    grammar allows only an end, so the answer ends there."""
    with Session(smollm2, None, shared_state, context=256, slots=1, memory=FILE_TYPES) as session:
        session.start()
        params = SamplingParams(
            max_tokens=60, ignore_eos=True, grammar=json_schema_grammar({"enum": ["yes", "no"]})
        )
        batcher = Batcher(session, smollm2_tokenizer).start()
        try:
            events: queue.Queue[Event] = queue.Queue()
            batcher.submit(smollm2_tokenizer.encode("Answer: "), params, events.put)
            text, end = "", None
            while end is None:
                e = events.get(timeout=TIMEOUT)
                if isinstance(e, Delta):
                    text += e.text
                elif isinstance(e, Finished | Failed):
                    end = e
        finally:
            batcher.close()
    assert isinstance(end, Finished) and end.finish_reason == "stop"
    assert json.loads(text) in ("yes", "no") and end.completion_tokens < 10


def random_schema(r: random.Random, depth: int = 0) -> dict[str, Any]:
    """A JSON schema of nested objects, arrays, anyOf, enums and bounded scalars: every string
    and array has a bound, so an answer that follows it ends."""
    if depth >= 2 or r.random() < 0.35:
        kind = r.choice(["string", "integer", "number", "boolean", "enum", "const", "null"])
        if kind == "string":
            top = r.randint(1, 10)
            return {"type": "string", "maxLength": top, "minLength": r.randint(0, top)}
        if kind in ("integer", "number"):
            low = r.randint(-100, 100)
            bounded = {"type": kind, "minimum": low, "maximum": low + r.randint(1, 1000)}
            # a number's digits are unbounded but for multipleOf: greedy SmolLM2 wrote
            # digits until max_tokens for 1 schema of 75 without it
            return bounded if kind == "integer" else {**bounded, "multipleOf": 0.25}
        if kind == "enum":
            return {"enum": r.sample(["red", "green", "blue", 1, 2, True, None, "x y"], 3)}
        if kind == "const":
            return {"const": r.choice(["yes", 7, False])}
        return {"type": kind}
    kind = r.choice(["object", "object", "array", "anyOf"])
    if kind == "object":
        names = ["name", "age", "city", "tags", "id", "note", "size", "ok"]
        keys = r.sample(names, r.randint(1, 4))
        return {
            "type": "object",
            "properties": {k: random_schema(r, depth + 1) for k in keys},
            "required": [k for k in keys if r.random() < 0.7],
            "additionalProperties": False,
        }
    if kind == "array":
        low = r.randint(0, 2)
        items = random_schema(r, depth + 1)
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + r.randint(0, 2)}
    return {"anyOf": [random_schema(r, depth + 1), random_schema(r, depth + 1)]}


def answer_all(batcher: Batcher, tokenizer, schemas: list[dict[str, Any]]) -> list[str]:
    """Every schema's answer, all submitted at once so that the batcher batches them."""
    prompt = chat_tokens(tokenizer, [{"role": "user", "content": "Write an example JSON value."}])
    events: queue.Queue[tuple[int, Event]] = queue.Queue()
    for i, schema in enumerate(schemas):
        params = SamplingParams(max_tokens=200, grammar=json_schema_grammar(schema))
        batcher.submit(prompt, params, lambda e, i=i: events.put((i, e)))
    texts = [""] * len(schemas)
    reasons: dict[int, str] = {}
    while len(reasons) < len(schemas):
        i, e = events.get(timeout=TIMEOUT)
        if isinstance(e, Delta):
            texts[i] += e.text
        elif isinstance(e, Failed):
            raise e.error
        elif isinstance(e, Finished):
            reasons[i] = e.finish_reason
    assert set(reasons.values()) == {"stop"}, reasons
    return texts


@pytest.fixture(scope="module")
def cluster_of(smollm2, shared_state) -> Iterator[Callable[[int], Session]]:
    """A started session of n nodes (1: the master alone) of SLOTS slots on the file's blocks,
    kept for the next configuration of the same count (they run in order of it) and closed
    when another count is asked for. Each configuration runs a batcher of its own, whose slots
    start empty."""
    held: dict[int, Session] = {}
    with contextlib.ExitStack() as stack:

        def of(nodes: int) -> Session:
            if nodes not in held:
                stack.close()  # the other count's session
                held.clear()
                if nodes == 1:
                    held[nodes] = stack.enter_context(
                        Session(smollm2, None, shared_state, context=512, slots=SLOTS,
                                memory=FILE_TYPES)
                    )  # fmt: skip
                    held[nodes].start()
                else:
                    held[nodes] = stack.enter_context(
                        local_session(smollm2, nodes, state_dir=shared_state, context=512,
                                      slots=SLOTS, memory=FILE_TYPES)
                    )  # fmt: skip
            return held[nodes]

        yield of


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nodes", "draft", "seed"), [(1, False, 1), (1, True, 2), (3, False, 3), (3, True, 4)]
)
def test_random_schemas_are_always_answered_in_valid_json(
    cluster_of, smollm2_tokenizer, nodes, draft, seed
):
    """Each configuration answers its own random schemas, SLOTS at a time: every answer ends
    on its own and validates against its schema."""
    rng = random.Random(seed)
    schemas = [random_schema(rng) for _ in range(SCHEMAS)]
    speculator = Speculator() if draft else None
    texts = run_batched(cluster_of(nodes), smollm2_tokenizer, speculator, schemas)
    for schema, text in zip(schemas, texts, strict=True):
        jsonschema.validate(json.loads(text), schema)
    if draft:
        assert speculator is not None and speculator.drafted > 0


def run_batched(session, tokenizer, speculator, schemas) -> list[str]:
    batcher = Batcher(session, tokenizer, max_waiting=len(schemas), speculator=speculator)
    batcher.start()
    try:
        return answer_all(batcher, tokenizer, schemas)
    finally:
        batcher.close()
