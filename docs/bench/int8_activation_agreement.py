"""Teacher-forced top-1 agreement over the shard dtypes' 258 positions (tests/test_window.py) of
the bundled models with their activations rounded to int8 per 32 (as llama.cpp's Q8_0 and Q8_K
activations are) before every block product, against the exact product of the file's values.
Run from the repository: .venv/bin/python docs/bench/int8_activation_agreement.py"""

import sys
from pathlib import Path

import numpy as np
import torch

from edgetp.master.cluster.local import local_engine
from edgetp.memory.budget import MemoryOptions
from edgetp.models import block_rows, kernels
from edgetp.models.bundled import BUNDLED_MODELS
from edgetp.models.layers import StepBatch
from edgetp.models.quant import FORMATS, block_format
from edgetp.models.source import ModelSource, open_model

sys.path.insert(0, "tests")
from test_window import POSITIONS_PER_TEXT, TEXTS  # noqa: E402 (the check's own texts)

exact_rows = kernels.linear_rows


def rounded_rows(x, w, bias=None, scale=None):  # noqa: ANN001, ANN201
    """The product with x rounded to int8 per 32 first, as llama.cpp's activations are."""
    if block_format(w) is not None and x.shape[1] % 32 == 0:
        q8 = FORMATS["q8_0"]
        x = q8.dequantize(q8.quantize(torch.from_numpy(np.ascontiguousarray(x)))).numpy()
    return exact_rows(x, w, bias, scale)


def top1(source: ModelSource, state: Path) -> torch.Tensor:
    tokenizer, tops = source.tokenizer(), []
    memory = MemoryOptions(dtype="auto")
    with local_engine(source, 1, state_dir=state, context=128, memory=memory) as engine:
        for text in TEXTS:
            ids = tokenizer.encode(text)[:POSITIONS_PER_TEXT]
            logits = engine.forward([ids], StepBatch((0,), (0,), (len(ids),)), all_logits=True)
            tops.append(logits[0].argmax(-1))
        engine.close()
    return torch.cat(tops)


for model in ("gemma3-270m", "smollm2-135m-instruct"):
    source = open_model(BUNDLED_MODELS[model]())
    state = Path(f"/tmp/int8-agreement-{model}")
    exact = top1(source, state)
    kernels.linear_rows = block_rows.linear_rows = rounded_rows
    rounded = top1(source, state)
    kernels.linear_rows = block_rows.linear_rows = exact_rows
    agreement = (exact == rounded).float().mean().item()
    print(f"{model}: int8 activations agree with the exact product at {agreement:.4f}")
