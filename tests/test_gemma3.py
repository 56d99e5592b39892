"""Gemma 3 270M, the real GGUF file (Q4_K_M, shipped as a test package), against transformers
loading the same file: logits from just before the local window on, over a prompt longer than
it, and `edgetp run --raw` greedy text. It is a base model: prompts are raw text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cluster_threads import master_threads
from gguf_copy import transformers_model
from test_speculate import SlowLinkSpeculator, _generate

from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.local import local_session
from edgetp.master.cluster.plan import head_rows, plan_slices
from edgetp.master.generation.speculate import open_speculator
from edgetp.memory.budget import FILE_TYPES
from edgetp.memory.shards import ShardStore
from edgetp.memory.splitter import split_model
from edgetp.models.bundled import BUNDLED_MODELS
from edgetp.models.layers import StepBatch
from edgetp.models.source import open_model
from edgetp.tui.cli import main

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


# Raw text of several kinds (prose, code, a list, a date): at the default dtype the file's own
# weights, Q4_K and Q6_K among them, must continue each exactly as transformers does.
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Ingredients for a simple bread: flour,",
    "On 20 July 1969, the crew of Apollo 11",
)


@pytest.fixture(scope="module")
def expected_continuations(reference) -> dict[str, str]:
    model, tokenizer = reference
    out = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
            )
            out[prompt] = tokenizer.decode(gen[0, ids.shape[1] :].tolist())
    assert out[PROMPTS[0]].startswith(" the capital of the country of France.")  # as published
    return out


@pytest.mark.parametrize("nodes", [1, 3])
def test_run_raw_greedy_equals_transformers_generate(expected_continuations, nodes, capsys):
    """`edgetp run --raw` at its default dtype (auto: the file's types kept) with exact
    activations (transformers multiplies the file's values in float), on one process and on
    three local nodes: the command's own `main`, in this process (a new interpreter per prompt
    imported torch and started a fork server for its workers again each time;
    tests/test_cli.py runs the console script itself)."""
    answers = {}
    for prompt in expected_continuations:
        code = main([
            "run", "--raw", "--max-tokens", "12", "--model", "gemma3-270m",
            "--activations", "exact", "--local-nodes", str(nodes), prompt,
        ])  # fmt: skip
        answers[prompt], err = capsys.readouterr()
        assert code == 0, err
    for prompt, expected in expected_continuations.items():
        print(f"\n{nodes} node(s): {prompt!r} -> {answers[prompt]!r}")
        assert answers[prompt] == expected + "\n", prompt


def test_a_split_keeps_the_file_s_size(gemma3_path, tmp_path):
    """Split at the default dtype, on one node and across three, the shards (every node's
    layers, the master's embedding and norms) total within 5% of the file: each weight stays in
    the file's own type. Across three, each worker also holds its rows of the lm_head, which
    this model ties to the embedding: copies of the embedding's rows, by the split's design."""
    source = open_model(gemma3_path)
    file = gemma3_path.stat().st_size
    for n in (1, 3):
        slices = plan_slices(source.config, [1.0] * n, source.ffn_align("auto"))
        heads = head_rows(source.config, slices, [1.0] * n) if n > 1 else None
        store = ShardStore(tmp_path / str(n))
        manifest = split_model(source, slices, store, dtype="auto", head_rows=heads)
        total = sum(r.size for node in manifest.nodes for r in node) + manifest.globals.size
        copies = sum(r.size for r in manifest.heads)
        print(
            f"\n{n} node(s): shards {total / 1e6:.1f} MB and the workers' lm_head rows "
            f"{copies / 1e6:.1f} MB, file {file / 1e6:.1f} MB: {total / file:.3f}"
        )
        assert abs(total / file - 1) <= 0.05, (n, total, file)


def test_a_step_after_rejected_drafts_reads_the_window_it_had_before_them(gemma3_path):
    """Past the window, a token and seven drafts write eight ring positions, whose old keys the
    next tokens still read: in one step (a target checking drafts: slot 1), or a token a step
    (a draft model making them: slot 2). Taking back the drafts (the next step starts after the
    token) puts them back: that step's logits are those of a run without the drafts (slot 0)."""
    source = open_model(gemma3_path)
    window = source.config.sliding_window
    prompt = source.tokenizer().encode(LONG_TEXT)
    n = len(prompt)
    assert window is not None and n > window + 16, n
    engine = Engine.local(source, max_context=1024, slots=3)
    engine.forward([prompt] * 3, StepBatch((0, 1, 2), (0, 0, 0), (n, n, n)))
    token, drafts, following = 1000, [7, 8, 9, 10, 11, 12, 13], 2000
    engine.forward([[token]], StepBatch((0,), (n,), (1,)))  # no drafts
    engine.forward([[token, *drafts]], StepBatch((1,), (n,), (8,)))  # all rejected
    for i, t in enumerate([token, *drafts]):
        engine.forward([[t]], StepBatch((2,), (n + i,), (1,)))
    plain = engine.forward([[following]], StepBatch((0,), (n + 1,), (1,)))
    for slot, steps in ((1, "one step"), (2, "a token a step")):
        taken_back = engine.forward([[following]], StepBatch((slot,), (n + 1,), (1,)))
        diff, scale = (taken_back - plain).abs().max().item(), plain.abs().max().item()
        print(f"\nafter rejected drafts, {steps}: max|diff| {diff:.3g} vs max|logit| {scale:.3g}")
        assert diff <= 1e-4 * scale, steps


def test_a_draft_model_with_rings_changes_no_greedy_token(gemma3_path, shared_state):
    """`--draft MODEL` where the draft model has sliding-window rings: Gemma 3 270M's own
    weights rounded again to q4_0, drafting a token a step for the file, past the window: the
    same tokens as without drafts, some drafts accepted and some rejected. (That its rings take
    back what rejected drafts wrote is held exactly above, "a token a step".)"""
    source = open_model(gemma3_path)
    tokenizer = source.tokenizer()
    prompt = tokenizer.encode(LONG_TEXT + "\n\nNow a poem about the sea, in new words:\n")
    assert len(prompt) > source.config.sliding_window + 64, len(prompt)
    with local_session(
        source, 1, state_dir=shared_state, context=1024, memory=FILE_TYPES
    ) as session:
        assert session.engine is not None
        plain = _generate(session.engine, tokenizer, [prompt], None, max_tokens=48)
        speculator = open_speculator(str(gemma3_path), "q4_0", session, tokenizer)
        assert speculator is not None and speculator.model is not None
        by_model = SlowLinkSpeculator(speculator.model)
        try:
            drafted = _generate(session.engine, tokenizer, [prompt], by_model, max_tokens=48)
        finally:
            by_model.close()
    figures = by_model.figures()
    print(f"\n{figures}\n{tokenizer.decode(plain[0])!r}")
    assert drafted == plain
    assert 0 < figures["accepted"] < figures["drafted"], figures  # rejected drafts undone


@pytest.mark.parametrize("nodes", [1, 3])
def test_lookup_drafts_past_the_local_window_change_no_greedy_token(
    gemma3_path, shared_state, nodes
):
    """`--draft lookup` on a model with sliding-window rings: a text to repeat, long enough
    that each ring has wrapped before the first draft, continued greedily with and without
    drafts. The same tokens: the ring positions that rejected drafts overwrote were put back
    (node/kvcache.py, RingUndo), on the master's slice and on the workers'."""
    source = open_model(gemma3_path)
    tokenizer = source.tokenizer()
    window = source.config.sliding_window
    assert window is not None and source.config.local_layers
    # The text's paragraph again and again, numbered: after a number, lookup drafts the last
    # one's number (rejected, the model counts on), then the paragraph (accepted).
    paragraph = LONG_TEXT[: len(LONG_TEXT) // 9]
    prompt = tokenizer.encode("".join(f"{i}. {paragraph}\n" for i in range(1, 10)))
    assert len(prompt) > window + 64, len(prompt)  # the rings wrapped in the prompt already
    with (
        master_threads(nodes),
        local_session(
            source, nodes, state_dir=shared_state, context=1024, memory=FILE_TYPES
        ) as session,
    ):
        assert session.engine is not None
        plain = _generate(session.engine, tokenizer, [prompt], None, max_tokens=48)
        lookups = SlowLinkSpeculator()
        drafted = _generate(session.engine, tokenizer, [prompt], lookups, max_tokens=48)
    figures = lookups.figures()
    print(f"\n{nodes} node(s): {figures}\n{tokenizer.decode(plain[0])!r}")
    assert drafted == plain
    assert figures["accepted"] > 0, figures
    assert figures["accepted"] < figures["drafted"], figures  # rejected drafts were undone
