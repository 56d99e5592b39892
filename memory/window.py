"""The sliding window: a node's slice of every layer, streamed from its shard files.

At most `window` layers are in memory at once, in buffers allocated (and touched) up front and
reused as a ring, so resident memory is known before the first token and stays flat. A loader
thread reads the next layers from disk while the current one computes and waits for its
allreduce; a layer's buffer is handed back as soon as its FFN is done.

Layers are used in order, 0..L-1, step after step, so the loader reads a cyclic sequence: the
k-th layer used is layer k % L, into buffer k % window. A step that ends early (a failed
request) breaks that order; the next request for another layer restarts the loader there.

When the window covers every layer, each is read once into its own buffer and never again.

A mixture of experts' layers stream apart: the ring holds each layer's dense part (header,
attention, norms), and the experts sit in a pool read an expert at a time as the routing
chooses them, by a reader of the step's own while the experts held compute (memory/experts.py).

A streamed layer is read again every step, so what is on disk can change under a running node (a
process writing there, a failing disk). Bytes that come from the disk are checked against the
file's checksum as the node verified it (xxh3, chunk by chunk as they arrive: about 5% of a read
from disk); bytes the page cache holds can only have changed through a write, which moves the
file's ctime, so a read served whole from the page cache of a file not written since its last
check costs nothing more (`git log -p docs/decisions.md` has the figures). A layer whose bytes
changed raises `ShardChanged` rather than compute with them; the node fetches the file again
and `retry`s.

Reads go into the buffers with readinto: no mmap, so nothing counts as "in memory" that is
really in the page cache. With `drop_cache`, each file is dropped from the page cache after it
is read (posix_fadvise DONTNEED), so every read comes from the disk, as on a device that cannot
keep the model: the honest setting for cold-disk benchmarks.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

from edgetp.memory.experts import ExpertPool, LayerParts, layer_parts, part_checksums, pread_into
from edgetp.memory.figures import StreamFigures
from edgetp.memory.pages import weight_buffer
from edgetp.memory.shards import (
    ShardChanged as ShardChanged,  # raised here, caught by its importers
)
from edgetp.memory.shards import read_into, tensor_specs, tensor_views
from edgetp.models.errors import ModelError
from edgetp.models.moe import EXPERT_TENSORS

READ_CHUNK = 1 << 20  # bytes a streaming read takes at a time, each checksummed while in cache
FIGURES_KEPT = 4096  # steps of per-step figures a node's history keeps, for benchmarks


class LayerWindow:
    """Layers of one slice, `window` at a time, read from `paths` (one file per layer)."""

    def __init__(
        self,
        paths: list[Path],
        window: int,
        drop_cache: bool = False,
        checksums: list[int] | None = None,
        experts: int = 0,
    ) -> None:
        """`checksums`: each file's xxh3 as verified (`ShardStore.checksum`); without them,
        each layer's first read is taken as right. `experts`: a mixture's n_stacked, whose
        experts a window that streams holds in an `ExpertPool` beside the layers' dense
        parts, in the memory its whole layers would have taken."""
        if window < 1:
            raise ValueError(f"the window must hold at least one layer, got {window}")
        self.paths = [Path(p) for p in paths]
        self.n_layers = len(self.paths)
        self.window = min(window, self.n_layers)
        self.drop_cache = drop_cache
        self.resident = self.window == self.n_layers
        sizes = []
        for p in self.paths:
            try:
                sizes.append(p.stat().st_size)
            except OSError as exc:
                raise ModelError(f"shard {p} is missing ({exc.strerror})") from exc
        self.sizes = sizes
        self.figures = StreamFigures()
        self._lock = threading.Condition()
        self._checksums: list[int | None] = list(checksums) if checksums else [None] * self.n_layers
        self.experts: ExpertPool | None = None
        self._parts: list[LayerParts] | None = None
        self._dense_checksums: list[int] = []
        buffer_size = max(sizes)
        if experts and not self.resident:
            self._parts = [layer_parts(p, experts, EXPERT_TENSORS) for p in self.paths]
            sums = [part_checksums(p, i, self._checksums[i]) for i, p in enumerate(self._parts)]
            self._dense_checksums = [dense for dense, _ in sums]
            buffer_size = max(p.dense_layout()[0] for p in self._parts)
            pool = self.window * (max(sizes) - buffer_size)
            per_slot = sum(p.expert_bytes for p in self._parts)  # a slot in every layer
            slots = min(experts, max(1, pool // max(per_slot, 1)))
            each = [by_expert for _, by_expert in sums]
            self.experts = ExpertPool(self._parts, each, slots, self.figures, drop_cache)
        # Allocated and touched now: the memory a node needs is taken before the first token.
        self.buffers = [weight_buffer(buffer_size) for _ in range(self.window)]
        self._views: list[dict[str, torch.Tensor] | None] = [None] * self.window
        self._identities: list[tuple[int, ...] | None] = [None] * self.n_layers  # when checked
        self._seq_of_slot = [-1] * self.window  # which use (k) a buffer holds
        self._used = 0  # k of the layer compute is on (or will be on next)
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        if drop_cache:
            os.sync()  # dirty pages cannot be dropped: write them back first
        if self.resident:
            for i in range(self.n_layers):
                self._read(i, i)
        else:
            self._start(0)

    @property
    def buffer_bytes(self) -> int:
        pool = self.experts.buffer_bytes if self.experts is not None else 0
        return sum(b.numel() for b in self.buffers) + pool

    # -- compute side -----------------------------------------------------------------------
    def specs(self) -> list[dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
        """Each layer's tensors' dtypes and shapes, without reading any layer: a file may store
        some layers' matrices in other types (a Q4_K_M file's Q6_K down projections)."""
        return [tensor_specs(p) for p in self.paths]

    def get(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s tensors, waiting for the loader if it is not read yet."""
        if self.resident:
            views = self._views[layer]
            assert views is not None
            return views
        with self._lock:
            if self._used % self.n_layers != layer:  # the order broke: restart there
                self._restart(layer)
            k = self._used
            slot = k % self.window
            if self._seq_of_slot[slot] != k:
                started = time.perf_counter()
                while self._seq_of_slot[slot] != k and self._error is None:
                    self._lock.wait()
                self.figures.wait_s += time.perf_counter() - started
            if self._seq_of_slot[slot] != k:
                assert self._error is not None  # the wait ends on the slot or on an error
                raise self._error
            views = self._views[slot]
            assert views is not None
            return views

    def release(self, layer: int) -> None:
        """Compute is done with `layer`: its buffer may take the next layer."""
        if self.resident:
            return
        with self._lock:
            if self._used % self.n_layers == layer:
                self._used += 1
                self._lock.notify_all()

    def retry(self, layer: int) -> None:
        """Read again from `layer` on, after the loader failed there (its file fetched anew)."""
        if self.resident:
            self._read(layer, layer)
            return
        with self._lock:
            self._restart(layer)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- loader side ------------------------------------------------------------------------
    def _start(self, first: int) -> None:
        self._stop = False
        self._error = None
        self._thread = threading.Thread(
            target=self._load_loop, args=(first,), name="layer-loader", daemon=True
        )
        self._thread.start()

    def _restart(self, layer: int) -> None:
        """Called with the lock held: stop the loader and start it again at `layer`."""
        self._stop = True
        self._lock.notify_all()
        thread = self._thread
        self._lock.release()
        try:
            if thread is not None:
                thread.join()
        finally:
            self._lock.acquire()
        # Continue the sequence count so buffers' old numbers can never match a new use.
        k = self._used + (layer - self._used) % self.n_layers + self.n_layers
        self._used = k
        self._seq_of_slot = [-1] * self.window
        self._start(k)

    def _load_loop(self, k: int) -> None:
        while True:
            with self._lock:
                # Buffer k % window is free once compute has moved past use k - window.
                while not self._stop and k - self._used >= self.window:
                    self._lock.wait()
                if self._stop:
                    return
            try:
                self._read(k % self.window, k % self.n_layers)
            except BaseException as exc:  # handed to compute, which raises it
                with self._lock:
                    self._error = exc
                    self._lock.notify_all()
                return
            with self._lock:
                self._seq_of_slot[k % self.window] = k
                self._lock.notify_all()
            k += 1

    def _read(self, slot: int, layer: int) -> None:
        if self._parts is not None:
            self._read_dense(slot, self._parts[layer], layer)
            return
        path, size = self.paths[layer], self.sizes[layer]
        buffer = self.buffers[slot]
        started = time.perf_counter()
        view = buffer.numpy().data[:size]
        try:
            with open(path, "rb", buffering=0) as f:
                st = os.fstat(f.fileno())
                identity = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                cached = _read_cached(f.fileno(), view)
                checksum = None
                if cached < size or identity != self._identities[layer]:
                    # Some bytes come from the disk, or the file was written since it was
                    # last checked: checksum it all, each chunk as it is read (still in the
                    # CPU's cache) while the disk reads ahead.
                    checksum = xxhash.xxh3_64(view[:cached])  # frees the GIL
                    os.posix_fadvise(f.fileno(), cached, size - cached, os.POSIX_FADV_WILLNEED)
                f.seek(cached)
                got = cached
                while got < size:
                    n = read_into(f, view[got : got + READ_CHUNK])
                    if not n:
                        break
                    if checksum is not None:
                        checksum.update(view[got : got + n])
                    got += n
                if self.drop_cache:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise ModelError(f"shard {path} cannot be read ({exc.strerror})") from exc
        if got != size:
            raise ModelError(f"shard {path} is truncated: {got} of {size} bytes")
        if checksum is not None:
            if self._checksums[layer] is None:
                self._checksums[layer] = checksum.intdigest()
            elif checksum.intdigest() != self._checksums[layer]:
                raise ShardChanged(layer, path)
            self._identities[layer] = identity
        self._views[slot] = tensor_views(buffer, path, size)
        self.figures.load_s += time.perf_counter() - started
        self.figures.bytes_read += size

    def _read_dense(self, slot: int, parts: LayerParts, layer: int) -> None:
        """The header and dense tensors of a mixture's layer (its experts are the pool's),
        checked against their own xxh3 whether they come from the disk or the page cache."""
        started = time.perf_counter()
        buffer = self.buffers[slot]
        view = buffer.numpy().data
        _, offsets = parts.dense_layout()
        pieces = [(0, 0, parts.header)] + [
            (offsets[x.name], x.start, x.nbytes) for x in parts.dense
        ]
        checksum = xxhash.xxh3_64()
        try:
            with open(parts.path, "rb", buffering=0) as f:
                for at, start, n in pieces:
                    got = pread_into(f.fileno(), view[at : at + n], start)
                    checksum.update(view[at : at + got])
                    self.figures.bytes_read += got
                if self.drop_cache:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise ModelError(f"shard {parts.path} cannot be read ({exc.strerror})") from exc
        if checksum.intdigest() != self._dense_checksums[layer]:
            raise ShardChanged(layer, parts.path)
        self._views[slot] = {
            x.name: buffer[offsets[x.name] : offsets[x.name] + x.nbytes].view(x.dtype).view(x.shape)
            for x in parts.dense
        }
        self.figures.load_s += time.perf_counter() - started


