"""`edgetp bench --prompt-tokens N`: a prompt of exactly N tokens of generated prose, and the
report of prefilling it and decoding after it, on the bundled SmolLM2."""

from __future__ import annotations

import re

import pytest

from edgetp.master.bench.cluster import run_cluster_bench
from edgetp.master.bench.long_prompt import prose_tokens
from edgetp.models.layers import Slice
from edgetp.node.kvcache import KVCache
from edgetp.tui.cli import main


def test_prose_is_exact_deterministic_and_never_repeats_a_sentence(smollm2_tokenizer):
    """The same N tokens every time, and text rather than one sentence over and over: a
    repeated prompt would let drafts and caches of repeats flatter the figures."""
    ids = prose_tokens(smollm2_tokenizer, 4096)
    assert len(ids) == 4096
    assert ids == prose_tokens(smollm2_tokenizer, 4096)
    assert prose_tokens(smollm2_tokenizer, 4096, seed=1) != ids
    assert len(prose_tokens(smollm2_tokenizer, 7)) == 7
    text = smollm2_tokenizer.decode(ids)
    sentences = [s.strip() for s in re.split(r"[.\n]+", text) if s.strip()][:-1]  # last: cut
    assert len(sentences) > 150
    assert len(set(sentences)) == len(sentences)


def test_bench_reports_prefill_decode_and_each_nodes_kv(smollm2, shared_state, capsys):
    """1 and 2 local nodes: the prompt is the N tokens asked for, prefill tokens/s is N over the
    time to first token, decode is timed at that depth, and each node's KV is its share of the
    model's KV per token times the depth (float32 keys and values or fewer bytes)."""
    report = run_cluster_bench(
        None, [1, 2], 3, None, None, shared_state, rounds=1, prompt_length=40
    )
    runs = report["runs"]
    assert [r["nodes"] for r in runs] == [1, 2]
    assert report["greedy_tokens_identical"]
    whole = KVCache.bytes_per_token(smollm2.config, Slice.whole(smollm2.config), "f32")
    for run in runs:
        lp = run["long_prompt"]
        assert lp["prompt_tokens"] == 40 and lp["depth"] == 43
        assert lp["prefill_tokens_per_s"] == pytest.approx(40 / (lp["ttft_ms"] / 1000), rel=1e-2)
        assert lp["ttft_ms"] > 0 and lp["decode_ms_per_token"] > 0
        assert list(lp["kv_mb"]) == [n["node"] for n in run["per_node"]]
        assert all(mb > 0 for mb in lp["kv_mb"].values())
    (alone,) = runs[0]["long_prompt"]["kv_mb"].values()
    assert whole * 43 / 8 / 1e6 <= alone <= whole * 43 / 1e6  # float32 at most, q4 at least
    # every KV head is held by some node: together at least one node's whole cache
    assert sum(runs[1]["long_prompt"]["kv_mb"].values()) >= alone - 0.02
    out = capsys.readouterr().out
    assert "a prompt of 40 tokens of generated prose" in out
    assert "KV for 43 tokens of context: master" in out


def test_a_prompt_past_the_context_is_one_line(capsys):
    """SmolLM2 holds 8192 tokens: 8190 of prompt and 4 decoded do not fit, said before any node
    starts."""
    assert main(["bench", "--prompt-tokens", "8190", "--tokens", "4"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("edgetp: error: --prompt-tokens 8190 and --tokens 4 need 8194 tokens")
    assert "holds 8192" in err and "at most 8188 prompt tokens" in err
    assert main(["bench", "--prompt-tokens", "100", "--tokens", "4", "--context", "64"]) == 1
    assert "but --context is 64" in capsys.readouterr().err
