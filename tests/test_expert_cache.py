"""A node that streams a mixture's layers holds its experts in a pool of slots (least recently
used first) and reads from its shards only the chosen experts it lacks.

The random-weight Qwen3-MoE of tests/test_moe.py (2 layers, 8 experts, 2 a token), on 3 real
node processes streaming one layer at a time: its pool holds 4 experts a layer, never all 8. Its
logits and greedy tokens are the all-resident ones; each node reads per token no more than the
chosen experts' slices and its attention; the expert cache's hit rate reaches `/v1/cluster` and
the bench; a byte changed inside an expert's rows is refused, never computed with. The experts
the pool holds compute while a reader thread reads the others, and the partials add, to the bit,
as the resident slice's do, whatever the pool held; a read that fails meanwhile raises its error
and leaves no reader behind.
"""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import torch
from test_families import _assert_close_logits, _greedy, _ours
from test_moe import _built
from waiting import wait_until

from edgetp.master.bench.cluster_figures import node_row
from edgetp.master.bridge.schema import ClusterFigures
from edgetp.master.cluster.engine import Engine
from edgetp.master.cluster.figures import BatcherStats, cluster_figures
from edgetp.master.cluster.local import local_session
from edgetp.master.cluster.plan import plan_slices
from edgetp.master.cluster.transport import ClusterError
from edgetp.memory import experts as expert_reads
from edgetp.memory.budget import MemoryOptions
from edgetp.memory.experts import layer_parts
from edgetp.memory.shards import Manifest, ShardStore
from edgetp.memory.splitter import split_model
from edgetp.memory.window import LayerWindow, ShardChanged
from edgetp.models.errors import ModelError
from edgetp.models.layers import StepBatch
from edgetp.models.moe import EXPERT_TENSORS, Routing, moe_partial, moe_rows
from edgetp.models.source import open_model
from edgetp.node.executor import make_executor

