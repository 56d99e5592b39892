"""`edgetp serve`'s /metrics, read by Prometheus' own parser, and CORS by option, asked as a
browser asks: a real server process, real HTTP clients."""

from __future__ import annotations

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest
from http_client import HTTP
from prometheus_client.parser import text_string_to_metric_families

from edgetp.master.bridge.client import start_server

ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def server(shared_state):
    args = ["--local-nodes", "1", "--state-dir", str(shared_state), "--context", "256"]
    server = start_server([*args, "--cors-origin", ORIGIN])
    try:
        yield server
    finally:
        server.stop()


def _metrics(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = HTTP.get(f"{base}/metrics", timeout=30)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


@pytest.mark.slow
def test_metrics_count_what_was_served(server):
    before = _metrics(server.base)
    assert before[("edgetp_up", ())] == 1.0
    assert before[("edgetp_nodes", (("state", "serving"),))] == 0.0  # the master alone
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    for _ in range(2):
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
        )
    after = _metrics(server.base)
    done = ("edgetp_requests_total", (("outcome", "completed"),))
    assert after[done] - before.get(done, 0.0) == 2
    generated = after[("edgetp_completion_tokens_total", ())]
    generated -= before[("edgetp_completion_tokens_total", ())]
    assert generated == 2 * chat.usage.completion_tokens
    prompt = after[("edgetp_prompt_tokens_total", ())] - before[("edgetp_prompt_tokens_total", ())]
    assert prompt == 2 * chat.usage.prompt_tokens
    assert after[("edgetp_requests_running", ())] == 0
    assert after[("edgetp_slots", ())] >= 1


@pytest.mark.slow
def test_an_embeddings_request_counts_as_a_request_in_the_metrics_and_the_cluster(server):
    """/metrics and /v1/cluster's generation figures (the chat panel's) count it, its inputs'
    tokens with the prompts'."""
    figures = HTTP.get(f"{server.base}/v1/cluster", timeout=30).json()["generation"]
    before = _metrics(server.base)
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0)
    made = client.embeddings.create(model=client.models.list().data[0].id,
                                    input=["one input", "and another"])  # fmt: skip
    after = _metrics(server.base)
    for outcome in ("submitted", "completed"):
        counted = ("edgetp_requests_total", (("outcome", outcome),))
        assert after[counted] - before.get(counted, 0.0) == 1
    prompt = after[("edgetp_prompt_tokens_total", ())] - before[("edgetp_prompt_tokens_total", ())]
    assert prompt == made.usage.prompt_tokens > 0
    assert after[("edgetp_requests_waiting", ())] == 0  # nothing left in the line
    now = HTTP.get(f"{server.base}/v1/cluster", timeout=30).json()["generation"]
    assert now["submitted"] - figures["submitted"] == 1
    assert now["completed"] - figures["completed"] == 1
    assert now["prompt_tokens"] - figures["prompt_tokens"] == made.usage.prompt_tokens


@pytest.mark.slow
def test_a_page_from_the_allowed_origin_may_call_the_api_and_no_other(server):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    allowed = httpx.options(f"{server.base}/v1/chat/completions",
                            headers={"Origin": ORIGIN, **preflight}, timeout=30)  # fmt: skip
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    other = httpx.options(f"{server.base}/v1/chat/completions",
                          headers={"Origin": "http://other.test", **preflight})  # fmt: skip
    assert "access-control-allow-origin" not in other.headers
    models = HTTP.get(f"{server.base}/v1/models", headers={"Origin": ORIGIN}, timeout=30)
    assert models.headers["access-control-allow-origin"] == ORIGIN
