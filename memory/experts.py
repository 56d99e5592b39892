"""A streaming node's experts: each layer's in a fixed pool of slots, least recently used first,
read from the layer's shard file an expert's rows at a time.

A mixture's layer file holds every expert's slice stacked by rows (`models.moe.expert_rows`):
expert e's rows of a stacked tensor are one contiguous range of it, since a row holds whole
blocks. A node that streams reads each step its layer's dense part (header, attention, norms)
through the window, and of the experts only those the step's routing chose that its pool lacks:
when the FFN step brings the routing, a reader thread of the step's own reads them while the
experts the pool holds compute, and each is computed as soon as its read is checked. A layer's
routing is the master's router on the hidden state after that layer's attention sum: nothing a
node has before the FFN step names the experts it will need, so no read can start earlier.

A partial read cannot be checked against the file's xxh3. So when the window starts, each layer
file is read once and the xxh3 of its dense part and of each expert's rows are taken, in the same
pass as the whole file's, which is checked against the one verified with its sha256: every later
read of a part is checked against its own, and a part whose bytes changed raises `ShardChanged`
rather than compute with them (`docs/decisions.md`, sparse expert streaming).
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from edgetp.memory.figures import StreamFigures
from edgetp.memory.pages import DATA_ALIGN, weight_buffer
from edgetp.memory.shards import _TORCH_DTYPES, HASH_CHUNK, ShardChanged, read_into
from edgetp.models.errors import ModelError


@dataclass(frozen=True)
class Extent:
    """One tensor of a shard file: its name, dtype and shape, and where its bytes lie."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # offset in the file
    nbytes: int


