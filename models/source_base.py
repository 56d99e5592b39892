"""A model source's interface: its config, tokenizer and canonical tensors read on demand,
and the rules every kind of file shares (`models.source` opens one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from edgetp.models.config import ModelConfig
from edgetp.models.dtypes import embedding_dtype, fitting_dtype, matrix_dtype
from edgetp.models.families import family_of
from edgetp.models.layers import (
    MATRICES,
    POST_NORM_TENSORS,
    POST_NORMS,
    ROUTER,
    ROUTER_BIAS,
    SHARED_ROUTER,
    Slice,
    full_layer_shapes,
    layer_tensor_names,
    slice_parts,
)
from edgetp.models.quant import BLOCK, FORMATS
from edgetp.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from edgetp.models.ranges import RemoteModel


class ModelSource(ABC):
    """A model's config, tokenizer and full tensors, read on demand: whole, or a band of rows
    at a time (`rows`), as float32 or, where the source stores one of the engine's block
    formats and the caller asks for it, as those blocks byte for byte."""

    path: Path
    config: ModelConfig

    @property
    def name(self) -> str:
        return self.path.name

    @abstractmethod
    def tokenizer(self) -> Tokenizer: ...

    def stored_type(self, layer: int | None, name: str) -> str:
        """How the source stores a tensor: a GGUF type name, or F32, F16, BF16. `name` is a
        canonical layer tensor (`layer` its index) or, with `layer` None, "embedding",
        "lm_head", "final_norm", POST_NORMS or ROUTER."""
        family = family_of(self.config)
        if layer is None and name in (POST_NORMS, ROUTER):
            return "F32"  # the master's, as float32
        if layer is None and family.gathered(name):
            return "F32"  # the master's, gathered from each layer's, as float32
        if layer is not None and family.absent(self.config, layer, name):
            # zeros hold in any format (each has a quantizer): the matrix keeps its queries'
            return self._stored_type(layer, "q")
        if layer is not None:
            name = family.stored_name(self.config, layer, name)
        return self._stored_type(layer, name)

    def rows(
        self, layer: int | None, name: str, start: int, stop: int, blocks: bool = False
    ) -> torch.Tensor:
        """Rows [start, stop) of a tensor (named as in `stored_type`): float32, or with `blocks`
        the stored blocks where they are in one of models.quant's formats. Q and K rows come in
        whole heads."""
        if name == POST_NORMS:  # row 2 i: layer i's post-attention norm, 2 i + 1: post-FFN
            return torch.stack(
                [self.tensor(r // 2, POST_NORM_TENSORS[r % 2]) for r in range(start, stop)]
            )
        family = family_of(self.config)
        gathered = family.global_rows(self, name, start, stop) if layer is None else None
        if gathered is not None:
            return gathered
        if layer is not None and family.absent(self.config, layer, name):
            return torch.zeros(self.shape(layer, name))[start:stop]
        if layer is not None:
            name = family.stored_name(self.config, layer, name)
        if layer is None and name == ROUTER:  # rows e of layer i at i router_rows + e
            n = self.config.router_rows
            layers = range(start // n, (stop - 1) // n + 1)
            bands = [self._router(i, max(start - i * n, 0), min(stop - i * n, n)) for i in layers]
            return torch.cat(bands)
        return self._rows(layer, name, start, stop, blocks)

    def _router(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a layer's rows of ROUTER: its router's, then its shared
        expert's gate; a router's bias (gpt-oss) as their last column."""
        n = self.config.n_experts
        bands = [self._rows(layer, ROUTER, start, min(stop, n), False)] if start < n else []
        if stop > n:  # the shared expert's gate, row n
            bands.append(self._rows(layer, SHARED_ROUTER, 0, 1, False))
        rows = torch.cat(bands)
        if self.config.router_bias:
            bias = self._rows(layer, ROUTER_BIAS, start, stop, False)
            rows = torch.cat((rows, bias.view(-1, 1)), dim=1)
        return rows

    @abstractmethod
    def _stored_type(self, layer: int | None, name: str) -> str: ...

    @abstractmethod
    def _rows(
        self, layer: int | None, name: str, start: int, stop: int, blocks: bool
    ) -> torch.Tensor: ...

    def weight_files(self) -> list[Path]:
        """The files its weights are read from: a GGUF's (each part of a split one), or an HF
        folder's safetensors."""
        if self.path.is_file():
            return [self.path]
        return sorted(self.path.glob("*.safetensors"))

    def remote(self) -> RemoteModel | None:
        """The files on the hub this source reads by byte ranges (models/ranges.py), if any."""
        return None

    def fetched(self) -> None:
        """A split is done reading: a source fetched from afar records what it holds."""
        return None

    def only_columns(self, layer: int | None, name: str, cols: tuple[int, int] | None) -> None:
        """Only columns `cols` of the tensor's rows will be read hereafter (None: all of
        them): a source that fetches its bytes from afar (a GGUF by ranges) fetches just those.
        `name` as in `stored_type`; a tensor made here (gathered, absent) fetches nothing."""
        family = family_of(self.config)
        if layer is None and (name in (POST_NORMS, ROUTER) or family.gathered(name)):
            return
        if layer is not None and family.absent(self.config, layer, name):
            return
        if layer is not None:
            name = family.stored_name(self.config, layer, name)
        self._only_columns(layer, name, cols)

    def _only_columns(self, layer: int | None, name: str, cols: tuple[int, int] | None) -> None:
        return None  # a local file's bytes are all there

    def shape(self, layer: int | None, name: str) -> tuple[int, ...]:
        c = self.config
        if layer is not None:
            return full_layer_shapes(family_of(c).layer_config(c, layer), layer)[name]
        if name == POST_NORMS:
            return (2 * c.n_layers, c.hidden)
        if name == ROUTER:
            return (c.n_layers * c.router_rows, c.router_columns)
        if name in family_of(c).global_names(c):
            return family_of(c).global_shape(c, name)
        return (c.hidden,) if name == "final_norm" else (c.vocab_size, c.hidden)

    def tensor(self, layer: int | None, name: str, blocks: bool = False) -> torch.Tensor:
        return self.rows(layer, name, 0, self.shape(layer, name)[0], blocks)

    def layer(self, index: int, blocks: bool = False) -> dict[str, torch.Tensor]:
        """Layer `index`'s full tensors under canonical names."""
        return {name: self.tensor(index, name, blocks) for name in self.layer_tensors(index)}

    def layer_tensors(self, index: int | None = None) -> tuple[str, ...]:
        # the post norms and router are the master's
        return layer_tensor_names(self.config, index)

    def global_names(self) -> list[str]:
        """The tensors the master holds whole: the embedding, lm_head and norms after the
        layers' sums."""
        c = self.config
        return (
            ["final_norm", "embedding"]
            + ([] if c.tied_embeddings else ["lm_head"])
            + ([POST_NORMS] if c.post_norms else [])
            + ([ROUTER] if c.moe else [])
            + family_of(c).global_names(c)
        )

    def embedding(self) -> torch.Tensor:
        """(vocab, hidden)."""
        return self.tensor(None, "embedding")

    def final_norm(self) -> torch.Tensor:
        return self.tensor(None, "final_norm")

    def lm_head(self) -> torch.Tensor:
        """(vocab, hidden); the embedding itself when the model ties them."""
        return self.tensor(None, "lm_head")

    def rope_freq_factors(self) -> torch.Tensor | None:
        return None

    def matrix_dtypes(self, layer: int, dtype: str) -> dict[str, str]:
        """The shard dtype of each of a layer's fused matrices (`models.layers.MATRICES`) when
        the split asks for `dtype` (`auto`: as this source stores them; a format of blocks of
        256 whose rows are not whole blocks: its stand-in, `models.dtypes.STAND_INS`)."""
        parts = slice_parts(self.config, Slice.whole(self.config), layer)
        return {
            m: fitting_dtype(
                matrix_dtype(dtype, [self.stored_type(layer, p.source) for p in parts[m]]),
                self.shape(layer, parts[m][0].source)[-1],
            )
            for m in MATRICES
        }

    def ffn_align(self, dtype: str) -> int:
        """The columns a plan cuts the FFN in multiples of, for a split at `dtype`: the widest
        block of any layer's down projection (256 for a K-quant file's), so that every node's
        slice of it is whole blocks of the file's own."""
        return max(
            FORMATS[d].block_values if d in FORMATS else BLOCK
            for layer in range(self.config.n_layers)
            for d in [self.matrix_dtypes(layer, dtype)["w_down"]]
        )

    def head_dtype(self, dtype: str) -> str:
        """The shard dtype of the embedding and lm_head when the split asks for `dtype`."""
        asked = embedding_dtype(dtype, self.stored_type(None, "embedding"))
        return fitting_dtype(asked, self.config.hidden)


# Where a fused family (Phi-3) stores the canonical matrices: Q, K, V one after another in one
# matrix, gate then up in another; `fused_rows` gives each one's first row.
GGUF_FUSED = {
    "q": "attn_qkv.weight",
    "k": "attn_qkv.weight",
    "v": "attn_qkv.weight",
    "gate": "ffn_up.weight",
    "up": "ffn_up.weight",
}
HF_FUSED = {
    "q": "self_attn.qkv_proj.weight",
    "k": "self_attn.qkv_proj.weight",
    "v": "self_attn.qkv_proj.weight",
    "gate": "mlp.gate_up_proj.weight",
    "up": "mlp.gate_up_proj.weight",
}


def fused_rows(config: ModelConfig, layer: int | None, name: str) -> int:
    """The row of its fused matrix at which canonical tensor `name` starts (0 where the model
    stores it on its own)."""
    if not config.fused or layer is None or name not in GGUF_FUSED:
        return 0
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    return {"q": 0, "k": q, "v": q + kv, "gate": 0, "up": config.ffn_hidden}[name]
