"""Every GGUF type the engine keeps, held to its own exact float expansion: the same weights
multiplied as the file's blocks (the default, `auto`) and expanded to float32 (`--dtype f32`)
give the same top-1 token, teacher-forced, at no fewer than 999 of every 1,000 positions of the
shard dtypes' 258-position check (tests/test_window.py). Gemma 3 270M's file brings Q4_K, Q6_K,
Q5_0 and Q8_0; SmolLM2's Q4_1 and Q8_0; SmolLM2 cut to its first layers, stored again in each
of the other formats (no bundled file stores them), brings Q4_0, Q5_0, Q5_1, MXFP4, IQ4_NL, Q2_K,
Q3_K, Q5_K and IQ4_XS.

Both sides compute the same values in other orders of summation, so their logits differ by float
rounding only (at most 3.1e-5 here; 1.4e-4 with all 30 of SmolLM2's layers in Q2_K, where the
kernels a device may choose differ). A position whose two best float32 logits are within `TIE`
is a tie that either order may break either way (those 30 Q2_K layers had one, 1.1e-5 apart,
the next closest 2.5e-3): it counts as agreeing when the block products choose one of the tied
tokens. Every logit is held to `LOGIT_TOLERANCE` besides, which a wrong product exceeds by far."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_window import POSITIONS_PER_TEXT, TEXTS

from edgetp.master.cluster.local import local_engine
from edgetp.memory.budget import MemoryOptions
from edgetp.models import kernels
from edgetp.models.bundled import BUNDLED_MODELS
from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.layers import StepBatch
from edgetp.models.quant import FORMATS
from edgetp.models.source import GGUFSource, ModelSource, open_model

pytestmark = pytest.mark.slow

AGREEMENT = 0.999
LOGIT_TOLERANCE = 1e-3  # float32 rounding of the same products in another order, any logit
TIE = 1e-4  # two best float32 logits this close: either order of summation may pick either
LAYER_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")
# SmolLM2's first layers, of its 30, stored again and the rest left out: every product of the
# format runs at every position all the same (top-1 agreement 1.0 in each format, logits at most
# 3.1e-5 apart), and the twelve tests take 43 s against 64 s with the other 22 layers kept as
# the file's (which its own test above covers)
RESTORED_LAYERS = 8


class StoredAs(GGUFSource):
    """A GGUF file cut to its first `RESTORED_LAYERS` layers, their matrices read as if the
    file stored them in block format `fmt`: the file's values quantized to it, handed out as
    those blocks or their values. Matrices whose rows are not whole blocks of it (SmolLM2's
    576-wide ones in a 256-weight format) stay as the file stores them."""

    def __init__(self, path, fmt: str) -> None:
        super().__init__(path)
        self.config = dataclasses.replace(self.config, n_layers=RESTORED_LAYERS)
        self.fmt = FORMATS[fmt]
        self._blocks: dict[tuple, torch.Tensor] = {}  # quantized once for both engines

    def _restored(self, layer, name) -> bool:
        if layer is None or name not in LAYER_MATRICES:
            return False
        return self.shape(layer, name)[1] % self.fmt.block_values == 0

    def _stored_type(self, layer, name):
        if self._restored(layer, name):
            return self.fmt.ggml_type.name
        return super()._stored_type(layer, name)

    def _rows(self, layer, name, start, stop, blocks):
        if not self._restored(layer, name):
            return super()._rows(layer, name, start, stop, blocks)
        at = (layer, name, start, stop)
        if at not in self._blocks:
            self._blocks[at] = self.fmt.quantize(super()._rows(layer, name, start, stop, False))
        stored = self._blocks[at]
        return stored if blocks else self.fmt.dequantize(stored)


def _logits(
    source: ModelSource, ids: list[list[int]], dtype: str, state_dir, formats: set[str]
) -> torch.Tensor:
    """Teacher-forced logits (positions, vocab) of texts `ids`, the engine's products on
    `formats` (their kernels used)."""
    memory = MemoryOptions(dtype=dtype)
    rows = []
    kernels.uninstall()  # the kernel table this process holds is only this engine's
    with local_engine(source, 1, state_dir=state_dir, context=128, memory=memory) as engine:
        used = {part.split(":")[0] for part in kernels.kernel_set().split("; ")}
        assert used == formats, (dtype, used)
        for text_ids in ids:
            logits = engine.forward(
                [text_ids], StepBatch((0,), (0,), (len(text_ids),)), all_logits=True
            )
            rows.append(logits[0])
        engine.close()
    return torch.cat(rows)


def _agreement(source: ModelSource, tmp_path, formats: set[str]) -> float:
    """Top-1 agreement of the block products with the float32 products; a float32 tie (module
    docstring) agrees when the block products pick one of its tokens."""
    tokenizer = source.tokenizer()  # built once: Gemma's takes seconds
    ids = [tokenizer.encode(text)[:POSITIONS_PER_TEXT] for text in TEXTS]
    assert [len(text) for text in ids] == [POSITIONS_PER_TEXT] * len(TEXTS)
    kept = _logits(source, ids, "auto", tmp_path / "auto", formats)
    exact = _logits(source, ids, "f32", tmp_path / "f32", {"f32"})
    assert kept.shape[0] >= 256
    largest = (kept - exact).abs().max().item()
    assert largest <= LOGIT_TOLERANCE, ("logits apart by", largest)
    chosen = kept.argmax(-1)
    best = exact.max(-1).values
    tied = exact.gather(-1, chosen[:, None])[:, 0] >= best - TIE
    agree = chosen == exact.argmax(-1)
    ties = int((tied & ~agree).sum())
    print(f"\nlogits at most {largest:.2e} apart; {ties} float32 tie(s) broken the other way")
    return (agree | tied).float().mean().item()


@pytest.mark.parametrize(
    ("model", "formats"),
    [(DEFAULT_MODEL, {"q4_1", "q8_0"}), ("gemma3-270m", {"q4_k", "q6_k", "q5_0", "q8_0"})],
)
def test_a_bundled_file_s_types_agree_with_their_float_values(model, formats, tmp_path):
    source = open_model(BUNDLED_MODELS[model]())
    agreement = _agreement(source, tmp_path, formats)
    print(f"\n{model}: top-1 agreement with its float expansion: {agreement:.4f}")
    assert agreement >= AGREEMENT, (model, agreement)


@pytest.mark.parametrize(
    "fmt",
    ["q4_0", "q5_0", "q5_1", "q8_0", "mxfp4", "iq4_nl", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
     "iq4_xs"],
)  # fmt: skip
def test_each_block_format_agrees_with_its_float_values(fmt, tmp_path):
    """SmolLM2's first layers in `fmt`; a 256-weight format holds their down projections (1536
    wide), the other matrices (576 wide) stay the file's Q4_1."""
    source = StoredAs(BUNDLED_MODELS[DEFAULT_MODEL](), fmt)
    # the matrices of the model's width stay the file's Q4_1 where its rows are not whole blocks
    kept = {"q4_1"} if source.config.hidden % FORMATS[fmt].block_values else set()
    agreement = _agreement(source, tmp_path, {fmt, "q8_0", *kept})  # embedding: the file's
    print(f"\nSmolLM2's first layers as {fmt}: top-1 agreement with float: {agreement:.4f}")
    assert agreement >= AGREEMENT, (fmt, agreement)