EXPERTS = 8
DECODE = 16


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(its source, a prompt)."""
    _, folder, prompt = _built("norm_topk", tmp_path_factory)
    return open_model(folder), prompt


@pytest.fixture(scope="module", params=["norm_topk", "gpt_oss"])
def any_moe(request, tmp_path_factory):
    """Each kind of expert: Qwen3-MoE's, and gpt-oss' (MXFP4 blocks, and biases stacked by
    expert as its weights are)."""
    _, folder, prompt = _built(request.param, tmp_path_factory)
    return open_model(folder), prompt


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def test_streamed_experts_answer_as_resident_ones_reading_only_the_chosen(any_moe, tmp_path):
    source, prompt = any_moe
    resident = Engine.local(source, (1.0,) * 3)
    continuation = _greedy(resident, prompt, DECODE)
    expected = _ours(resident, prompt, continuation)
    memory = MemoryOptions(window=1)
    with local_session(source, 3, context=128, memory=memory, state_dir=tmp_path) as session:
        engine = session.engine
        assert engine is not None and engine.remote is not None
        ours = _ours(engine, prompt, continuation)
        members = list(engine.remote.members)
        histories = [list(engine.history)] + [list(m.history) for m in members]
        stats = BatcherStats(1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        view = ClusterFigures.model_validate(cluster_figures(session, "moe", stats))
        greedy = _greedy(engine, prompt, DECODE)
        (manifest_file,) = (tmp_path / "shards" / "manifests").glob("*.json")
        manifest = Manifest.from_json(manifest_file.read_text())
        store = ShardStore(tmp_path / "shards")

        # Each node's bytes per decoded token: the chosen experts it lacked, and its layers'
        # dense parts (header, attention, norms) through the window.
        for k, history in enumerate(histories):
            files = [store.path(r) for r in manifest.nodes[k]]
            parts = [layer_parts(p, EXPERTS, EXPERT_TENSORS) for p in files]
            dense = sum(p.header + sum(x.nbytes for x in p.dense) for p in parts)
            steps = history[-DECODE:]  # one token each
            for f in steps:
                assert f["window"] == 1 and 1 <= f["expert_slots"] < EXPERTS, f
                assert f["expert_bytes_read"] <= f["expert_bytes_chosen"], f
                assert f["bytes_read"] <= 1.5 * (f["expert_bytes_chosen"] + dense), (f, dense)
                assert 0.0 <= f["expert_hidden_s"] <= f["load_s"], f  # reads' time, at most
            # The whole slice would be read each token without the pool: far more.
            assert sum(f["bytes_read"] for f in steps) < 0.8 * DECODE * sum(p.size for p in parts)
            row = node_row(f"node {k}", history)
            assert 0.0 < row["expert_hit_rate"] < 1.0, row
            assert row["expert_mb_read_per_token"] <= row["expert_mb_chosen_per_token"], row
            assert 0.0 <= row["expert_read_hidden_ms_per_token"] <= row["load_ms_per_token"], row
        for node in view.nodes:
            assert node.expert_hit_rate is not None and 0.0 <= node.expert_hit_rate <= 1.0
            assert node.expert_read_hidden_ms is not None and node.expert_read_hidden_ms >= 0.0

        # A byte flipped inside every expert's rows of a worker's last layer: the first
        # expert it lacks there is refused (the node fetches the file again, from a master
        # whose copy is the same damaged file here), and the step fails, naming it.
        victim = store.path(manifest.nodes[1][-1])
        for e in range(EXPERTS):
            for _, start, n in layer_parts(victim, EXPERTS, EXPERT_TENSORS).expert_ranges(e):
                _flip(victim, start + n // 2)
        ids = list(prompt)
        with pytest.raises(ClusterError) as err:
            logits = engine.forward([ids], StepBatch((0,), (0,), (len(ids),)))
            for _ in range(DECODE):
                ids.append(int(logits[0].argmax()))
                logits = engine.forward([[ids[-1]]], StepBatch((0,), (len(ids) - 1,), (1,)))
    _assert_close_logits(ours, expected, "3 nodes streaming experts against all resident")
    assert greedy == continuation
    assert "changed on disk" in str(err.value) and str(victim) in str(err.value), err.value


@pytest.fixture(scope="module")
def one_node_split(moe, tmp_path_factory):
    """The Qwen3-MoE split for one node: (its store, its layer files' refs)."""
    source, _ = moe
    store = ShardStore(tmp_path_factory.mktemp("one-node"))
    manifest = split_model(source, plan_slices(source.config, [1.0]), store)
    return store, manifest.nodes[0]


@pytest.fixture
def window(one_node_split, tmp_path):
    """A window of one layer over a copy of that node's layer files (a test may damage them),
    its pool 4 experts a layer."""
    store, refs = one_node_split
    paths = [tmp_path / f"layer{i}.safetensors" for i in range(len(refs))]
    for ref, path in zip(refs, paths, strict=True):
        shutil.copyfile(store.path(ref), path)
    window = LayerWindow(paths, 1, checksums=[store.checksum(r) for r in refs], experts=EXPERTS)
    assert window.experts is not None and window.experts.slots == 4
    yield window
    window.close()


def _computed(pool, layer: int, experts: list[int], compute=None) -> dict[int, int]:
    """Each expert the pool computed for a step choosing `experts`, in the order it did, and
    the slot it gave (`compute(expert, slot)`, if given, is called on each first)."""
    done: dict[int, int] = {}

    def record(e: int, slot: int) -> None:
        if compute is not None:
            compute(e, slot)
        done[e] = slot

    pool.compute(layer, experts, record)
    return done


def _assert_holds(pool, layer: int, slots: dict[int, int], path) -> None:
    """The pool's `slots` hold their experts' rows of each stacked tensor, as the file does."""
    for e, slot in slots.items():
        for x, start, n in layer_parts(path, EXPERTS, EXPERT_TENSORS).expert_ranges(e):
            got = pool.tensors[layer][x.name].view(torch.uint8).view(-1)[slot * n : (slot + 1) * n]
            with open(path, "rb") as f:
                f.seek(start)
                assert bytes(got.numpy()) == f.read(n), (e, x.name)


@pytest.fixture
def read_gates(monkeypatch) -> list[threading.Event]:
    """Events the expert reader's reads wait for before they read the disk (as they do then),
    so that a compute that sets one knows the reads are under way, not done. The disk's read
    is the seam: reads this small are not caught in flight otherwise."""
    read, gates = expert_reads.pread_into, []

    def gated(fd: int, view: memoryview, offset: int) -> int:
        if threading.current_thread().name == "expert-reader":
            assert all(gate.wait(30) for gate in gates), "no compute began"
        return read(fd, view, offset)

    monkeypatch.setattr(expert_reads, "pread_into", gated)
    return gates


def _held_waits_for_reads(pool, experts: int, read_gates: list[threading.Event]):
    """A compute for the held expert computed first: it lets the reads begin, and returns
    once the reader has read `experts` experts' rows since (checked or not), so the reads
    happen during it."""
    figures, first, began = pool.figures, None, threading.Event()
    read_gates.append(began)
    until = figures.expert_bytes_read + experts * pool.parts[1].expert_bytes

    def compute(e: int, slot: int) -> None:
        nonlocal first
        if first is None:
            first = e
            began.set()
            wait_until(
                lambda: figures.expert_bytes_read >= until,
                30,
                f"read of {experts} experts while expert {e} computes",
            )

    return compute


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "expert-reader"]


