"""Log probabilities, n choices, the penalties and min_p, through the real `openai` client
against a real `edgetp serve` (one node: what is tested here is the master's sampler and the
bridge, which a split does not change; tests/test_bridge_server.py runs a split)."""

from __future__ import annotations

import openai
import pytest

from edgetp.master.bridge.client import start_server

pytestmark = pytest.mark.slow

KEY = "test-key-logprobs"
MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]
REPEAT = "1, 1, 1, 1, 1, 1, 1, 1,"


@pytest.fixture(scope="module")
def client(shared_state):
    args = ["--local-nodes", "1", "--state-dir", str(shared_state), "--api-key", KEY]
    server = start_server([*args, "--context", "512", "--max-batch", "4"])
    try:
        yield openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0, timeout=60)
    finally:
        server.stop()


def chat(client, **fields):
    return client.chat.completions.create(model=MODEL, messages=ASK, **fields)


def test_chat_logprobs_are_the_greedy_tokens_and_their_likeliest(client):
    plain = chat(client, temperature=0, max_tokens=12)
    got = chat(client, temperature=0, max_tokens=12, logprobs=True, top_logprobs=4)
    [choice] = got.choices
    assert choice.message.content == plain.choices[0].message.content  # sampling unchanged
    content = choice.logprobs.content
    assert len(content) == got.usage.completion_tokens - (choice.finish_reason == "stop")
    assert "".join(e.token for e in content) == choice.message.content
    for e in content:
        alternatives = [t.logprob for t in e.top_logprobs]
        assert len(alternatives) == 4 and alternatives == sorted(alternatives, reverse=True)
        assert e.top_logprobs[0].token == e.token  # greedy: the likeliest
        assert e.logprob == alternatives[0] <= 0.0
        assert bytes(e.bytes) == e.token.encode()
    assert chat(client, temperature=0, max_tokens=2, logprobs=False).choices[0].logprobs is None


def test_completion_logprobs_have_openais_legacy_shape(client):
    done = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8, logprobs=3
    )
    [choice] = done.choices
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and max(top.values()) == logprob and top[token] == logprob
    with pytest.raises(openai.BadRequestError) as caught:  # the prompt's are not computed
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=1, echo=True)
    assert caught.value.param == "echo"


def test_streamed_logprobs_arrive_with_their_deltas(client):
    whole = chat(client, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2)
    pieces, entries = [], []
    for chunk in chat(
        client, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2, stream=True
    ):
        for c in chunk.choices:
            if c.delta.content:  # this text's tokens come with it
                assert "".join(e.token for e in c.logprobs.content) == c.delta.content
            if c.logprobs:
                entries += c.logprobs.content
            pieces.append(c.delta.content or "")
    assert "".join(pieces) == whole.choices[0].message.content
    assert entries == whole.choices[0].logprobs.content

    text = {"model": MODEL, "prompt": "One, two,", "temperature": 0, "max_tokens": 6}
    done = client.completions.create(**text, logprobs=1)
    streamed = [c.choices[0] for c in client.completions.create(**text, logprobs=1, stream=True)]
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    assert tokens == done.choices[0].logprobs.tokens
    assert all("".join(c.logprobs.tokens) == c.text for c in streamed if c.text)


def test_n_choices_share_the_prompt_and_each_repeats_with_its_seed(client):
    one = chat(client, temperature=0, max_tokens=8)
    three = chat(client, temperature=0, max_tokens=8, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # counted once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens

    def sampled() -> list[str]:
        answer = chat(client, temperature=1.0, seed=5, max_tokens=10, n=3)
        return [c.message.content for c in answer.choices]

    first = sampled()
    assert sampled() == first and len(set(first)) == 3  # each repeatable, none another's
    alone = chat(client, temperature=1.0, seed=5, max_tokens=10)
    assert first[0] == alone.choices[0].message.content  # choice 0 draws as n=1 does

    finished, usage = {}, None
    for chunk in chat(client, temperature=0, max_tokens=4, n=2, stream=True,
                      stream_options={"include_usage": True}):  # fmt: skip
        usage = chunk.usage or usage
        for c in chunk.choices:
            finished[c.index] = c.finish_reason or finished.get(c.index)
    assert set(finished) == {0, 1} and all(finished.values())
    assert usage is not None and usage.prompt_tokens == one.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=1, n=17)
    assert caught.value.param == "n" and "1 to 16 choices" in caught.value.body["message"]


def test_penalties_change_a_repetitive_answer_and_min_p_cuts(client):
    text = {"model": MODEL, "prompt": REPEAT, "temperature": 0, "max_tokens": 16}
    plain = client.completions.create(**text).choices[0].text
    assert plain.count("1") >= 5 and "2" not in plain, plain  # the model goes on repeating
    penalized = client.completions.create(**text, frequency_penalty=1.5).choices[0].text
    assert penalized.count("1") < plain.count("1"), penalized
    # Presence is a constant shift for what the answer has at all: it breaks an echo.
    echo = [{"role": "user", "content": "Repeat after me: cat cat cat cat cat cat cat cat"}]
    asked = {"model": MODEL, "messages": echo, "temperature": 0, "max_tokens": 16}
    said = client.chat.completions.create(**asked).choices[0].message.content
    present = client.chat.completions.create(**asked, presence_penalty=2.0)
    assert present.choices[0].message.content != said
    # min_p 1 keeps the likeliest token alone: sampling at temperature 1 is then greedy
    greedy = chat(client, temperature=0, max_tokens=10).choices[0].message.content
    only = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=1.0, seed=1, max_tokens=10,
        extra_body={"min_p": 1.0},
    )  # fmt: skip
    assert only.choices[0].message.content == greedy
