"""The split plan as a pure function of config and capacities."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq
from hypothesis import example, given
from hypothesis import strategies as st

from edgetp.master.bench.synth_models import SHAPES
from edgetp.master.cluster.plan import (
    ATTENTION_GAIN,
    choose_attention,
    head_row_cost,
    head_rows,
    head_run,
    plan_slices,
    proportional_counts,
    split_estimate,
    with_disk_reads,
    with_messages,
    workers_to_plan,
)
from edgetp.master.cluster.session import (
    WorkerTooSmall,
    keep_last_plan,
    kv_format_plans,
    memory_plans,
)
from edgetp.memory.budget import MemoryOptions
from edgetp.memory.files import measure_disk_read
from edgetp.memory.shards import ShardStore
from edgetp.memory.splitter import split_model
from edgetp.models.config import ModelConfig
from edgetp.models.config_files import config_from_hf
from edgetp.node.kvcache import KVCache
from edgetp.node.probes import measure_message_cost

SMOLLM2 = ModelConfig(
    architecture="llama",
    n_layers=30,
    hidden=576,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    ffn_hidden=1536,
    vocab_size=49152,
    context_length=8192,
    norm_eps=1e-5,
    rope_theta=1e5,
)
RUN = head_run(SMOLLM2)  # lm_head rows in one run: 768


def test_one_node_gets_everything():
    (s,) = plan_slices(SMOLLM2, [1.0])
    assert (s.q_heads, s.kv_heads, s.ffn) == ((0, 9), (0, 3), (0, 1536))


def test_whole_kv_groups_when_nodes_fit():
    slices = plan_slices(SMOLLM2, [1, 1, 1])
    assert [s.kv_heads for s in slices] == [(0, 1), (1, 2), (2, 3)]
    assert [s.q_heads for s in slices] == [(0, 3), (3, 6), (6, 9)]


def test_attention_first_gives_the_master_every_head_and_splits_the_ffn_as_before():
    split = plan_slices(SMOLLM2, [1, 2, 3])
    first = plan_slices(SMOLLM2, [1, 2, 3], attention_first=True)
    assert (first[0].q_heads, first[0].kv_heads) == ((0, 9), (0, 3))
    assert [s.attends for s in first] == [True, False, False]
    assert [s.ffn for s in first] == [s.ffn for s in split]
    # the master's attention runs while the workers wait: the head evens out the FFN alone
    equal = plan_slices(SMOLLM2, [1, 1, 1], attention_first=True)
    counts = [b - a for a, b in head_rows(SMOLLM2, equal, [1, 1, 1])]
    assert max(counts) - min(counts) <= RUN, counts


def test_attention_goes_to_the_master_where_the_sums_it_saves_cost_more_than_it_does():
    """Four devices of 8 GB/s: every head on the master costs a token its attention's bytes at
    1/8 rather than 1/32, against 48 sums; the choice turns where the two meet, and never for
    a master whose budget cannot hold every layer's attention."""
    moe = config_from_hf(SHAPES["qwen3-30b-a3b"], "qwen3-30b-a3b")
    speeds, attention_bytes = [8.0] * 4, 500 * 2**20
    # a sum that saves what the master's attention costs beyond its share, by the margin
    even = ATTENTION_GAIN * attention_bytes / 1e9 * (1 / 8 - 1 / 32) / 48
    assert not choose_attention(moe, speeds, 0.0, attention_bytes).on_master
    assert not choose_attention(moe, speeds, 0.9 * even, attention_bytes).on_master
    chosen = choose_attention(moe, speeds, 1.1 * even, attention_bytes)
    assert chosen.on_master and chosen.name == "master"
    assert "48 sums a token fewer" in chosen.why
    small = choose_attention(moe, speeds, 1.1 * even, attention_bytes, master_budget=2**28)
    assert not small.on_master and "memory budget" in small.why
    assert not choose_attention(moe, [8.0], 1.0, attention_bytes).on_master  # nothing to save


def test_uneven_capacities_give_uneven_ffn():
    slices = plan_slices(SMOLLM2, [1, 2, 3])
    assert [s.n_ffn for s in slices] == [256, 512, 768]


def test_more_nodes_than_kv_heads_replicates_kv():
    slices = plan_slices(SMOLLM2, [1, 1, 1, 1])
    assert sum(s.n_q for s in slices) == 9
    assert sum(s.n_kv for s in slices) > 3  # some KV head is held twice
    for s in slices:
        assert s.kv_heads[0] <= s.q_heads[0] // 3 and (s.q_heads[1] - 1) // 3 < s.kv_heads[1]