def test_an_expert_changed_on_disk_is_refused_and_read_again_once_right(window, one_node_split):
    """The pool reads an expert's rows of each stacked matrix and checks them against the
    checksum taken when the window started; a changed byte raises ShardChanged and leaves the
    slot free; the same rows, right again, are read and held."""
    store, refs = one_node_split
    pool, paths = window.experts, window.paths
    assert window.buffer_bytes < max(r.size for r in refs) + pool.buffer_bytes
    dense, whole = window.get(0), store.load(refs[0])
    assert set(dense) == set(whole) - set(EXPERT_TENSORS) and "wqkv" in dense
    assert all(torch.equal(dense[k], whole[k]) for k in dense)
    (x, start, n), *_ = layer_parts(paths[1], EXPERTS, EXPERT_TENSORS).expert_ranges(5)
    right = paths[1].read_bytes()
    _flip(paths[1], start + n - 1)
    with pytest.raises(ShardChanged, match=rf"shard {paths[1]} \(layer 1\)"):
        _computed(pool, 1, [2, 5])
    assert pool.figures.expert_misses == 2
    paths[1].write_bytes(right)
    slots = _computed(pool, 1, [2, 5])  # 2 was read and held before 5 was refused
    assert (pool.figures.expert_hits, pool.figures.expert_misses) == (1, 3)
    _assert_holds(pool, 1, slots, paths[1])
    assert list(_computed(pool, 1, [5, 7])) == [5, 7]  # the held first; 7 is read
    assert (pool.figures.expert_hits, pool.figures.expert_misses) == (2, 4)
    assert pool.figures.expert_bytes_read == 4 * pool.parts[1].expert_bytes


def test_the_experts_held_compute_while_the_others_are_read(window, read_gates):
    """When a step's routing arrives, the experts the pool holds compute while a reader
    thread reads those it lacks: a held expert's compute here waits, in its own thread, for
    the reader to have read the others, which could never happen were the reads before or
    after it. The reads' time is counted as hidden behind compute."""
    pool, path = window.experts, window.paths[1]
    _computed(pool, 1, [2, 5])
    figures = pool.figures
    hidden_before, load_before = figures.expert_hidden_s, figures.expert_load_s
    slots = _computed(pool, 1, [2, 5, 6, 7], _held_waits_for_reads(pool, 2, read_gates))
    assert list(slots)[:2] == [2, 5] and set(slots) == {2, 5, 6, 7}, slots
    assert figures.expert_computes_overlapped >= 1
    hidden, loaded = figures.expert_hidden_s - hidden_before, figures.expert_load_s - load_before
    assert 0.0 < hidden <= loaded, (hidden, loaded)
    _assert_holds(pool, 1, slots, path)
    assert not _readers()


