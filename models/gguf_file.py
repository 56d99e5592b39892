"""Reading a GGUF file: its metadata as plain Python values and its tensors as float32 torch.

Quantized types are dequantized by the `gguf` package, one tensor at a time, so a caller that
asks for one layer's tensors never holds the whole model.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from models.errors import ModelError

GGUF_MAGIC = b"GGUF"
DEQUANT_ROWS = 2048


class GGUFFile:
    """An open GGUF file. Tensors are memory-mapped until asked for, then copied out."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"model file not found: {self.path}")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelError(
                f"{self.path} is not a GGUF file (it starts with {magic!r}, expected b'GGUF')"
            )
        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as exc:  # the reader raises bare ValueError/IndexError on short files
            raise ModelError(
                f"{self.path} is truncated or corrupt and cannot be read as GGUF ({exc})"
            ) from exc
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_tensor_extents()
        self.metadata: dict[str, Any] = {
            key: _field_value(field) for key, field in self._reader.fields.items()
        }

    def _check_tensor_extents(self) -> None:
        # A memmap over a truncated file can still be built; catch it here, not mid-generation.
        size = self.path.stat().st_size
        for t in self._tensors.values():
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise ModelError(
                    f"{self.path} is truncated: tensor {t.name} ends at byte {end} "
                    f"but the file has {size} bytes"
                )

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> torch.Tensor:
        """The named tensor, dequantized to float32, in PyTorch (out, in) order."""
        if name not in self._tensors:
            raise ModelError(f"{self.path} has no tensor named {name!r}")
        t = self._tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out = np.empty(shape, dtype=np.float32)
        rows = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data[None]
        flat = out.reshape(rows.shape[0], -1)
        # Dequantize a band of rows at a time: the gguf package's temporaries are several times
        # the output, and for a big embedding that would dwarf the tensor itself.
        try:
            for r in range(0, rows.shape[0], DEQUANT_ROWS):
                band = gguf.quants.dequantize(rows[r : r + DEQUANT_ROWS], t.tensor_type)
                flat[r : r + DEQUANT_ROWS] = band.reshape(flat[r : r + DEQUANT_ROWS].shape)
        except NotImplementedError as exc:
            raise ModelError(
                f"{self.path}: tensor {name} uses quantization {t.tensor_type.name}, "
                f"which the gguf package cannot dequantize"
            ) from exc
        self._release(t)
        return torch.from_numpy(out)

    def _release(self, t: gguf.ReaderTensor) -> None:
        """Drop the file pages just read: they are a copy on disk, not memory the model needs."""
        mm = getattr(self._reader.data, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = int(t.data_offset) + int(t.n_bytes)
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def _field_value(field: gguf.ReaderField) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value