def test_bad_capacities_are_rejected():
    with pytest.raises(ValueError, match="positive"):
        plan_slices(SMOLLM2, [1, 0])
    with pytest.raises(ValueError, match="positive"):
        plan_slices(SMOLLM2, [])


@given(total=st.integers(0, 5000), caps=st.lists(st.floats(0.01, 100), min_size=1, max_size=16))
def test_proportional_counts_sum_and_fairness(total, caps):
    counts = proportional_counts(total, caps)
    assert sum(counts) == total
    whole = sum(caps)
    for n, c in zip(counts, caps, strict=True):
        assert abs(n - total * c / whole) < 1 + 1e-9


@given(caps=st.lists(st.floats(0.1, 10), min_size=1, max_size=12))
def test_plan_covers_every_head_and_column_once(caps):
    slices = plan_slices(SMOLLM2, caps)
    assert len(slices) == len(caps)
    q = [h for s in slices for h in range(*s.q_heads)]
    f = [c for s in slices for c in range(*s.ffn)]
    assert q == list(range(9)) and f == list(range(1536))


@given(caps=st.lists(st.floats(0.1, 10), min_size=1, max_size=12))
def test_head_rows_cover_the_vocabulary_once(caps):
    rows = head_rows(SMOLLM2, plan_slices(SMOLLM2, caps), caps)
    assert len(rows) == len(caps)
    assert rows[0][0] == 0 and rows[-1][1] == SMOLLM2.vocab_size
    assert all(a <= b and b == c for (a, b), (c, _) in zip(rows, rows[1:], strict=False))


def layer_weights(s):
    """SmolLM2's weights in one layer of a slice, counted by hand: q, k, v, o, gate, up, down."""
    return 576 * (s.n_q * 64 * 2 + s.n_kv * 64 * 2 + s.n_ffn * 3)


@given(caps=st.lists(st.floats(0.5, 2), min_size=2, max_size=3))
@example(caps=[1.875, 0.5, 0.5])  # one node at the least run, one with no heads: found by CI
def test_head_rows_even_out_what_whole_heads_cannot(caps):
    """Each node's weights, its layers' and its head rows', over its capacity, are the same for
    every node (within a run of RUN rows and the norms), except a node whose layers alone
    pass its share: it gets one run, the least, and the others share the rest evenly."""
    slices = plan_slices(SMOLLM2, caps)
    rows = head_rows(SMOLLM2, slices, caps)
    weights = [
        30 * layer_weights(s) + (b - a) * 576 for s, (a, b) in zip(slices, rows, strict=True)
    ]
    balanced = [w / c for w, c, (a, b) in zip(weights, caps, rows, strict=True) if b - a > RUN]
    assert len(balanced) >= 1
    assert max(balanced) - min(balanced) <= 576 * (RUN + 90) / min(caps)
    for w, c, (a, b) in zip(weights, caps, rows, strict=True):
        if b - a == RUN:
            assert w / c >= min(balanced) - 576 * RUN / c


@given(
    caps=st.lists(st.floats(0.5, 2), min_size=2, max_size=3),
    costs=st.lists(st.floats(1.0, 3.0), min_size=2, max_size=2),
)
def test_head_rows_count_what_a_row_costs_each_node(caps, costs):
    """A head row that costs a worker more (its logit crosses a slow link) counts that much
    more on it: each node's layers plus its rows times their cost, over its capacity, are the
    same for every node (within a run); costs of 1 give the plan of no costs."""
    costs = [1.0, *costs][: len(caps)]
    slices = plan_slices(SMOLLM2, caps)
    assert head_rows(SMOLLM2, slices, caps, [1.0] * len(caps)) == head_rows(SMOLLM2, slices, caps)
    rows = head_rows(SMOLLM2, slices, caps, costs)
    times = [
        (30 * layer_weights(s) + (b - a) * 576 * m) / c
        for s, (a, b), m, c in zip(slices, rows, costs, caps, strict=True)
        if b - a > RUN
    ]
    assert len(times) >= 1
    assert max(times) - min(times) <= 576 * (RUN + 90) * max(costs) / min(caps)


