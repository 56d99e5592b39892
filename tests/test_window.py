"""The sliding window: streamed layers give the resident answer, in flat memory, and fail loudly."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace

import pytest
import torch
from waiting import returns_within

from edgetp.master.cluster.local import local_engine
from edgetp.master.cluster.plan import plan_slices
from edgetp.master.cluster.transport import ClusterError
from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import SamplingParams
from edgetp.memory.budget import (
    FILE_TYPES,
    MIN_CONTEXT,
    BudgetError,
    MemoryOptions,
    plan_memory,
)
from edgetp.memory.pages import DATA_ALIGN, HUGE_PAGE, pack
from edgetp.memory.shards import ShardStore
from edgetp.memory.splitter import split_model
from edgetp.memory.window import LayerWindow, ShardChanged
from edgetp.models.errors import ModelError
from edgetp.models.layers import StepBatch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three reasons to learn Rust:"]

# Three texts, teacher-forced: the model reads them and its top-1 guess at every position is
# compared between shard dtypes.
TEXTS = [
    "The history of the lighthouse begins in antiquity. Sailors needed to know where the rocks "
    "were, and fires on hilltops were the first signals. Later, towers were built of stone, and "
    "the light was made by burning wood or coal. In the nineteenth century, lenses changed "
    "everything: a single lamp could be seen from twenty miles away. Keepers lived in the towers "
    "with their families, trimming wicks and winding the clockwork that turned the lens, night "
    "after night, in every weather, until electricity made most of them unnecessary.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = "
    "len(items) // 2\n    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])"
    "\n    merged = []\n    while left and right:\n        if left[0] <= right[0]:\n            "
    "merged.append(left.pop(0))\n        else:\n            merged.append(right.pop(0))\n    "
    "return merged + left + right\n",
    "Photosynthesis is the process by which green plants turn light into chemical energy. "
    "Chlorophyll absorbs red and blue light, and the energy splits water molecules, releasing "
    "oxygen. The hydrogen is used to turn carbon dioxide from the air into sugars, which the "
    "plant uses to grow. Almost all life on Earth depends on this process, directly or not. "
    "Forests, grasslands and the plankton of the oceans together capture more than a hundred "
    "billion tonnes of carbon every year, and the oxygen we breathe is its by-product.",
]
POSITIONS_PER_TEXT = 86  # 3 x 86 = 258 >= 256 positions


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    """One shard store for the module: each split is written once, and removed at its end."""
    folder = tmp_path_factory.mktemp("window-state")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def greedy(engine, tokenizer, n=32):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    seqs = start(engine, prompts, [SamplingParams(max_tokens=n, ignore_eos=True)] * 3)
    for _ in stream(engine, tokenizer, seqs):
        pass
    return [g.tokens for g in seqs]


@pytest.mark.slow
def test_window_of_two_gives_the_all_resident_tokens_on_three_nodes(
    smollm2, smollm2_tokenizer, state_dir
):
    with local_engine(
        smollm2, 3, state_dir=state_dir, context=256, slots=3, memory=FILE_TYPES
    ) as engine:
        resident = greedy(engine, smollm2_tokenizer)
        assert engine.figures["window"] == smollm2.config.n_layers
        assert all(m.figures["window"] == smollm2.config.n_layers for m in engine.remote.members)
    window = replace(FILE_TYPES, window=2)
    with local_engine(
        smollm2, 3, state_dir=state_dir, context=256, slots=3, memory=window
    ) as engine:
        streamed = greedy(engine, smollm2_tokenizer)
        figures = [engine.figures] + [m.figures for m in engine.remote.members]
        members = list(engine.remote.members)
        engine.close()
    assert streamed == resident
    assert [len(t) for t in streamed] == [32] * 3
    # Each node really streamed: two layers in memory, and a decode step re-reads its whole
    # slice (give or take the layers the loader has read ahead when the step ends).
    manifest = _manifest(state_dir, nodes=3)
    store = ShardStore(state_dir / "shards")
    names = ["master", *(m.name for m in members)]
    for k, (name, f) in enumerate(zip(names, figures, strict=True)):
        sizes = [store.path(r).stat().st_size for r in manifest.nodes[k]]
        assert f["window"] == 2, name
        assert abs(f["bytes_read"] - sum(sizes)) <= 2 * max(sizes), (name, f, sum(sizes))
        assert f["buffer_bytes"] == 2 * max(sizes), name


def _manifest(state_dir, nodes):
    from edgetp.memory.shards import Manifest

    for path in (state_dir / "shards" / "manifests").glob("*.json"):
        manifest = Manifest.from_json(path.read_text())
        if len(manifest.nodes) == nodes and manifest.extra.get("dtype") == FILE_TYPES.dtype:
            return manifest
    raise AssertionError(f"no {nodes}-node manifest")


def _teacher_forced_top1(engine, tokenizer) -> torch.Tensor:
    tops = []
    for text in TEXTS:
        ids = tokenizer.encode(text)[:POSITIONS_PER_TEXT]
        assert len(ids) == POSITIONS_PER_TEXT
        logits = engine.forward([ids], StepBatch((0,), (0,), (len(ids),)), all_logits=True)
        tops.append(logits[0].argmax(-1))
    return torch.cat(tops)


@pytest.fixture(scope="module")
def f32_top1(smollm2, smollm2_tokenizer):
    """One process, float32: what every dtype and split is held to (tests/test_cluster.py
    holds the f32 split to it exactly)."""
    with local_engine(smollm2, 1, context=128) as engine:
        return _teacher_forced_top1(engine, smollm2_tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nodes", "dtype"),
    [(1, "f16"), (1, "bf16"), (1, "int8"), (3, "int8"), (1, "q8_0"), (3, "q4_1")],
)  # three nodes for int8, whose kernels differ most between CPUs, and q4_1, the file's own
def test_every_shard_dtype_agrees_with_f32(
    smollm2, smollm2_tokenizer, state_dir, f32_top1, nodes, dtype
):
    """Each dtype on the kernels this device admitted for it, on one node and split across
    three: teacher-forced top-1 agreement with f32 of at least 0.95; q4_1, which holds the
    file's own weights, at least 0.98. (q4_0 rounds the file's 4-bit weights again, to 0.70: a
    format for files that come as Q4_0, whose kernels tests/test_kernels.py checks.)"""
    memory = MemoryOptions(dtype=dtype)
    with local_engine(smollm2, nodes, state_dir=state_dir, context=128, memory=memory) as engine:
        top1 = _teacher_forced_top1(engine, smollm2_tokenizer)
        engine.close()
    n = f32_top1.numel()
    assert n >= 256
    agreement = (top1 == f32_top1).float().mean().item()
    print(f"\n{nodes} node(s), {dtype}: top-1 agreement with f32 over {n}: {agreement:.4f}")
    assert agreement >= (0.98 if dtype == "q4_1" else 0.95), (dtype, agreement)


def test_a_budget_too_small_says_what_would_fit():
    with pytest.raises(BudgetError) as err:
        plan_memory(100_000_000, 14_000_000, 30, 46_000, 2048, fixed_bytes=113_000_000)
    message = str(err.value)
    assert "cannot hold 2 layers" in message and "give --memory-budget" in message
    need = 113_000_000 + 2 * 14_000_000 + 46_000 * MIN_CONTEXT
    plan = plan_memory(need, 14_000_000, 30, 46_000, 2048, fixed_bytes=113_000_000)
    assert plan.window == 2 and plan.context == MIN_CONTEXT  # exactly what the message asked


def test_the_window_takes_what_the_kv_cache_leaves():
    # 1 GB, 100 MB layers, 100 kB per token of KV: 2048 tokens take 204.8 MB, 7 layers fit.
    plan = plan_memory(10**9, 10**8, 80, 10**5, 2048)
    assert plan == plan.__class__(window=7, context=2048)
    assert plan_memory(10**12, 10**8, 80, 10**5, 2048).window == 80  # all fit: all resident
    # Two layers fit but not the whole cache: the context shrinks instead.
    small = plan_memory(3 * 10**8, 10**8, 80, 10**5, 2048)
    assert small.window == 2 and small.context == 1000
    assert plan_memory(None, 10**8, 80, 10**5, 2048, window=3).window == 3
    with pytest.raises(BudgetError):
        plan_memory(10**9, 10**8, 80, 10**5, 2048, window=10)


def test_the_cli_refuses_a_budget_too_small(smollm2, tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgetp.tui.cli",
            "run",
            "--memory-budget",
            "25MB",  # the file's own 4-bit weights need 37.5 MB (f32: 120 MB)
            "--state-dir",
            str(tmp_path),
            "Hello",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("edgetp: error: the master: a memory budget of 25.0 MB cannot hold")
    assert "give --memory-budget" in line


@pytest.fixture(scope="module")
def layer_files(smollm2, state_dir):
    store = ShardStore(state_dir / "shards")
    slices = plan_slices(smollm2.config, [1.0])
    manifest = split_model(smollm2, slices, store)
    return store, manifest.nodes[0]


def test_the_window_streams_every_layer_in_order_into_fixed_buffers(layer_files):
    store, refs = layer_files
    paths = [store.path(r) for r in refs[:6]]
    window = LayerWindow(paths, 2)
    buffers = [b.data_ptr() for b in window.buffers]
    try:
        for _token in range(3):
            for i, ref in enumerate(refs[:6]):
                got = window.get(i)
                want = store.load(ref)
                assert got.keys() == want.keys()
                assert all(torch.equal(got[k], want[k]) for k in want)
                window.release(i)
        assert window.figures.bytes_read >= 3 * sum(r.size for r in refs[:6]) - 2 * refs[0].size
        assert [b.data_ptr() for b in window.buffers] == buffers and len(buffers) == 2
        # A step cut short (a failed request): the next one starts again at layer 0.
        window.get(0)
        window.release(0)
        window.get(1)
        assert torch.equal(window.get(0)["wo"], store.load(refs[0])["wo"])
        window.release(0)
        assert torch.equal(window.get(1)["wo"], store.load(refs[1])["wo"])
    finally:
        window.close()


def test_a_window_covering_every_layer_reads_each_once(layer_files):
    store, refs = layer_files
    paths = [store.path(r) for r in refs[:4]]
    window = LayerWindow(paths, 10)
    for _token in range(3):
        for i in range(4):
            window.get(i)
            window.release(i)
    assert window.figures.bytes_read == sum(r.size for r in refs[:4])
    assert window.resident and len(window.buffers) == 4


def _advised(address: int) -> tuple[bool, int]:
    """Whether the mapping holding `address` asked for huge pages, and its size (bytes)."""
    with open("/proc/self/smaps") as f:
        inside, size = False, 0
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "lo-hi perms ..."
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside, size = lo <= address < hi, hi - lo
            elif inside and head == "VmFlags:":
                return "hg" in line.split(), size
    raise AssertionError(f"no mapping holds {address:#x}")


def test_weights_sit_in_buffers_that_ask_for_huge_pages(layer_files):
    """A decode step reads every weight: the window's buffers and packed layers are aligned to
    2 MB and their whole 2 MB pages advised as huge pages (memory/pages.py), the tail not."""
    store, refs = layer_files
    thp = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")  # else: plain memory
    window = LayerWindow([store.path(r) for r in refs[:2]], 2)
    try:
        buffer = window.buffers[0]
        assert buffer.data_ptr() % HUGE_PAGE == 0 and buffer.numel() >= HUGE_PAGE
        advised = _advised(buffer.data_ptr())
        assert advised == (True, buffer.numel() // HUGE_PAGE * HUGE_PAGE) if thp else not advised[0]
        tail = buffer.data_ptr() + buffer.numel() - 1
        assert buffer.numel() % HUGE_PAGE == 0 or not _advised(tail)[0]
    finally:
        window.close()
    layer = store.load(refs[0])
    packed = pack(layer)
    assert all(torch.equal(packed[k], layer[k]) for k in layer)
    assert all(t.data_ptr() % DATA_ALIGN == 0 for t in packed.values())
    first = next(iter(packed.values()))  # where the one buffer starts
    whole_pages = sum(t.nbytes for t in layer.values()) >= HUGE_PAGE
    assert _advised(first.data_ptr())[0] == (thp and whole_pages)


def _copies(store, refs, folder):
    """Copies of these shards in `folder`, to damage without touching the store's."""
    paths = []
    for r in refs:
        paths.append(folder / r.filename)
        paths[-1].write_bytes(store.path(r).read_bytes())
    return paths