@dataclass(frozen=True)
class LayerParts:
    """A layer file of a mixture of experts cut in parts a node reads apart: the header and
    the tensors every step uses (`dense`: attention, norms), and each expert's rows of the
    stacked tensors (`stacked`: rows `experts`-fold, an expert's rows one contiguous range of
    each, since a row holds whole blocks)."""

    path: Path
    size: int
    header: int  # bytes of the header, its length included: where the data starts
    dense: tuple[Extent, ...]
    stacked: tuple[Extent, ...]
    experts: int

    @property
    def expert_bytes(self) -> int:
        return sum(x.nbytes // self.experts for x in self.stacked)

    def dense_layout(self) -> tuple[int, dict[str, int]]:
        """Bytes a buffer needs for the header and the dense tensors, and where each tensor
        goes in it: on DATA_ALIGN boundaries, after the header."""
        at, offsets = _aligned(self.header), {}
        for x in self.dense:
            offsets[x.name] = at
            at = _aligned(at + x.nbytes)
        return at, offsets

    def expert_ranges(self, expert: int) -> list[tuple[Extent, int, int]]:
        """Expert `expert`'s rows of each stacked tensor: (tensor, file offset, bytes), in
        file order."""
        out = []
        for x in self.stacked:
            per = x.nbytes // self.experts
            out.append((x, x.start + expert * per, per))
        return out

    def segments(self) -> list[tuple[int, int, int | None]]:
        """The whole file in order as (offset, bytes, part): part -1 for the header and dense
        tensors, e for expert e's rows, None for padding between them."""
        pieces = [(0, self.header, -1)] + [(x.start, x.nbytes, -1) for x in self.dense]
        for e in range(self.experts):
            pieces += [(start, n, e) for _, start, n in self.expert_ranges(e)]
        pieces.sort()
        out: list[tuple[int, int, int | None]] = []
        at = 0
        for start, n, part in [*pieces, (self.size, 0, -1)]:
            if start > at:
                out.append((at, start - at, None))
            if n:
                out.append((start, n, part))
            at = start + n
        return out


def _aligned(n: int) -> int:
    return -(-n // DATA_ALIGN) * DATA_ALIGN


def layer_parts(path: Path, experts: int, stacked: tuple[str, ...]) -> LayerParts:
    """The parts of a layer file whose tensors named in `stacked` hold `experts` experts'
    rows each."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        extents = [
            Extent(
                name,
                _TORCH_DTYPES[meta["dtype"]],
                tuple(meta["shape"]),
                8 + header_len + meta["data_offsets"][0],
                meta["data_offsets"][1] - meta["data_offsets"][0],
            )
            for name, meta in header.items()
            if name != "__metadata__"
        ]
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise ModelError(f"shard {path} is unreadable or corrupt ({exc})") from exc
    extents.sort(key=lambda x: x.start)
    for x in extents:
        if x.name in stacked and (not x.shape or x.shape[0] % experts):
            raise ModelError(f"shard {path}: {x.name} {x.shape} does not stack {experts} experts")
        if x.start + x.nbytes > size:
            raise ModelError(f"shard {path} is corrupt: tensor {x.name} is out of bounds")
    return LayerParts(
        path,
        size,
        8 + header_len,
        tuple(x for x in extents if x.name not in stacked),
        tuple(x for x in extents if x.name in stacked),
        experts,
    )


def part_checksums(parts: LayerParts, layer: int, whole: int | None) -> tuple[int, list[int]]:
    """The xxh3 of a layer file's dense part and of each expert's rows, in one read of the
    file, checked against the whole file's verified xxh3 `whole` (ShardChanged if it differs;
    without it the file is taken as right)."""
    total = xxhash.xxh3_64()
    hashes = [xxhash.xxh3_64() for _ in range(parts.experts + 1)]  # the experts', the dense
    chunk = memoryview(bytearray(HASH_CHUNK))
    try:
        with open(parts.path, "rb", buffering=0) as f:
            for _, length, part in parts.segments():
                while length:
                    n = read_into(f, chunk[: min(length, HASH_CHUNK)])
                    if not n:
                        raise ModelError(f"shard {parts.path} is truncated")
                    total.update(chunk[:n])
                    if part is not None:
                        hashes[part].update(chunk[:n])
                    length -= n
    except OSError as exc:
        raise ModelError(f"shard {parts.path} cannot be read ({exc.strerror})") from exc
    if whole is not None and total.intdigest() != whole:
        raise ShardChanged(layer, parts.path)
    return hashes[-1].intdigest(), [h.intdigest() for h in hashes[:-1]]


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from the file at `offset`; the bytes read (fewer only at its end)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if not n:
            break
        got += n
    return got


class ExpertPool:
    """Each layer's experts, `slots` at a time, in buffers allocated up front; a step's chosen
    experts read in as it needs them, evicting the least recently used of that layer.

    Per layer, each stacked tensor's slots are one tensor of `slots` experts' rows, stacked as
    in the file: slot s holds an expert's rows where the file holds expert s's, so the layer
    math runs on the pool with slot numbers for expert numbers. The slots' bookkeeping is the
    compute thread's alone: a reader thread only fills the slots it was given.
    """

    def __init__(
        self,
        parts: list[LayerParts],
        checksums: list[list[int]],
        slots: int,
        figures: StreamFigures,
        drop_cache: bool = False,
    ) -> None:
        self.parts = parts
        self.checksums = checksums
        self.slots = slots
        self.figures = figures
        self.drop_cache = drop_cache
        self.tensors: list[dict[str, torch.Tensor]] = []
        self._raw: list[dict[str, memoryview]] = []  # the same, as bytes
        self.buffer_bytes = 0
        for p in parts:
            at, spans = 0, {}
            for x in p.stacked:
                spans[x.name] = (at, at + slots * (x.nbytes // p.experts))
                at = _aligned(spans[x.name][1])
            buffer = weight_buffer(max(at, 1))
            self.buffer_bytes += buffer.numel()
            raw = {x.name: buffer[slice(*spans[x.name])] for x in p.stacked}
            self._raw.append({name: t.numpy().data for name, t in raw.items()})
            self.tensors.append(
                {
                    x.name: raw[x.name]
                    .view(x.dtype)
                    .view(slots * x.shape[0] // p.experts, *x.shape[1:])
                    for x in p.stacked
                }
            )
        # per layer: expert -> slot, least recently used first; and the slots holding none
        self._held: list[OrderedDict[int, int]] = [OrderedDict() for _ in parts]
        self._free = [list(range(slots - 1, -1, -1)) for _ in parts]

    def compute(
        self, layer: int, experts: Sequence[int], compute: Callable[[int, int], None]
    ) -> None:
        """Call `compute(expert, slot)` for each of `experts`, a step's chosen of `layer`: on
        those the pool holds first, while a reader thread reads the others, each as soon as its
        read is checked (the caller keeps its own order of sums). A read that fails raises its
        error here once the reader has stopped. A step that chooses more than the pool holds (a
        long prefill) reads each as it reaches it, evicting one the step already used."""
        held, free = self._held[layer], self._free[layer]
        pooled = [e for e in experts if e in held]
        missing = [e for e in experts if e not in held]
        for e in pooled:
            held.move_to_end(e)
        self.figures.expert_hits += len(pooled)
        self.figures.expert_misses += len(missing)
        self.figures.expert_bytes_chosen += len(experts) * self.parts[layer].expert_bytes
        if len(experts) > self.slots:
            for e in experts:
                compute(e, self._slot(layer, e))
            return
        # The pooled are the most recently used: with every chosen expert within the pool,
        # only experts the step did not choose are evicted.
        targets = [(e, free.pop() if free else held.popitem(last=False)[1]) for e in missing]
        if not targets:
            for e in pooled:
                compute(e, held[e])
            return
        slot_of = dict(targets)
        loaded_before, waited = self.figures.expert_load_s, 0.0
        reader = _Reader(self._fill(layer, targets))
        try:
            for e in pooled:
                reading = not reader.ended.is_set()
                compute(e, held[e])
                if reading and reader.began.is_set():  # this compute overlapped a read
                    self.figures.expert_computes_overlapped += 1
            for _ in targets:
                started = time.perf_counter()
                e, error = reader.done.get()
                waited += time.perf_counter() - started
                if error is not None:
                    raise error
                held[e] = slot_of[e]
                compute(e, slot_of[e])
        finally:
            reader.stop()
            for e, slot in targets:
                if held.get(e) != slot:  # not read, or not checked: it holds no expert
                    free.append(slot)
            hidden = self.figures.expert_load_s - loaded_before - waited
            self.figures.expert_hidden_s += max(0.0, hidden)

    def _slot(self, layer: int, expert: int) -> int:
        """The slot of `layer` that holds `expert`, read now if it is not held."""
        held, free = self._held[layer], self._free[layer]
        if expert not in held:
            slot = free.pop() if free else held.popitem(last=False)[1]
            try:
                for _ in self._fill(layer, [(expert, slot)]):
                    held[expert] = slot
            finally:
                if expert not in held:
                    free.append(slot)  # what it holds is not the expert's
        held.move_to_end(expert)
        return held[expert]

    def _fill(self, layer: int, targets: list[tuple[int, int]]) -> Generator[int, None, None]:
        """Read each (expert, slot) of `targets` into its slot and check it against the
        expert's xxh3, yielding the expert once it is; ShardChanged if its bytes changed."""
        parts = self.parts[layer]
        try:
            with open(parts.path, "rb", buffering=0) as f:
                for e, slot in targets:
                    started = time.perf_counter()
                    checksum = xxhash.xxh3_64()
                    for x, start, n in parts.expert_ranges(e):
                        view = self._raw[layer][x.name][slot * n : (slot + 1) * n]
                        got = pread_into(f.fileno(), view, start)
                        self.figures.expert_bytes_read += got
                        checksum.update(view[:got])
                    self.figures.expert_load_s += time.perf_counter() - started
                    if checksum.intdigest() != self.checksums[layer][e]:
                        raise ShardChanged(layer, parts.path)
                    yield e
                if self.drop_cache:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise ModelError(f"shard {parts.path} cannot be read ({exc.strerror})") from exc


class _Reader:
    """A step's reads of the experts its pool lacked, on a thread of its own: each expert
    (or the error that ended the reads) handed to compute through `done` as soon as it is
    checked. One a step, joined before the step goes on, so none outlives its step."""

    def __init__(self, fill: Generator[int, None, None]) -> None:
        self.done: queue.SimpleQueue[tuple[int, BaseException | None]] = queue.SimpleQueue()
        self.began = threading.Event()
        self.ended = threading.Event()
        self._stopping = threading.Event()
        self._fill = fill
        self._thread = threading.Thread(target=self._run, name="expert-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.began.set()
        try:
            for e in self._fill:
                self.done.put((e, None))
                if self._stopping.is_set():
                    break
        except BaseException as exc:  # handed to compute, which raises it
            self.done.put((-1, exc))
        finally:
            self._fill.close()
            self.ended.set()

    def stop(self) -> None:
        """Stop after the read under way (compute failed, or every read is done) and wait."""
        self._stopping.set()
        self._thread.join()
