"""Embeddings from the engine (master/generation/embedding.py): the final norm's output,
mean-pooled over the input's tokens, length 1. Held to transformers' implementation of the same
GGUF weights (its `last_hidden_state` is after the final norm too), and at two nodes, whose
layers are sums across the wire, to one. The bridge's route is tested through the openai and
LangChain clients in tests/test_bridge_clients.py."""

from __future__ import annotations

import pytest
import torch

from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.local import local_engine
from edgetp.master.generation.embedding import chunk, embed_step

pytestmark = pytest.mark.slow

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tensor parallelism splits every layer across several devices, which sum their partials.",
    "Paris",  # one token: a step of rows, the decode path
    "A cluster of old laptops can run a model none of them could hold alone.",
]


@pytest.fixture(scope="module")
def inputs(smollm2_tokenizer) -> list[list[int]]:
    out = [smollm2_tokenizer.encode(t) for t in TEXTS]
    assert len(out[2]) == 1 and len({len(t) for t in out}) > 2, [len(t) for t in out]
    return out


@pytest.fixture(scope="module")
def one_node(smollm2, inputs) -> list[torch.Tensor]:
    engine = Engine.local(smollm2, max_context=256, slots=len(TEXTS))
    batched = embed_step(engine, inputs, range(len(inputs)))
    # each alone, in another slot: the batch's padding and neighbours change nothing
    alone = [embed_step(engine, [t], [(i + 1) % len(TEXTS)])[0] for i, t in enumerate(inputs)]
    engine.close()
    for b, a in zip(batched, alone, strict=True):
        assert torch.allclose(torch.from_numpy(b), torch.from_numpy(a), atol=1e-5)
    return [torch.from_numpy(v) for v in batched]


@torch.inference_mode()
def test_an_embedding_is_the_reference_last_hidden_state_mean_pooled(
    one_node, inputs, reference_model
):
    for ours, ids in zip(one_node, inputs, strict=True):
        hidden = reference_model.model(torch.tensor([ids])).last_hidden_state[0]  # (T, D)
        ref = torch.nn.functional.normalize(hidden.double().mean(0), dim=0)
        assert ours.dtype == torch.float32 and ours.shape == ref.shape
        assert abs(ours.double().norm().item() - 1) < 1e-5
        cosine = torch.dot(ours.double(), ref).item()
        assert cosine >= 0.9999, cosine
    # Different texts, different directions: a pooled vector is not one constant.
    assert torch.dot(one_node[0], one_node[1]).item() < 0.999


def test_two_nodes_embed_as_one(smollm2, inputs, one_node, shared_state):
    with local_engine(smollm2, 2, state_dir=shared_state, context=256, slots=4) as engine:
        assert engine.remote is not None
        split = embed_step(engine, inputs, range(len(inputs)))
    for ours, ref in zip(split, one_node, strict=True):
        assert torch.allclose(torch.from_numpy(ours), ref, atol=1e-5), ours - ref.numpy()


def test_a_step_takes_what_the_free_slots_and_its_token_budget_hold():
    assert chunk([5, 5, 5], 2) == 2
    assert chunk([5, 5, 5], 8) == 3
    assert chunk([4000, 10], 4) == 1  # 2 x 4000 padded tokens are over the step's budget
    assert chunk([9000], 4) == 1  # one input always goes, whatever its length
