"""Gemma 3 270M, the real GGUF file (Q4_K_M, shipped as a test package), against transformers
loading the same file: logits from just before the local window on, over a prompt longer than
it, and `edgetp run --raw` greedy text. It is a base model: prompts are raw text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_copy import transformers_model
from test_cli import run

from master.engine import Engine
from models.bundled import BUNDLED_MODELS
from models.layers import StepBatch
from models.source import open_model

pytestmark = pytest.mark.slow

DECODE_STEPS = 16
KEPT_BEFORE = 32
# Long enough to pass the 512-position window of the local layers.
LONG_TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in "
    "Europe built wooden machines that riders pushed along with their feet. Pedals came later, "
    "fixed to the front wheel, and the front wheel grew larger to go faster, until the safety "
    "bicycle, with two wheels of the same size and a chain to the rear one, replaced it. "
) * 9


@pytest.fixture(scope="module")
def gemma3_path() -> Path:
    return BUNDLED_MODELS["gemma3-270m"]()


@pytest.fixture(scope="module")
def reference(gemma3_path, tmp_path_factory):
    """transformers' model from the same weights, dequantized to float32, and our tokenizer
    (held to transformers' own on this file by tests/test_tokenizer.py; building theirs takes
    15 s)."""
    folder = tmp_path_factory.mktemp("gemma3-reference")
    model = transformers_model(gemma3_path, folder, attn_implementation="eager")
    return model, open_model(gemma3_path).tokenizer()


@torch.inference_mode()
def test_logits_equal_transformers_past_the_local_window(gemma3_path, reference):
    model, tokenizer = reference
    prompt = tokenizer.encode(LONG_TEXT)
    window = model.config.sliding_window
    assert len(prompt) > window, (len(prompt), window)
    source = open_model(gemma3_path)
    assert source.config.local_layers and source.config.sliding_window == window
    # One node: the split of this layout (one KV head, four query heads on three nodes, local
    # and global layers) is held to transformers on every node count by tests/test_families.py;
    # an engine for this file takes 8 s to build here (20 s beside the suite's other tests).
    # The prompt and then DECODE_STEPS greedy tokens, one decode step each past the window, and
    # transformers' logits for the same tokens in one forward, compared from KEPT_BEFORE
    # positions before the window on: every position where the local layers' window cuts
    # (the earlier ones see what a global layer does; the vocabulary of 262,144 makes each
    # position's logits 1 MB, 4 s of transformers' forward and of the comparison).
    engine = Engine.local(source, max_context=len(prompt) + DECODE_STEPS)
    logits = [engine.forward([prompt], StepBatch((0,), (0,), (len(prompt),)), True)[0]]
    generated = [*prompt, int(logits[0][-1].argmax())]
    for _ in range(DECODE_STEPS):
        step = StepBatch((0,), (len(generated) - 1,), (1,))
        logits.append(engine.forward([[generated[-1]]], step))
        generated.append(int(logits[-1][-1].argmax()))
    kept = len(generated) - 1 - (window - KEPT_BEFORE)
    ours = torch.cat([logits[0][DECODE_STEPS - kept :], *logits[1:]])
    expected = model(torch.tensor([generated[:-1]]), logits_to_keep=kept).logits[0]
    assert len(expected) == kept
    worst = float((ours - expected).abs().max())
    bound = 1e-3 * float(expected.abs().max())
    first = len(generated) - 1 - kept
    print(f"\n{kept} positions from {first}: max|diff| {worst:.2e}, bound {bound:.2e}")
    assert worst <= bound, (worst, bound)


@torch.inference_mode()
def test_run_raw_greedy_equals_transformers_generate(gemma3_path, reference):
    model, tokenizer = reference
    prompt = "The capital of France is"
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
    )
    expected = tokenizer.decode(out[0, ids.shape[1] :].tolist())
    assert expected.startswith(" the capital of the country of France.")  # as published
    result = run("run", "--raw", "--max-tokens", "12", "--model", "gemma3-270m", prompt)
    assert result.returncode == 0, result.stderr
    print(f"\n{prompt!r} -> {result.stdout!r}")
    assert result.stdout.rstrip("\n") == expected