def test_a_slow_link_moves_head_rows_to_the_master():
    """SmolLM2 in f32 on two equal 4 GB/s devices: at 100 Mbit/s a worker's head row costs it
    1.56 rows (its logit's 4 bytes take 0.32 us against 0.58 to multiply it); at 1 Gbit/s 1.06;
    a link too fast to time costs nothing. The worker's rows shrink with its link."""
    assert head_row_cost(SMOLLM2, 4.0, 12.5e6, "f32") == pytest.approx(1.556, abs=1e-3)
    assert head_row_cost(SMOLLM2, 4.0, 125e6, "f32") == pytest.approx(1.0556, abs=1e-3)
    assert head_row_cost(SMOLLM2, 4.0, float("inf"), "f32") == 1.0
    slices = plan_slices(SMOLLM2, [1.0, 1.0])
    worker_rows = [
        b - a
        for _, (a, b) in (
            head_rows(SMOLLM2, slices, [1.0, 1.0], [1.0, head_row_cost(SMOLLM2, 4.0, rate, "f32")])
            for rate in (float("inf"), 125e6, 12.5e6, 1.25e6)
        )
    ]
    assert worker_rows == sorted(worker_rows, reverse=True) and worker_rows[0] > worker_rows[-1]
    print(f"the worker's head rows at no link cost, 1 Gbit/s, 100 and 10 Mbit/s: {worker_rows}")


def test_plans_of_jittering_speeds_split_the_head_into_few_shapes():
    """Probes of two equal devices jitter by ~10%: their plans' head rows recur, so each node's
    head shape is one its kernel table knows (a new one is a ~6 s check at cpu=0.5). 500 plans
    of speeds within 10% of each other: 18 splits in runs of 768 rows, 151 in runs of 64."""
    assert RUN == 768
    rng = random.Random(0)
    splits = set()
    for _ in range(500):
        caps = [rng.uniform(0.9, 1.1), rng.uniform(0.9, 1.1)]
        rows = head_rows(SMOLLM2, plan_slices(SMOLLM2, caps), caps)
        assert all((b - a) % RUN == 0 for a, b in rows[:-1])
        splits.add(tuple(rows))
    assert len(splits) <= 20, sorted(splits)


def test_two_equal_devices_even_out_the_attention_split_with_the_head():
    """3 KV-head groups go 2:1; the head's rows go the other way, so both hold as much."""
    master, worker = plan_slices(SMOLLM2, [1.0, 1.0])
    assert (master.n_q, worker.n_q) == (6, 3)
    (a0, b0), (a1, b1) = head_rows(SMOLLM2, [master, worker], [1.0, 1.0])
    assert b0 - a0 < b1 - a1
    assert abs(30 * layer_weights(master) + (b0 - a0) * 576
               - 30 * layer_weights(worker) - (b1 - a1) * 576) <= 576 * RUN  # fmt: skip


def test_a_measured_plan_is_kept_until_a_new_one_would_be_much_faster(tmp_path):
    """Speeds measured at each start jitter: the plan, and so the split, stays until a plan from
    this start's figures would make a token REPLAN_GAIN faster."""
    record = tmp_path / "plans" / "model-f32-2.json"

    def kept(caps: list[float], costs: list[float] | None = None) -> list[float]:
        return keep_last_plan(record, caps, costs)[0]

    assert kept([1.0, 1.0]) == [1.0, 1.0]
    assert kept([1.0, 1.4]) == [1.0, 1.0]  # 0.5 / 1.0 against 1 / 2.4
    assert kept([2.0, 2.0]) == [1.0, 1.0]  # faster alike: the same plan
    assert kept([4.0, 0.6]) == [4.0, 0.6]  # 0.5 / 0.6 against 1.5 / 4.6
    assert kept([3.0, 1.0]) == [4.0, 0.6]
    record.write_text("not json")
    assert kept([3.0, 1.0]) == [3.0, 1.0]
    # What a head row costs each node (its link) is kept with it, until one moves by half.
    assert keep_last_plan(record, [3.0, 1.0], [1.0, 1.2]) == ([3.0, 1.0], [1.0, 1.0])
    assert keep_last_plan(record, [3.0, 1.0], [1.0, 1.6]) == ([3.0, 1.0], [1.0, 1.6])
    assert keep_last_plan(record, [3.1, 1.0], [1.0, 1.5]) == ([3.0, 1.0], [1.0, 1.6])


