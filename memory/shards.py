"""Shard files on a device: one safetensors file per (node, layer), named by content hash.

A shard's name is the sha256 of its bytes, so a device that already holds a file with the right
name and content never fetches it again, and a corrupt file is caught by re-hashing it. Every
write goes to a temporary file that is renamed into place: a crash never leaves a half file
under a real name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from edgetp.memory.files import atomic_write
from edgetp.memory.pages import DATA_ALIGN, weight_buffer
from edgetp.models.errors import ModelError

HASH_CHUNK = 1 << 20
_TORCH_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
}
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
}


Spec = tuple[torch.dtype, tuple[int, ...]]  # a tensor's dtype and shape


def _layout(specs: dict[str, Spec]) -> tuple[bytes, dict[str, int]]:
    """A safetensors header for tensors of these specs, and where each one's data starts (from
    the end of the header).

    Largest first, after a header padded to DATA_ALIGN: the big matrices (whose sizes are
    multiples of 64 bytes in every model seen) then start on 64-byte boundaries, so a reader
    can view them in place; the int8 kernel needs that alignment (it crashes without it).
    """
    size = {
        n: math.prod(shape) * torch.empty((), dtype=d).element_size()
        for n, (d, shape) in specs.items()
    }
    header: dict[str, Any] = {}
    offsets = {}
    offset = 0
    for name in sorted(specs, key=lambda n: -size[n]):
        dtype, shape = specs[name]
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size[name]],
        }
        offsets[name] = offset
        offset += size[name]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % DATA_ALIGN)  # the format allows padding with spaces
    return struct.pack("<Q", len(raw)) + raw, offsets


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write a safetensors file straight from the tensors' memory.

    `safetensors.torch.save_file` first copies every tensor into a bytes object; for the
    embedding of a big model that copy alone is hundreds of MB the splitter cannot spare.
    """
    header, offsets = _layout({n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()})
    with open(path, "wb") as f:
        f.write(header)
        for name in sorted(offsets, key=offsets.__getitem__):
            f.write(tensors[name].contiguous().view(torch.uint8).numpy().data)


