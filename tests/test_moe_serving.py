"""A mixture of experts is served as a dense model is: the bridge, recovery from a node lost
mid-answer, and speculation, on a random-weight Qwen3-MoE that carries the bundled SmolLM2's
tokenizer and chat template (an HF folder: tokenizer.json and tokenizer_config.json beside the
weights).

The chat app needs nothing of its own here: it talks to the bridge over HTTP, the same chat
completions, whole and streamed, that the first test asks for with the `openai` client.

The model writes only the words of test_speculate's paragraph (its other output rows are zero):
random weights over a vocabulary that small repeat themselves, so prompt-lookup drafts are
sometimes kept and sometimes rejected, where over all 49,152 tokens none would ever be drafted.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import torch
from cluster_threads import master_threads
from http_client import HTTP
from local_processes import local_workers
from test_families import _randomize
from test_speculate import EDIT, PARAGRAPH, SlowLinkSpeculator, _generate

from edgetp.master.bridge.client import ServerProcess, start_server
from edgetp.master.cluster.local import local_session
from edgetp.master.generation.prompts import prompt_tokens
from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.source import open_model
from edgetp.models.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

MOE = {
    "hidden_size": 64,
    "intermediate_size": 96,  # a dense layer's: none here
    "moe_intermediate_size": 96,  # 3 blocks of 32 columns: each of 3 nodes holds one of each
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 3,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
}
PROMPT = "Why is the sky blue?"


def write_tokenizer(folder: Path, tokenizer: Tokenizer) -> None:
    """`tokenizer`'s vocabulary, special tokens and chat template as an HF folder's files."""
    (folder / "tokenizer.json").write_text(tokenizer._engine._backend.to_str())
    tokenizer_config = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos,
        "chat_template": tokenizer.chat_template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def assert_lookup_drafts_change_no_token(folder: Path, state_dir: Path) -> None:
    """Greedy 64 tokens of a paragraph to repeat, on 3 real nodes, with prompt-lookup drafts
    (some kept, some rejected and taken back out of every node) and without: the same."""
    source = open_model(folder)
    tokenizer = source.tokenizer()
    prompts = [prompt_tokens(tokenizer, EDIT, raw=False)]
    with local_session(source, 3, state_dir=state_dir, context=512) as session:
        assert session.engine is not None
        plain = _generate(session.engine, tokenizer, prompts, None)
        speculator = SlowLinkSpeculator()
        drafted = _generate(session.engine, tokenizer, prompts, speculator)
    figures = speculator.figures()
    print(f"\n{figures}\n{tokenizer.decode(plain[0])!r}")
    assert drafted == plain
    assert 0 < figures["accepted"] < figures["drafted"], figures


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    """A Qwen3-MoE HF folder with SmolLM2's vocabulary, tokenizer and chat template."""
    import transformers

    tokenizer = open_model(DEFAULT_MODEL).tokenizer()
    config = transformers.Qwen3MoeConfig(
        **MOE,
        vocab_size=tokenizer.vocab_size,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=7)
    words = sorted(set(tokenizer.encode(PARAGRAPH)))
    with torch.no_grad():
        kept = torch.zeros(config.vocab_size, dtype=torch.bool)
        kept[words] = True
        model.lm_head.weight[~kept] = 0
    folder = tmp_path_factory.mktemp("qwen3-moe")
    model.save_pretrained(folder)
    write_tokenizer(folder, tokenizer)
    ours = open_model(folder)
    assert ours.config.n_experts == 8 and ours.tokenizer().eos_ids == tokenizer.eos_ids
    return folder


@pytest.fixture(scope="module")
def bridge(moe_folder, shared_state) -> Iterator[ServerProcess]:
    args = ["--model", str(moe_folder), "--local-nodes", "3", "--context", "512"]
    server = start_server([*args, "--state-dir", str(shared_state)], verbose=True, timeout=240)
    try:
        yield server
    finally:
        server.stop()


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="-", max_retries=0, timeout=120)


def greedy(client: openai.OpenAI, max_tokens: int, **kw) -> dict:
    """A greedy chat completion of PROMPT that runs to `max_tokens`, as create's keywords."""
    return {
        "model": client.models.list().data[0].id,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "extra_body": {"ignore_eos": True},
        **kw,
    }


def streamed(client: openai.OpenAI, max_tokens: int, on_chunk: Callable[[int], None]) -> str:
    """The streamed answer's text; `on_chunk(n)` runs as the n-th chunk arrives."""
    text = ""
    for n, chunk in enumerate(
        client.chat.completions.create(**greedy(client, max_tokens, stream=True))
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        on_chunk(n)
    return text


def generation(server: ServerProcess) -> dict:
    return HTTP.get(f"{server.base}/v1/cluster", timeout=10).json()["generation"]


def test_the_bridge_answers_whole_and_streamed_alike(bridge):
    """The cluster is three nodes, each holding a slice of every expert; a chat completion and
    the same one streamed give the same 16 tokens' text."""
    client = client_of(bridge)
    nodes = HTTP.get(f"{bridge.base}/v1/cluster", timeout=10).json()["nodes"]
    assert sorted(n["name"] for n in nodes) == ["local-1", "local-2", "master"]
    assert all(n["slices"] and n["slices"][0]["ffn"][1] > n["slices"][0]["ffn"][0] for n in nodes)
    whole = client.chat.completions.create(**greedy(client, 16))
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    text = whole.choices[0].message.content or ""
    print(f"\n{text!r}")
    assert text.strip()
    assert streamed(client, 16, lambda n: None) == text


def test_a_node_lost_mid_answer_loses_nothing_of_it(bridge):
    """A worker killed at the stream's 8th chunk of 64: the master re-plans on the nodes left,
    replays the answer so far, and the stream ends with the uninterrupted answer's text."""
    client = client_of(bridge)
    whole = client.chat.completions.create(**greedy(client, 64)).choices[0].message.content
    before = generation(bridge)
    workers = local_workers(bridge.proc.pid)
    assert sorted(workers) == ["local-1", "local-2"], workers

    def kill_at_the_8th_chunk(n: int) -> None:
        if n == 8:
            os.kill(workers["local-1"], signal.SIGKILL)

    text = streamed(client, 64, kill_at_the_8th_chunk)
    after = generation(bridge)
    assert after["recovered"] == before["recovered"] + 1, after  # the kill landed mid-answer
    assert "node local-1 " in after["last_loss"] and after["failed"] == before["failed"], after
    assert text == whole


@master_threads(3)
def test_prompt_lookup_drafts_change_no_greedy_token_on_three_nodes(moe_folder, shared_state):
    assert_lookup_drafts_change_no_token(moe_folder, shared_state)