def test_a_node_that_streams_its_slice_goes_no_faster_than_its_disk():
    """70B-shaped layers at q4_1 (2.14 GB a token, 0.625 bytes a weight): a node that streams
    at 0.1 GB/s delivers 0.64 GB/s of float32-equivalent weights, whatever its compute."""
    size, weights = 2_139_095_040, 3_422_552_064
    disk_cap = 0.1 * 4 / 0.625
    # Every node forced to stream: a fast master no longer takes the largest share.
    speeds = with_disk_reads([20.0, 5.0, 10.0, 10.0], [0.1] * 4, [4 << 30] * 4, [True] * 4,
                             size, weights)  # fmt: skip
    assert speeds == pytest.approx([disk_cap] * 4)
    # A node that holds its share keeps its compute speed; one without a disk figure too.
    big, small = 64 << 30, 256 << 20  # a third of the layers is 713 MB
    speeds = with_disk_reads([8.0, 8.0, 8.0], [0.1, 0.1, None], [big, small, small],
                             [False] * 3, size, weights)  # fmt: skip
    assert speeds == pytest.approx([8.0, disk_cap, 8.0])
    # Nothing streams: the measured speeds as they are.
    assert with_disk_reads([3.0, 1.0], [0.1, 0.1], [big, big], [False, False], size, weights) == [
        3.0,
        1.0,
    ]


def test_the_master_s_messages_of_every_sum_shrink_its_share():
    """SmolLM2's 0.54 GB of float32 weights, 61 sums a token, 80 us a message (34 us of CPU
    at cpu=0.5, doubled): at 3 equal devices the master handles 4 messages a sum, a worker 2,
    and every node then takes the same time a token."""
    gb, sums, cost = 0.538, 61, 80e-6
    speeds = with_messages([6.0] * 3, [cost] * 3, gb, sums)
    assert speeds[0] < speeds[1] == speeds[2]
    shares = [gb * v / sum(speeds) for v in speeds]
    times = [w / 6.0 + m * sums * cost for w, m in zip(shares, [4, 2, 2], strict=True)]
    assert times == pytest.approx([gb / sum(speeds)] * 3)  # 1 / sum is still a token's time
    # Two equal devices exchange as many messages each: equal shares still.
    master, worker = with_messages([6.0, 6.0], [cost] * 2, gb, sums)
    assert master == pytest.approx(worker) and master < 6.0
    # Nothing measured (a node from before the probe) or one node: nothing to count.
    assert with_messages([6.0, 3.0, 3.0], [0.0] * 3, gb, sums) == [6.0, 3.0, 3.0]
    assert with_messages([6.0], [cost], gb, sums) == [6.0]
    # Messages that alone take longer than a token: the master keeps a sliver, not a negative.
    assert 0 < with_messages([6.0] * 3, [1.0, 0.0, 0.0], gb, sums)[0] < 0.01


def _threads() -> dict[str, str]:
    """This process's threads, id -> name (libzmq names its own "ZMQbg/IO/0", "ZMQbg/Reaper")."""
    threads = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            threads[task.name] = (task / "comm").read_text().strip()
        except OSError:  # it ended while listed
            pass
    return threads


def test_the_message_probe_measures_a_cost_per_message_and_leaves_nothing():
    """A CURVE round trip on the loopback: tens of us of CPU a message here, never zero. Its
    context's threads are gone after it; a thread another part of the test process started
    meanwhile (in a whole run, one appeared) is not the probe's, and is named in a failure."""
    before = _threads()
    cost = measure_message_cost()
    assert 1e-6 < cost < 5e-3
    new = {tid: name for tid, name in _threads().items() if tid not in before}
    assert not [name for name in new.values() if name.startswith("ZMQbg")], new


def test_a_message_probe_that_gets_nothing_through_gives_no_figure(monkeypatch, caplog):
    """A receive that times out (zmq.Again, as its RCVTIMEO makes it) gives 0: the plan then
    counts no messages for the device, which still joins; the start says why."""

    def times_out(self, *args, **kwargs):
        raise zmq.Again()

    monkeypatch.setattr(zmq.Socket, "recv_multipart", times_out)
    assert measure_message_cost() == 0.0
    assert "could not measure what a message costs" in caplog.text


def test_the_disk_probe_leaves_nothing_and_says_none_where_it_cannot_write(tmp_path):
    """The probe behind a streaming node's disk figure writes, reads past the page cache and
    removes its file; a folder it cannot create gives no figure, not an error."""
    rate = measure_disk_read(tmp_path / "state")
    assert rate is None or rate > 0  # None: this file system has no O_DIRECT (a tmpfs)
    assert list((tmp_path / "state").iterdir()) == []
    (tmp_path / "file").write_text("not a folder")
    assert measure_disk_read(tmp_path / "file" / "state") is None


