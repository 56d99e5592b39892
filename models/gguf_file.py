"""Reading a GGUF file: its metadata as plain Python values and its tensors as float32 torch.

The header (metadata and tensor table) is parsed here with `struct`, following the GGUF spec:
the `gguf` package's reader builds a numpy view per value, which for a 49k-token vocabulary costs
seconds at every process start. Quantized tensors are dequantized by the `gguf` package's
arithmetic (`models.quant.dequantize_rows`), so a caller that asks for one layer's tensors never
holds the whole model.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch

from edgetp.models.bundled import GGUF_MAGIC, check_kind
from edgetp.models.errors import ModelError
from edgetp.models.quant import dequantize_rows

if TYPE_CHECKING:
    from edgetp.models.ranges import RemoteFile

GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Metadata value types, numbered as in the GGUF spec: scalars by struct format; 8 is a string and
# 9 an array.
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numbers; any other type is rows of quantized blocks, kept as bytes.
_PLAIN_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the file's tensor table: where its bytes are and how to read them."""

    name: str
    shape: tuple[int, ...]  # PyTorch (out, in) order; the file lists the innermost first
    tensor_type: gguf.GGMLQuantizationType
    data_offset: int  # from the start of the file
    n_bytes: int
    part: int = 0  # which file of a split GGUF holds it (0: the first, or the only one)