def _stream(window, layers):
    """One step's use of `layers`, in order."""
    for i in layers:
        window.get(i)
        window.release(i)


def test_a_shard_lost_while_streaming_raises_with_its_path(layer_files, tmp_path):
    store, refs = layer_files
    paths = _copies(store, refs[:4], tmp_path)
    window = LayerWindow(paths, 2)
    try:
        window.get(0)
        window.release(0)
        paths[3].unlink()  # layer 3 is not read yet: the window holds 0..1 (maybe 2)
        window.get(1)
        window.release(1)
        window.get(2)
        window.release(2)
        # The loader's error is handed to the waiting compute, which raises it: it does not
        # wait for ever (the deadline only turns such a hang into a failure).
        with pytest.raises(ModelError, match=f"shard {paths[3]} cannot be read"):
            returns_within(lambda: window.get(3), 60, "the get of a lost layer")
    finally:
        window.close()


def test_a_shard_changed_under_a_streaming_window_is_refused_until_read_right(
    layer_files, tmp_path
):
    """A bit flipped in a layer's file between two steps: the window refuses the layer,
    naming the file, instead of computing with it; once the file is right again (a node
    fetches it anew) `retry` reads it and streaming goes on."""
    store, refs = layer_files
    paths = _copies(store, refs[:4], tmp_path)
    window = LayerWindow(paths, 2, checksums=[store.checksum(r) for r in refs[:4]])
    right = paths[3].read_bytes()
    try:
        _stream(window, range(4))  # one step
        with open(paths[3], "r+b") as f:  # same size, same header: only a weight differs
            f.seek(len(right) - 5)
            f.write(bytes([right[-5] ^ 0x01]))
        _stream(window, range(3))  # the next step, up to the changed layer
        with pytest.raises(ShardChanged, match=rf"shard {paths[3]} \(layer 3\) changed on disk"):
            window.get(3)
        paths[3].write_bytes(right)
        window.retry(3)
        got, want = window.get(3), store.load(refs[3])
        assert all(torch.equal(got[k], want[k]) for k in want)
        window.release(3)
        window.get(0)  # and on to the next step
    finally:
        window.close()