def _read_cached(fd: int, view: memoryview) -> int:
    """Fill `view` from the start of the file with what the page cache holds, up to the first
    byte it does not (Linux's RWF_NOWAIT); the bytes read. 0 where that cannot be asked."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    got = 0
    while nowait is not None and got < len(view):
        try:
            n = os.preadv(fd, [view[got:]], got, nowait)
        except OSError:  # EAGAIN: not cached there; EINVAL, EOPNOTSUPP: a kernel without it
            break
        if not n:
            break
        got += n
    return got


class ResidentLayers:
    """Every layer already in memory (a slice built in this process): the window's interface."""

    def __init__(self, layers: list[dict[str, torch.Tensor]]) -> None:
        self.layers = layers
        self.n_layers = len(layers)
        self.window = self.n_layers
        self.resident = True
        self.figures = StreamFigures()
        self.buffer_bytes = sum(t.nbytes for layer in layers for t in layer.values())
        self.experts: ExpertPool | None = None  # every expert is in memory

    def get(self, layer: int) -> dict[str, torch.Tensor]:
        return self.layers[layer]

    def specs(self) -> list[dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
        """Each layer's tensors' dtypes and shapes."""
        return [{name: (t.dtype, tuple(t.shape)) for name, t in w.items()} for w in self.layers]

    def release(self, layer: int) -> None:
        pass

    def close(self) -> None:
        pass


def keep_imports_out_of_collections() -> None:
    """What this process holds now (its imports: ~200k objects, torch's most) is left out of
    the cycle collector's walks from now on. Called where a master's `Session`, a forked node or
    a joining device starts, before any model loads (a `Session` gives it back at its close)."""
    gc.freeze()


def return_freed_memory() -> None:
    """Give the memory of what was just let go (an engine's weights and KV caches) back to the
    system. glibc keeps freed blocks for reuse: after a re-plan freed one engine's slices and
    loaded another's, a master held 1.2 GB where it had held 0.7 GB.

    The collection holds the GIL while it walks every object the cycle collector tracks, and
    no other thread of this process runs meanwhile, its heartbeats' included: over the 170k
    objects importing torch leaves, 0.12-0.15 s of CPU, 0.9-3.5 s at a load of 15 on 2 cores,
    and a node waiting for its plan took its master for dead. Out of the walk, what it held at its
    start (`keep_imports_out_of_collections`): 0.007 s of CPU instead of 0.22 s."""
    gc.collect()  # the engine's cycles first (ctypes' pointers into it), so its tensors go now
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def process_memory() -> dict[str, int]:
    """This process's resident memory now and at its peak (bytes), from /proc."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out["rss" if line.startswith("VmRSS") else "peak_rss"] = int(line.split()[1]) * 1024
    return out


def step_figures(window: LayerWindow | ResidentLayers, since: StreamFigures) -> dict[str, Any]:
    """What a node reports after each step: the loader's work in it, and its memory."""
    d = window.figures.minus(since)
    experts = {}
    if window.experts is not None:
        experts = {
            "expert_hits": d.expert_hits,
            "expert_misses": d.expert_misses,
            "expert_bytes_chosen": d.expert_bytes_chosen,
            "expert_bytes_read": d.expert_bytes_read,
            "expert_hidden_s": d.expert_hidden_s,
            "expert_slots": window.experts.slots,
        }
    return {
        "window": window.window,
        "bytes_read": d.bytes_read + d.expert_bytes_read,
        "load_s": d.load_s + d.expert_load_s,
        "wait_s": d.wait_s,
        "compute_s": d.compute_s,
        "buffer_bytes": window.buffer_bytes,
        **experts,
        **process_memory(),
    }