def test_a_worker_s_memory_plan_counts_its_rows_of_the_lm_head(smollm2, tmp_path):
    """A worker's budget holds its rows of the lm_head besides its window and KV cache: one
    that would hold two layers and the cache, but not the rows too, is refused, naming them.
    The same budget holds twice the context with an f16 KV cache, over 3.3 times with q8_0."""
    caps = [1.0, 1.0]
    slices = plan_slices(smollm2.config, caps)
    heads = head_rows(smollm2.config, slices, caps)
    manifest = split_model(smollm2, slices, ShardStore(tmp_path), head_rows=heads)
    assert manifest.head_size(1) > (heads[1][1] - heads[1][0]) * 576 * 4  # f32 rows
    worker = SimpleNamespace(name="w", capacity=SimpleNamespace(memory_budget=0, window=None))
    hub = SimpleNamespace(members=[worker])
    two_layers = 2 * max(r.size for r in manifest.nodes[1])
    cache = 64 * KVCache.bytes_per_token(smollm2.config, slices[1], "f32")
    worker.capacity.memory_budget = two_layers + cache
    with pytest.raises(WorkerTooSmall, match="its rows of the lm_head"):
        memory_plans(manifest, hub, 256, 1, MemoryOptions())
    worker.capacity.memory_budget = two_layers + cache + manifest.head_size(1)
    _, plan = memory_plans(manifest, hub, 256, 1, MemoryOptions())
    assert (plan.window, plan.context) == (2, 64)
    f32 = KVCache.bytes_per_token(smollm2.config, slices[1], "f32")
    assert 2 * KVCache.bytes_per_token(smollm2.config, slices[1], "f16") == f32
    assert KVCache.bytes_per_token(smollm2.config, slices[1], "q8_0") <= 0.3 * f32
    _, plan = memory_plans(manifest, hub, 256, 1, MemoryOptions(kv_cache="f16"))
    assert (plan.window, plan.context) == (2, 128)
    _, plan = memory_plans(manifest, hub, 256, 1, MemoryOptions(kv_cache="q8_0"))
    assert plan.window == 2 and plan.context >= 64 / 0.3


def test_an_auto_kv_cache_takes_the_first_format_that_holds_the_context(smollm2, tmp_path, caplog):
    """`--kv-cache auto` under a worker's budget that holds 64 tokens of float32 keys and
    values: f32 for a context of 64, f16 for 128, q8_0 for 200; for 1000, which none holds,
    q8_0's 213 or so, and the choice said at start."""
    caps = [1.0, 1.0]
    slices = plan_slices(smollm2.config, caps)
    heads = head_rows(smollm2.config, slices, caps)
    manifest = split_model(smollm2, slices, ShardStore(tmp_path), head_rows=heads)
    two_layers = 2 * max(r.size for r in manifest.nodes[1])
    cache = 64 * KVCache.bytes_per_token(smollm2.config, slices[1], "f32")
    budget = two_layers + cache + manifest.head_size(1)
    worker = SimpleNamespace(name="w", capacity=SimpleNamespace(memory_budget=budget, window=None))
    hub = SimpleNamespace(members=[worker])
    auto = MemoryOptions(kv_cache="auto")
    chosen = {}
    for context in (64, 128, 200, 1000):
        kv_format, plans = kv_format_plans(manifest, hub, context, 1, auto)
        chosen[context] = (kv_format, min(p.context for p in plans))
    assert chosen[64] == ("f32", 64) and chosen[128] == ("f16", 128)
    assert chosen[200] == ("q8_0", 200)
    assert chosen[1000][0] == "q8_0" and 64 / 0.3 <= chosen[1000][1] < 1000
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache")]
    tokens = chosen[1000][1]
    assert said[-1] == (
        f"KV cache q8_0, for {tokens} tokens of context of the 1000 asked for (f32 would hold 64)"
    )
    assert kv_format_plans(manifest, hub, 128, 1, MemoryOptions(kv_cache="f32"))[0] == "f32"