def test_a_streaming_window_checks_what_comes_from_the_disk_not_from_the_page_cache(
    layer_files, tmp_path
):
    """Rot on a disk changes no file time: what tells it is a read from the disk, checked
    against the verified checksum. Here the verified checksum of layer 2 is made to disagree
    with the file (as the disk's bytes would after rot): reads served by the page cache pass
    untouched (the file was not written since its check), the first read from the disk fails."""
    store, refs = layer_files
    paths = _copies(store, refs[:3], tmp_path)
    window = LayerWindow(paths, 2, checksums=[store.checksum(r) for r in refs[:3]])
    try:
        _stream(window, [0, 1, 2, 0, 1, 2])  # two steps
        window._checksums[2] ^= 1  # what the disk holds is no longer what was verified
        _stream(window, range(3))  # served by the page cache: not checked again, not refused
        window.get(0)  # the loader holds layers 0 and 1; layer 2 waits for a free buffer
        with open(paths[2], "rb") as f:  # evicted: its next read is from the disk
            os.fsync(f.fileno())  # written just now: dirty pages would stay
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        window.release(0)
        window.get(1)
        window.release(1)
        with pytest.raises(ShardChanged, match="layer 2"):
            window.get(2)
    finally:
        window.close()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_the_master_names_the_node_and_file_of_a_bad_shard(
    smollm2, smollm2_tokenizer, tmp_path, damage
):
    memory = replace(FILE_TYPES, window=2)
    with local_engine(smollm2, 2, state_dir=tmp_path, context=128, memory=memory) as engine:
        member = engine.remote.members[0]
        manifest = _manifest(tmp_path, nodes=2)
        k = 1  # the one worker is node 1
        victim = ShardStore(tmp_path / "shards").path(manifest.nodes[k][20])
        if damage == "missing":
            victim.unlink()
        else:  # a header that no longer parses
            with open(victim, "r+b") as f:
                f.seek(8)
                f.write(b"\xff" * 64)
        started = time.monotonic()
        tokens = [smollm2_tokenizer.encode("Hello there")]
        seqs = start(engine, tokens, [SamplingParams(max_tokens=8, ignore_eos=True)])
        with pytest.raises(ClusterError) as err:
            for _ in stream(engine, smollm2_tokenizer, seqs):
                pass
        elapsed = time.monotonic() - started
    message = str(err.value)
    print(f"{damage} shard, after {elapsed:.1f} s: {message}")
    # The node said what failed (an ERROR naming the file), rather than going silent until
    # its heartbeats were missed ("stopped answering") or the step's timeout.
    assert f"node {member.name} failed: " in message and str(victim) in message, message
    assert ("cannot be read" if damage == "missing" else "corrupt") in message, message