# llama.cpp's gguf-split: the first file's keys name the split; each file is a GGUF of its own
SPLIT_INDEX, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_SPLIT_NAME = re.compile(r"-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
HEADER_FIRST_READ = 1 << 20  # a remote header is read in a MiB, then twice as much until whole


class GGUFFile:
    """An open GGUF file. Tensors are memory-mapped until asked for, then copied out.

    A file may be the sparse local mirror of one on the hub (models/ranges.py): given in
    `remotes` by file name (the file's, or each part's of a split), else found by the record
    beside it. Its header's bytes and each read's are fetched before they are read. A reader
    that will cut only some columns of a matrix says which (`only_columns`), and only those
    bytes of its rows are fetched."""

    def __init__(self, path: str | Path, remotes: dict[str, RemoteFile] | None = None) -> None:
        self.path = Path(path)
        self._given = remotes
        self.remotes: list[RemoteFile | None] = []  # a part's mirror, by part
        self._columns: dict[str, tuple[int, int]] = {}  # tensor -> bytes of each row read
        if not self.path.is_file():
            raise ModelError(f"model file not found: {self.path}")
        self.metadata: dict[str, Any] = {}
        self._tensors: dict[str, TensorInfo] = {}
        self._maps: list[mmap.mmap] = []
        self.paths = [self.path]
        self._open_part(self.path, 0)
        count = int(self.metadata.get(SPLIT_COUNT, 1))
        if count > 1:  # a split GGUF (llama.cpp's gguf-split): the other parts beside it
            match = _SPLIT_NAME.search(self.path.name)
            if match is None or int(match["part"]) != 1 or int(match["count"]) != count:
                raise ModelError(
                    f"{self.path} is part of a GGUF split in {count} files: open its first "
                    f"part, named ...-00001-of-{count:05d}.gguf"
                )
            stem = self.path.name[: match.start()]
            for k in range(1, count):
                self.paths.append(self.path.with_name(f"{stem}-{k + 1:05d}-of-{count:05d}.gguf"))
                self._open_part(self.paths[k], k)
            expected = self.metadata.get(SPLIT_TENSORS)
            if expected is not None and expected != len(self._tensors):
                raise ModelError(
                    f"{self.path}: the split's {count} files hold {len(self._tensors)} tensors "
                    f"of the {expected} its first part lists: a part is missing or of another split"
                )

    def _open_part(self, path: Path, part: int) -> None:
        """Map one file of the model and read its header: the first's metadata is the model's,
        every part's tensor table adds to the model's."""
        if self._given is not None:
            remote = self._given.get(path.name)
        else:
            from edgetp.models.ranges import RemoteFile

            remote = RemoteFile.reopen(path)
        self.remotes.append(remote)
        if remote is not None:
            fetch_header(remote)
        if not path.is_file():
            raise ModelError(
                f"model file not found: {path} (part {part + 1} of the split {self.path})"
            )
        check_kind(path)
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            metadata, tensors = _read_header(mapped)
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            raise ModelError(
                f"{path} is truncated or corrupt and cannot be read as GGUF ({exc})"
            ) from exc
        if part and metadata.get(SPLIT_INDEX) != part:
            raise ModelError(f"{path} is not part {part + 1} of the split {self.path}")
        self._maps.append(mapped)
        if part == 0:
            self.metadata = metadata
        for name, t in tensors.items():
            if name in self._tensors:
                raise ModelError(f"{path}: tensor {name} is in two parts of the split")
            self._tensors[name] = replace(t, part=part)
            end = t.data_offset + t.n_bytes
            if end > len(mapped):  # a map over a truncated file can still be built
                raise ModelError(
                    f"{path} is truncated: tensor {t.name} ends at byte {end} "
                    f"but the file has {len(mapped)} bytes"
                )

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> TensorInfo:
        """Where the named tensor is, its shape and its type, as the header says."""
        if name not in self._tensors:
            raise ModelError(f"{self.path} has no tensor named {name!r}")
        return self._tensors[name]

    def stored_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of the named tensor's bytes as stored (a copy), a row per output
        row: numbers, or quantized blocks."""
        t = self.info(name)
        self._ensure(t, start, stop)
        rows = np.array(self._stored_rows(t)[start:stop])
        self._release(t)
        return rows

    def tensor(self, name: str) -> torch.Tensor:
        """The named tensor, dequantized to float32, in PyTorch (out, in) order."""
        t = self.info(name)
        return self.tensor_rows(name, 0, t.shape[0]).view(t.shape)

    def tensor_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the named tensor, dequantized to float32: of its first
        dimension, or of a stack's (experts, out, in) rows one after another."""
        t = self.info(name)
        if len(t.shape) > 1:
            self._ensure(t, start, stop)
            rows = self._stored_rows(t)[start:stop]
        else:
            self._ensure(t, 0, 1)
            rows = self._stored_rows(t)
        try:
            out = dequantize_rows(rows, t.tensor_type)
        except NotImplementedError as exc:
            raise ModelError(
                f"{self.path}: tensor {name} uses quantization {t.tensor_type.name}, "
                f"which the gguf package cannot dequantize"
            ) from exc
        self._release(t)
        if len(t.shape) == 1:
            return torch.from_numpy(out).view(-1)[start:stop].clone()
        return torch.from_numpy(out).view(stop - start, t.shape[-1])

    def only_columns(self, name: str, cols: tuple[int, int] | None) -> None:
        """Only columns `cols` [first, last) of the named matrix's rows will be used (None: all
        of them): a remote file fetches just the blocks that hold them (the rest of each row
        reads as zeros, which its reader never uses)."""
        t = self.info(name)
        if cols is None or len(t.shape) < 2 or cols == (0, t.shape[-1]):
            self._columns.pop(name, None)
            return
        block_size, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        self._columns[name] = (cols[0] // block_size * type_size,
                               -(-cols[1] // block_size) * type_size)  # fmt: skip

    def _ensure(self, t: TensorInfo, start: int, stop: int) -> None:
        """Fetch rows [start, stop) of `t` (of its flattened rows; a vector's whole) into a
        remote file's mirror, those of its columns only where a reader said so."""
        remote = self.remotes[t.part]
        if remote is None:
            return
        from edgetp.models.ranges import tensor_runs

        n_rows = int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
        columns = self._columns.get(t.name)
        remote.ensure(tensor_runs(t.data_offset, t.n_bytes // n_rows, (start, stop), columns))

    def _stored_rows(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as stored, a row per output row: numbers, or quantized blocks."""
        n_rows = int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
        dtype = _PLAIN_DTYPES.get(t.tensor_type, np.uint8)
        count = t.n_bytes // np.dtype(dtype).itemsize
        data = np.frombuffer(self._maps[t.part], dtype=dtype, count=count, offset=t.data_offset)
        return data.reshape(n_rows, -1)

    def _release(self, t: TensorInfo) -> None:
        """Drop the file pages just read: they are a copy on disk, not memory the model needs."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        self._maps[t.part].madvise(mmap.MADV_DONTNEED, start, t.data_offset + t.n_bytes - start)


def fetch_header(remote: RemoteFile) -> None:
    """Fetch a remote GGUF's header (its metadata and tensor table): a MiB, then twice as much
    until it parses whole."""
    size = min(HEADER_FIRST_READ, remote.remote.size)
    while True:
        remote.ensure([(0, size)])
        with open(remote.local, "rb") as f:
            head = f.read(size)
        if head[: len(GGUF_MAGIC)] != GGUF_MAGIC:
            raise ModelError(f"{remote.remote.url} is not a GGUF file (no GGUF magic)")
        try:
            _read_header(head)
            return
        except (struct.error, ValueError, UnicodeDecodeError):
            if size >= remote.remote.size:
                raise
        size = min(2 * size, remote.remote.size)


class _Cursor:
    """Reads GGUF's little-endian values one after another from the file's leading bytes."""

    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind in _SCALAR_FORMATS:  # numbers: one read, not one per item
                dtype = np.dtype(_SCALAR_FORMATS[item_kind])
                items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += items.nbytes
                return items.tolist()
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.scalar(_SCALAR_FORMATS[kind])


def _read_header(buf: mmap.mmap | bytes) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """The metadata and the tensor table, with each tensor's offset from the file's start."""
    cur = _Cursor(buf)
    cur.pos = len(GGUF_MAGIC)
    version = cur.scalar("<I")
    if version not in GGUF_VERSIONS:
        raise ValueError(f"GGUF version {version}; this reader knows versions {GGUF_VERSIONS}")
    n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_fields):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        tensor_type = gguf.GGMLQuantizationType(cur.scalar("<I"))
        table.append((name, tuple(reversed(dims)), tensor_type, cur.scalar("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, tensor_type, offset in table:
        if name in tensors:
            raise ValueError(f"tensor {name} is listed twice")
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        n_elements = int(np.prod(shape, dtype=np.int64))
        if shape and shape[-1] % block_size:
            raise ValueError(f"tensor {name}: rows of {shape[-1]} are not whole blocks")
        n_bytes = n_elements // block_size * type_size
        tensors[name] = TensorInfo(name, shape, tensor_type, data_start + offset, n_bytes)
    return metadata, tensors
