"""The engine against the transformers implementation of the same GGUF weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from edgetp.master.cluster.engine import Engine
from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import SamplingParams
from edgetp.master.generation.prompts import prompt_tokens
from edgetp.models.layers import StepBatch

pytestmark = pytest.mark.slow

LONG_TEXT = (
    "The history of computing is a story of machines growing smaller while problems grew larger. "
    "Early computers filled rooms and consumed kilowatts, yet could add only a few thousand "
    "numbers per second. Transistors replaced vacuum tubes, integrated circuits replaced parts, "
    "and the microprocessor put an entire central processing unit on a single chip. Each step "
    "made computation cheaper, and cheaper computation found new uses: payroll, weather "
    "forecasts, spreadsheets, games, the web, and finally language models that answer questions "
    "in plain English. Those models are large, often far larger than the memory of any one small "
    "device, which is why splitting them across several devices is worth the trouble. A cluster "
    "of old laptops, each holding a slice of every layer, can together run a model none of them "
    "could hold alone, provided the network between them is used sparingly and the slices are "
    "sized to what each machine can do. The slowest link sets the pace: every layer waits for "
    "the partial results of every device before the next layer can begin, so a single device "
    "on a congested wireless network can slow the whole cluster. Good planners measure each "
    "link and each processor before deciding who computes what."
)


@pytest.fixture(scope="module")
def engine(smollm2) -> Engine:
    return Engine.local(smollm2, slots=3)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> dict[str, list[int]]:
    tok = smollm2_tokenizer
    out = {
        "raw": tok.encode("The capital of France is"),
        "chat": prompt_tokens(tok, "What is the tallest mountain on Earth?", raw=False),
        "long": tok.encode(LONG_TEXT),
    }
    assert len(out["long"]) > 200, len(out["long"])
    return out


@pytest.fixture(scope="module")
def reference_logits(reference_model, prompts) -> dict[str, torch.Tensor]:
    """transformers' logits at every position of each prompt, computed once: the prefill test
    compares them all, the decode-step test their last row."""
    with torch.inference_mode():
        return {
            name: reference_model(torch.tensor([ids])).logits[0] for name, ids in prompts.items()
        }


def _full_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    batch = StepBatch((0,), (0,), (len(ids),))
    return engine.forward([ids], batch, all_logits=True)[0]


@torch.inference_mode()
def _reference_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = model(
            torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def _greedy(engine: Engine, tokenizer, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, ignore_eos=True)] * len(prompts)
    seqs = start(engine, prompts, params)
    for _ in stream(engine, tokenizer, seqs):
        pass
    return [g.tokens for g in seqs]


@pytest.mark.parametrize("name", ["raw", "chat", "long"])
def test_logits_match_transformers(engine, reference_logits, prompts, name):
    ids = prompts[name]
    ours = _full_logits(engine, ids)
    ref = reference_logits[name]
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"{name}: {len(ids)} tokens, max|diff| {diff:.3g}, max|logit| {scale:.3g}")
    assert diff <= 1e-3 * scale


@pytest.mark.parametrize("name", ["chat", "long"])
def test_decode_step_logits_match_transformers(engine, reference_logits, prompts, name):
    """A decode step (one new token: the NumPy rows path) against the reference's logits."""
    ids = prompts[name]
    engine.forward([ids[:-1]], StepBatch((0,), (0,), (len(ids) - 1,)))
    ours = engine.forward([ids[-1:]], StepBatch((0,), (len(ids) - 1,), (1,)))[0]
    ref = reference_logits[name][-1]
    diff = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(
        f"{name}: decode at position {len(ids) - 1}, max|diff| {diff:.3g}, max|logit| {scale:.3g}"
    )
    assert diff <= 1e-4 * scale


@pytest.mark.parametrize("name", ["raw", "chat"])
def test_greedy_64_tokens_match_transformers(
    engine, reference_model, smollm2_tokenizer, prompts, name
):
    ours = _greedy(engine, smollm2_tokenizer, [prompts[name]], 64)[0]
    theirs = _reference_greedy(reference_model, prompts[name], 64)
    assert ours == theirs


def test_batch_of_three_equals_each_alone(engine, smollm2_tokenizer, prompts):
    """Three prompts of different lengths share every step and still get their own answers."""
    batch_prompts = [prompts["raw"], prompts["chat"], prompts["long"]]
    together = _greedy(engine, smollm2_tokenizer, batch_prompts, 24)
    alone = [_greedy(engine, smollm2_tokenizer, [p], 24)[0] for p in batch_prompts]
    assert together == alone


def test_batched_prefill_logits_match_single(engine, prompts):
    seqs = [prompts["raw"], prompts["chat"], prompts["long"]]
    batch = StepBatch((0, 1, 2), (0, 0, 0), tuple(len(s) for s in seqs))
    together = engine.forward(seqs, batch)
    for b, ids in enumerate(seqs):
        single = engine.forward([ids], StepBatch((b,), (0,), (len(ids),)))[0]
        assert torch.allclose(together[b], single, atol=1e-4 * single.abs().max().item())
