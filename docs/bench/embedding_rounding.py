"""Run: .venv/bin/python docs/bench/embedding_rounding.py

Teacher-forced top-1 agreement of SmolLM2 (1 node, f32 engine from the file's weights) when only
the tied embedding/lm_head is rounded again to another block format (fake quantization)."""

import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
from test_window import _teacher_forced_top1  # noqa: E402

from edgetp.master.cluster.local import local_engine  # noqa: E402
from edgetp.models.bundled import model_path  # noqa: E402
from edgetp.models.source import open_model  # noqa: E402

path = open_model(model_path(None))
tok = path.tokenizer()
with local_engine(path, 1, context=128) as engine:
    base = _teacher_forced_top1(engine, tok)
    original = engine.embedding.clone()
    for name, t, bits in (("q5_0", T.Q5_0, 5.5), ("q5_1", T.Q5_1, 6.0), ("q4_1", T.Q4_1, 5.0)):
        w = original.float().numpy()
        r = torch.from_numpy(quants.dequantize(quants.quantize(w, t), t).astype(np.float32))
        engine.embedding.copy_(r)
        if engine.lm_head.data_ptr() != engine.embedding.data_ptr():
            engine.lm_head.copy_(r)
        top = _teacher_forced_top1(engine, tok)
        agreement = (top == base).float().mean().item()
        mb = w.size * bits / 8 / 1e6
        print(f"{name}: embedding {mb:.1f} MB, agreement {agreement:.4f} over {base.numel()}")
    engine.embedding.copy_(original)
