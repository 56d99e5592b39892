"""Reading a GGUF file: its metadata as plain Python values and its tensors as float32 torch.

Quantized types are dequantized by the `gguf` package, one tensor at a time, so a caller that
asks for one layer's tensors never holds the whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from models.errors import ModelError

GGUF_MAGIC = b"GGUF"


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
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise ModelError(
                f"{self.path}: tensor {name} uses quantization {t.tensor_type.name}, "
                f"which the gguf package cannot dequantize"
            ) from exc
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
        if not array.flags.writeable:  # float32 tensors come back as views of the mmap: copy out
            array = array.copy()
        return torch.from_numpy(array)


def _field_value(field: gguf.ReaderField) -> Any:
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value
