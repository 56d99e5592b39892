"""The split plan as a pure function of config and capacities."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from master.plan import plan_slices, proportional_counts
from models.config import ModelConfig

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


def test_one_node_gets_everything():
    (s,) = plan_slices(SMOLLM2, [1.0])
    assert (s.q_heads, s.kv_heads, s.ffn) == ((0, 9), (0, 3), (0, 1536))


def test_whole_kv_groups_when_nodes_fit():
    slices = plan_slices(SMOLLM2, [1, 1, 1])
    assert [s.kv_heads for s in slices] == [(0, 1), (1, 2), (2, 3)]
    assert [s.q_heads for s in slices] == [(0, 3), (3, 6), (6, 9)]


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
