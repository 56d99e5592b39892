"""Shared fixtures: the bundled model, loaded once per test session."""

from __future__ import annotations

import pytest
import torch

from models.kernels import set_threads
from models.source import DEFAULT_MODEL, GGUFSource, ModelSource, open_model

set_threads()


@pytest.fixture(scope="session")
def smollm2() -> ModelSource:
    return open_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    return smollm2.tokenizer()


@pytest.fixture(scope="session")
def reference_model(smollm2):
    """The transformers implementation of the same GGUF, fp32: the independent reference."""
    from transformers import AutoModelForCausalLM

    assert isinstance(smollm2, GGUFSource)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2.path.parent, gguf_file=smollm2.path.name, dtype=torch.float32
    )
    return model.eval()