def test_a_read_that_fails_while_held_experts_compute_raises_and_leaves_no_reader(
    window, read_gates
):
    """A changed byte in an expert read while the held ones compute raises ShardChanged, as a
    read before compute did; a shard gone raises its clear error; a compute that fails stops
    the reads. Each time the reader is gone when the step's call returns, and the slots it
    did not fill are free for the next step, which reads them right."""
    pool, path = window.experts, window.paths[1]
    _computed(pool, 1, [2, 5])
    right = path.read_bytes()
    (x, start, n), *_ = layer_parts(path, EXPERTS, EXPERT_TENSORS).expert_ranges(7)
    _flip(path, start)
    with pytest.raises(ShardChanged, match=rf"shard {path} \(layer 1\) changed on disk"):
        _computed(pool, 1, [2, 5, 6, 7], _held_waits_for_reads(pool, 2, read_gates))  # 6 held
    assert not _readers()
    path.rename(path.with_suffix(".gone"))
    with pytest.raises(ModelError, match=rf"shard {path} cannot be read \(No such file"):
        _computed(pool, 1, [2, 5, 7])
    assert not _readers()
    path.with_suffix(".gone").rename(path)

    def fails(e: int, slot: int) -> None:
        raise RuntimeError(f"expert {e} failed")

    with pytest.raises(RuntimeError, match="expert 2 failed"):
        _computed(pool, 1, [2, 5, 7], fails)
    assert not _readers()
    path.write_bytes(right)
    before = pool.figures.expert_misses
    slots = _computed(pool, 1, [2, 5, 6, 7])
    assert pool.figures.expert_misses == before + 1  # 7 alone
    _assert_holds(pool, 1, slots, path)
    assert len(set(slots.values())) == 4


def test_the_partials_add_in_the_routings_order_whatever_the_pool_held(moe, one_node_split, window):
    """Four experts a token (the model chooses two, whose sum has one order; four show the
    order in the bits), from a pool that held none of them, two, or all: whatever the order in
    which they computed, the executor's FFN partial is, to the bit, the resident slice's, which
    adds each token's experts in ascending order."""
    source, _ = moe
    store, refs = one_node_split
    config = source.config
    executor = make_executor(config, plan_slices(config, [1.0])[0], window, 16, 3)
    rng = np.random.default_rng(0)
    h = rng.standard_normal((3, config.hidden)).astype(np.float32)
    routing = Routing(
        np.array([[1, 3, 5, 7], [7, 5, 3, 1], [5, 1, 7, 3]]),
        rng.random((3, 4)).astype(np.float32),
    )
    whole = store.load(refs[0])
    steps = {  # a decode step's rows (B, D), and a prompt's (B, T, D)
        StepBatch((0, 1, 2), (0, 0, 0), (1, 1, 1)): (h, moe_rows(h, whole, config, routing)),
        StepBatch((0,), (0,), (3,)): (
            h[None],
            moe_partial(torch.from_numpy(h[None]), whole, config, routing).numpy(),
        ),
    }
    pool = window.experts
    for batch, (x, resident) in steps.items():
        executor.begin_step(batch)
        for held in ([], [5, 7], [7, 3], [1, 3, 5, 7]):
            _computed(pool, 0, [0, 2, 4, 6])  # none of the step's
            _computed(pool, 0, held)
            assert np.array_equal(executor.ffn(0, x, routing), resident), (batch, held)