class ShardWriter:
    """A shard written a band of rows at a time: the header first (every shape is known before
    any data), then each band at its place, so a matrix is never whole in memory."""

    def __init__(self, store: ShardStore, specs: dict[str, Spec]) -> None:
        self.store = store
        self.specs = specs
        header, offsets = _layout(specs)
        self._starts = {n: len(header) + o for n, o in offsets.items()}
        self._size = len(header) + sum(
            math.prod(shape) * torch.empty((), dtype=d).element_size()
            for d, shape in specs.values()
        )
        self._missing = {n: shape[0] for n, (_, shape) in specs.items()}  # rows not yet written
        self._tmp = store.root / f".incoming.{os.getpid()}.{id(self)}.tmp"
        self._file = open(self._tmp, "wb")
        self._file.write(header)
        self._file.truncate(self._size)

    def write_rows(self, name: str, first_row: int, rows: torch.Tensor) -> None:
        """Rows of tensor `name` (its first dimension) from `first_row` on."""
        dtype, shape = self.specs[name]
        if rows.dtype != dtype or tuple(rows.shape[1:]) != shape[1:]:
            raise ValueError(f"{name}: rows {rows.dtype} {tuple(rows.shape)} do not fit {shape}")
        row_bytes = math.prod(shape[1:]) * rows.element_size()
        self._file.seek(self._starts[name] + first_row * row_bytes)
        self._file.write(rows.contiguous().view(torch.uint8).numpy().data)
        self._missing[name] -= rows.shape[0]

    def finish(self) -> ShardRef:
        """Close the file and store it under its hash (see `ShardStore.put`), once every row of
        every tensor was written: a row left out would be zeros that compute without error."""
        unwritten = {n: rows for n, rows in self._missing.items() if rows}
        if unwritten:
            self.abandon()
            raise ValueError(f"shard left unwritten rows (tensor: rows): {unwritten}")
        self._file.close()
        return self.store.adopt(self._tmp)

    def abandon(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


def tensor_views(buffer: torch.Tensor, path: Path, size: int) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file read whole into `buffer`, as views of it (no copy)."""
    if size < 8:
        raise ModelError(f"shard {path} is truncated ({size} bytes)")
    (header_len,) = struct.unpack("<Q", buffer[:8].numpy().tobytes())
    if header_len > size - 8:
        raise ModelError(f"shard {path} is corrupt: its header runs past the end of the file")
    try:
        header = json.loads(buffer[8 : 8 + header_len].numpy().tobytes())
    except ValueError as exc:
        raise ModelError(f"shard {path} is corrupt: its header is not JSON ({exc})") from exc
    start = 8 + header_len
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        dtype = _TORCH_DTYPES.get(meta["dtype"])
        if dtype is None or start + end > size:
            raise ModelError(f"shard {path} is corrupt: tensor {name} is out of bounds")
        raw = buffer[start + begin : start + end]
        if raw.data_ptr() % DATA_ALIGN:  # not written by edgetp: one aligned copy
            raw = raw.clone()
        out[name] = raw.view(dtype).view(meta["shape"])
    return out


def tensor_specs(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Each tensor's dtype and shape in a safetensors file, from its header alone."""
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        return {
            name: (_TORCH_DTYPES[meta["dtype"]], tuple(meta["shape"]))
            for name, meta in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise ModelError(f"shard {path} is unreadable or corrupt ({exc})") from exc


class ShardChanged(ModelError):
    """A layer's shard file no longer holds the bytes it held when it was first read."""

    def __init__(self, layer: int, path: Path) -> None:
        super().__init__(
            f"shard {path} (layer {layer}) changed on disk since it was checked: fetch it "
            "again, or start again to re-split it"
        )
        self.layer = layer
        self.path = path


def read_into(f: Any, view: memoryview) -> int:
    """Fill `view` from the file; the bytes read (fewer only at the end of the file).

    One read returns at most about 2 GB on Linux, and may return less: loop.
    """
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def file_digests(path: Path) -> tuple[str, int]:
    """The file's sha256 (its name in a store) and xxh3 (what a streaming window checks each
    read against, at a thirtieth of the cost), in one pass."""
    digest, checksum = _hash_file(path, hashlib.sha256(), xxhash.xxh3_64())
    return digest.hexdigest(), checksum.intdigest()


def file_xxh3(path: Path) -> int:
    (checksum,) = _hash_file(path, xxhash.xxh3_64())
    return checksum.intdigest()


def _hash_file(path: Path, *hashes: Any) -> tuple[Any, ...]:
    with open(path, "rb") as f:
        while block := f.read(HASH_CHUNK):
            for h in hashes:
                h.update(block)
    return hashes


@dataclass(frozen=True)
class ShardRef:
    """A shard file as the manifest lists it."""

    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return f"{self.sha256}.safetensors"


class ShardStore:
    """A folder of content-addressed shard files."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, ref: ShardRef) -> Path:
        return self.root / ref.filename

    def partial_path(self, ref: ShardRef) -> Path:
        """Where an interrupted fetch keeps the bytes it has, to resume from."""
        return self.root / f"{ref.filename}.part"

    def put(self, tensors: dict[str, torch.Tensor]) -> ShardRef:
        """Store tensors as a shard; a shard with the same content is kept, not rewritten.

        Written to a temporary file and hashed from disk, so no second in-memory copy of the
        tensors is made (the embedding alone can be hundreds of MB).
        """
        tmp = self.root / f".incoming.{os.getpid()}.tmp"
        write_safetensors(tmp, tensors)
        return self.adopt(tmp)

    def adopt(self, tmp: Path) -> ShardRef:
        """A whole shard file written beside the store, renamed to its hash (removed instead
        when the store has it already)."""
        sha256, checksum = file_digests(tmp)
        ref = ShardRef(sha256, tmp.stat().st_size)
        if self.path(ref).exists():
            tmp.unlink()
        else:
            os.replace(tmp, self.path(ref))
            self.record(ref, checksum)
        return ref

    def present(self, refs: Iterable[ShardRef]) -> bool:
        """Whether every file is here at its size (a cheap check: their bytes are not read)."""
        return all(self.path(r).is_file() and self.path(r).stat().st_size == r.size for r in refs)

    def has_valid(self, ref: ShardRef) -> bool:
        """True when the file is present with the right size and content (read each time)."""
        return self.checksum(ref) is not None

    def checksum_path(self, ref: ShardRef) -> Path:
        return self.root / f"{ref.filename}.xxh3"

    def record(self, ref: ShardRef, checksum: int) -> None:
        """Keep the xxh3 of a file whose sha256 was just verified, for `checksum` to check it
        against."""
        atomic_write(self.checksum_path(ref), str(checksum).encode())

    def checksum(self, ref: ShardRef) -> int | None:
        """The file's xxh3 when it is present with the right size and content, else None.

        Read whole each time (a node loading its slice: a flipped byte means the file is
        fetched again), against the xxh3 recorded when its sha256 was verified: a fifth of a
        sha256's time (6.1 against 1.3 GB/s on a Zen 3 core), which a slice of gigabytes
        waits through at every join and re-plan. A file without that record is verified by
        its sha256, and recorded.
        """
        path = self.path(ref)
        if not path.is_file() or path.stat().st_size != ref.size:
            return None
        try:
            recorded = int(self.checksum_path(ref).read_text())
        except (OSError, ValueError):  # none yet, or unreadable: verify the file itself
            sha256, checksum = file_digests(path)
            if sha256 != ref.sha256:
                return None
            self.record(ref, checksum)
            return checksum
        return recorded if file_xxh3(path) == recorded else None

    def load(self, ref: ShardRef) -> dict[str, torch.Tensor]:
        """The shard's tensors, read into this process's memory.

        Read, not mmap'd: mapped pages would count as resident only as they are touched, so a
        node's memory would creep up token by token (the embedding, row by row) and a device
        that cannot hold them would thrash instead of failing up front.
        """
        path = self.path(ref)
        try:
            size = path.stat().st_size
            buffer = weight_buffer(size)
            with open(path, "rb", buffering=0) as f:
                got = read_into(f, buffer.numpy().data)
        except OSError as exc:
            raise ModelError(f"shard {path} cannot be read ({exc.strerror})") from exc
        if got != size:
            raise ModelError(f"shard {path} is truncated: {got} of {size} bytes")
        return tensor_views(buffer, path, size)


@dataclass
class Manifest:
    """What a split produced: the model, the plan, and every shard with its hash.

    `nodes[k][i]` is node k's shard of layer i; `globals` holds the embedding, final norm and
    lm_head, which stay on the master. With workers, node k multiplies rows `head_rows[k]` of
    the lm_head: the master from its globals (which hold only those rows of an untied head),
    worker k from its shard `heads[k - 1]`.
    """

    model: str
    identity: str
    config: dict[str, Any]
    slices: list[dict[str, list[int]]]
    nodes: list[list[ShardRef]]
    globals: ShardRef
    extra: dict[str, Any] = field(default_factory=dict)
    head_rows: list[list[int]] = field(default_factory=list)  # empty: the master's, all of it
    heads: list[ShardRef] = field(default_factory=list)

    def head_size(self, node: int) -> int:
        """Bytes of worker `node`'s rows of the lm_head (0 where the head is not split)."""
        return self.heads[node - 1].size if self.heads else 0

    def to_json(self) -> str:
        return json.dumps(
            {
                "model": self.model,
                "identity": self.identity,
                "config": self.config,
                "slices": self.slices,
                "nodes": [[vars(r) for r in node] for node in self.nodes],
                "globals": vars(self.globals),
                "extra": self.extra,
                "head_rows": self.head_rows,
                "heads": [vars(r) for r in self.heads],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        return cls(
            model=d["model"],
            identity=d["identity"],
            config=d["config"],
            slices=d["slices"],
            nodes=[[ShardRef(**r) for r in node] for node in d["nodes"]],
            globals=ShardRef(**d["globals"]),
            extra=d.get("extra", {}),
            head_rows=d.get("head_rows", []),
            heads=[ShardRef(**r) for r in d.get("heads", [])],
        )
