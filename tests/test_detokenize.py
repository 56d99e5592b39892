"""The generation loop decodes an answer a few tokens at a time (master/generation/generate.py):
the text it
hands out equals the whole answer decoded at once, for byte-level BPE and sentencepiece, with
characters split across tokens, and a stop string is found wherever it ends."""

from __future__ import annotations

import random

import pytest

from edgetp.master.generation.generate import Generation, _accept
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.sampling import Sampler
from edgetp.models.source import open_model

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs and\nnew lines\n\n",
    "emoji \U0001f600\U0001f680 and \u00fc\u00e9\u20ac, then "
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "<|im_start|>user\nspecial tokens<|im_end|> in the middle",
]


def feed(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[Generation, str]:
    """The tokens through the loop's own accept, one at a time: (the sequence, text handed out)."""
    params = SamplingParams(max_tokens=10_000, stop=stop, ignore_eos=True)
    g = Generation(0, [1], params, Sampler(params))
    out = ""
    for token in ids:
        _accept(g, None, [], token, tokenizer, 1 << 20)  # type: ignore[arg-type]
        out += g.take_text()
        if g.finished:
            break
    return g, out


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_the_text_handed_out_is_the_whole_answer_decoded(model):
    tokenizer = open_model(model).tokenizer()
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_bos=False)
        g, out = feed(tokenizer, ids)
        assert out == g.text == tokenizer.decode(ids), (model, text)
    # byte tokens of a character arriving one by one, and random runs of the vocabulary
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        whole = tokenizer.decode(ids)
        g, out = feed(tokenizer, ids)
        # what is held back is an incomplete character at the end, never more
        assert whole.startswith(out) and "\ufffd" not in whole[len(out) :].rstrip("\ufffd")


@pytest.mark.parametrize("model", ["smollm2-135m-instruct", "gemma3-270m"])
def test_a_stop_string_across_tokens_ends_the_answer(model):
    tokenizer = open_model(model).tokenizer()
    ids = tokenizer.encode("one two three. END of it, and more text after", add_bos=False)
    g, out = feed(tokenizer, ids, stop=(". END",))
    assert g.finish_reason == "stop" and out == g.text == "one two three"
