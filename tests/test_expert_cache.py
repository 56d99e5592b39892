"""A node that streams a mixture's layers holds its experts in a pool of slots (least recently
used first) and reads from its shards only the chosen experts it lacks.

The random-weight Qwen3-MoE of tests/test_moe.py (2 layers, 8 experts, 2 a token), on 3 real
node processes streaming one layer at a time: its pool holds 4 experts a layer, never all 8. Its
logits and greedy tokens are the all-resident ones; each node reads per token no more than the
chosen experts' slices and its attention; the expert cache's hit rate reaches `/v1/cluster` and
the bench; a byte changed inside an expert's rows is refused, never computed with.
"""

from __future__ import annotations

import pytest
import torch
from test_families import _assert_close_logits, _ours
from test_moe import _built, _greedy

from master.bench.cluster_figures import node_row
from master.bridge.schema import ClusterFigures
from master.engine import Engine
from master.figures import BatcherStats, cluster_figures
from master.local import local_session
from master.plan import plan_slices
from master.splitter import split_model
from master.transport import ClusterError
from memory.budget import MemoryOptions
from memory.experts import layer_parts
from memory.shards import Manifest, ShardStore
from memory.window import LayerWindow, ShardChanged
from models.layers import StepBatch
from models.moe import EXPERT_TENSORS
from models.source import open_model

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
            # The whole slice would be read each token without the pool: far more.
            assert sum(f["bytes_read"] for f in steps) < 0.8 * DECODE * sum(p.size for p in parts)
            row = node_row(f"node {k}", history)
            assert 0.0 < row["expert_hit_rate"] < 1.0, row
            assert row["expert_mb_read_per_token"] <= row["expert_mb_chosen_per_token"], row
        for node in view.nodes:
            assert node.expert_hit_rate is not None and 0.0 <= node.expert_hit_rate <= 1.0

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


def test_an_expert_changed_on_disk_is_refused_and_read_again_once_right(moe, tmp_path):
    """The pool reads an expert's rows of each stacked matrix and checks them against the
    checksum taken when the window started; a changed byte raises ShardChanged and leaves the
    slot free; the same rows, right again, are read and held."""
    source, _ = moe
    store = ShardStore(tmp_path)
    manifest = split_model(source, plan_slices(source.config, [1.0]), store)
    refs = manifest.nodes[0]
    paths = [store.path(r) for r in refs]
    window = LayerWindow(paths, 1, checksums=[store.checksum(r) for r in refs], experts=EXPERTS)
    pool = window.experts
    try:
        assert pool is not None and pool.slots == 4
        assert window.buffer_bytes < max(r.size for r in refs) + pool.buffer_bytes
        dense, whole = window.get(0), store.load(refs[0])
        assert set(dense) == set(whole) - set(EXPERT_TENSORS) and "wqkv" in dense
        assert all(torch.equal(dense[k], whole[k]) for k in dense)
        want = store.load(refs[1])
        (x, start, n), *_ = layer_parts(paths[1], EXPERTS, EXPERT_TENSORS).expert_ranges(5)
        right = paths[1].read_bytes()
        _flip(paths[1], start + n - 1)
        with pytest.raises(ShardChanged, match=rf"shard {paths[1]} \(layer 1\)"):
            pool.choose(1, [2, 5])
        assert pool.figures.expert_misses == 2
        paths[1].write_bytes(right)
        pool.choose(1, [2, 5])  # 2 was read and held before 5 was refused
        assert (pool.figures.expert_hits, pool.figures.expert_misses) == (1, 3)
        for e in (2, 5):
            slot = pool.slot(1, e)
            for name in ("w_gate_up", "w_down"):
                rows = want[name].shape[0] // EXPERTS
                got = pool.tensors[1][name][slot * rows : (slot + 1) * rows]
                assert torch.equal(got, want[name][e * rows : (e + 1) * rows]), (e, name)
        pool.choose(1, [5, 7])
        assert (pool.figures.expert_hits, pool.figures.expert_misses) == (2, 4)  # 7 was read
        assert pool.figures.expert_bytes_read == 4 * pool.parts[1].expert_bytes
    finally:
        window.close()