def test_local_workers_in_the_master_s_memory_cgroup_split_what_its_limit_leaves(
    smollm2, tmp_path, monkeypatch
):
    """Local workers are processes in the master's cgroup: each read the limit less what the
    cgroup held as its own budget, so two nodes planned to fill the same memory, and the kernel
    killed the master (`edgetp run --local-nodes 2` in a 500 MB cgroup). What the limit leaves
    when the master plans is split evenly between them; a budget given, or devices of their
    own, is each node's as before."""
    caps = [1.0, 1.0]
    slices = plan_slices(smollm2.config, caps)
    manifest = split_model(smollm2, slices, ShardStore(tmp_path), head_rows=head_rows(
        smollm2.config, slices, caps))  # fmt: skip
    layer = max(r.size for r in manifest.nodes[1])
    limit_leaves = manifest.globals.size + manifest.head_size(1) + 26 * layer  # 20 layers each
    monkeypatch.setattr("edgetp.master.cluster.session.device_memory_budget", lambda: limit_leaves)
    worker = SimpleNamespace(name="w", capacity=SimpleNamespace(memory_budget=limit_leaves,
                                                                window=None))  # fmt: skip
    hub = SimpleNamespace(members=[worker])
    apart = memory_plans(manifest, hub, 64, 1, MemoryOptions())
    shared = memory_plans(manifest, hub, 64, 1, MemoryOptions(), one_device=True)
    print(f"\nwindows: {[p.window for p in apart]} apart, {[p.window for p in shared]} shared")
    assert [p.window for p in apart] == [30, 30]  # each counted the whole of what is left
    total = sum(p.window for p in shared) * layer + manifest.globals.size + manifest.head_size(1)
    assert all(p.window < 30 for p in shared) and total <= limit_leaves
    given = memory_plans(manifest, hub, 64, 1, MemoryOptions(budget=limit_leaves), True)
    assert [p.window for p in given] == [30, 30]


def test_the_split_estimate_weighs_the_sums_against_the_compute_saved():
    """Two devices of 5 GB/s share 0.5 GB of weights: 100 ms a token alone, 50 ms of compute
    split. 61 sums at the slowest worker's 2 ms round trip add 122 ms: slower than alone (the
    master warns); at 0.3 ms, 18.3 ms: faster."""
    far = split_estimate([5.0, 5.0], 0.5, 61, [0.002])
    assert far.alone_s == pytest.approx(0.1) and far.compute_s == pytest.approx(0.05)
    assert far.sums_s == pytest.approx(0.122) and far.split_s > far.alone_s
    near = split_estimate([5.0, 5.0], 0.5, 61, [0.0001, 0.0003])
    assert near.sums_s == pytest.approx(61 * 0.0003) and near.split_s < near.alone_s


def test_a_device_whose_link_slows_every_token_is_left_on_standby():
    """Three devices of 5 GB/s and 0.5 GB of weights: 100 ms a token alone, 33 ms of compute
    split. Near links (0.3 ms) keep everyone; one 2 ms away would make 61 sums wait 122 ms, so
    the plan takes the master and the near worker (50 + 18 ms); all of them 2 ms away: the
    master alone. Where the estimates are near (within STANDBY_GAIN), everyone stays."""
    gb = 10**9
    speeds, budgets = [5.0, 5.0, 5.0], [gb, gb, gb]
    assert workers_to_plan(speeds, [0.0003, 0.0003], budgets, gb // 2, 0.5, 61) == [0, 1]
    assert workers_to_plan(speeds, [0.002, 0.0003], budgets, gb // 2, 0.5, 61) == [1]
    assert workers_to_plan(speeds, [0.002, 0.002], budgets, gb // 2, 0.5, 61) == []
    # 1 ms: 33 + 61 ms split against 100 alone (the master's own budget holds the model).
    assert workers_to_plan(speeds, [0.001, 0.001], budgets, gb // 2, 0.5, 61) == [0, 1]


def test_standby_never_leaves_the_rest_too_small_to_hold_the_weights():
    """The master alone would be faster, but 0.8 GB of weights need two of these budgets: the
    plan keeps the worker of the nearer link, not none."""
    gb = 10**9
    budgets = [gb // 2, gb // 2, gb // 2]
    kept = workers_to_plan([5.0, 5.0, 5.0], [0.004, 0.002], budgets, 8 * gb // 10, 0.5, 61)
    assert kept == [1]
    assert workers_to_plan([5.0, 5.0], [0.004], [gb // 2, gb // 2], 8 * gb // 10, 0.5, 61) == [0]
