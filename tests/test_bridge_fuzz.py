"""Property-based fuzzing of `edgetp serve` from its own OpenAPI schema (schemathesis).

Every operation gets requests generated from the schema, valid and invalid; every response must
be no 5xx, a status the schema lists, and a body of the schema's shape, within a bounded time.
The server runs the real model with a small context, so a valid request generates few tokens.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from edgetp.master.bridge.client import start_server

pytestmark = pytest.mark.slow

KEY = "fuzz-key"
REQUEST_TIMEOUT = 30.0  # s: a hang is a failure, not a stall
EXAMPLES = 40  # per operation and mode
TOOL_FIELDS = ("tools", "functions", "tool_choice", "function_call", "response_format")


@pytest.fixture(scope="module")
def server(shared_state):
    # The run's state folder: its kernel checks were made once for the run, and the master
    # alone reads the model itself (no shards, nothing written that another test reads).
    args = ["--local-nodes", "1", "--context", "64", "--max-batch", "2", "--api-key", KEY]
    args += ["--state-dir", str(shared_state)]
    server = start_server(args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.base}/openapi.json")


def valid_data_is_accepted(ctx, response, case) -> None:
    """Schema-valid requests succeed, but for what no schema here says: the prompt's length,
    whether the model's chat template has a thinking switch, tools and the choice among them
    that do not go together, a JSON schema llguidance cannot use, and the log probabilities'
    combinations (top_logprobs without logprobs, echo with them).

    A prompt that does not fit the context (with max_tokens) is a 400 by OpenAI's rules too;
    the served SmolLM2's template never reads enable_thinking, so setting it is refused; a
    tool_choice that names a tool not given, or needs tools and has none, custom tools, and
    tools with functions would take JSON Schema `if`s to say; a schema (a response format's, a
    forced tool's parameters) is checked by llguidance, not by the OpenAPI document.
    """
    if case.meta.generation.mode.is_positive and response.status_code == 400:
        error = response.json()["error"]
        no_switch = (
            error["param"] == "chat_template_kwargs" and "no thinking block" in error["message"]
        )
        tools = error["param"].split(".")[0] in TOOL_FIELDS and error["code"] in (
            "unsupported_value",  # a combination
            "invalid_value",  # a schema llguidance cannot use
        )
        # top_logprobs without logprobs true (as at OpenAI); echo with logprobs
        logprobs = error["param"] in ("top_logprobs", "echo") and "logprobs" in error["message"]
        allowed = no_switch or tools or logprobs
        assert error["code"] == "context_length_exceeded" or allowed, (
            f"valid data refused: {response.text}"
        )


OPERATIONS = [
    ("GET", "/health", ["positive"]),
    ("GET", "/v1/models", ["positive"]),
    ("GET", "/v1/models/{model}", ["positive", "negative"]),
    ("GET", "/v1/cluster", ["positive"]),
    ("POST", "/v1/chat/completions", ["positive", "negative"]),
    ("POST", "/v1/completions", ["positive", "negative"]),
    ("POST", "/v1/embeddings", ["positive", "negative"]),
]


# Anthropic's, Responses' and Ollama's routes: fuzzed with their clients' server in
# tests/test_bridge_apis.py (bodies of every JSON shape, never a 5xx; malformed ones name the
# field), where a valid body is not refused for lack of a schema here.
FUZZED_WITH_THEIR_CLIENTS = {
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/api/chat"),
    ("POST", "/api/generate"),
    ("POST", "/api/show"),
    ("GET", "/api/tags"),
    ("GET", "/api/ps"),
    ("GET", "/api/version"),
}


def test_every_operation_is_fuzzed(api_schema):
    served = {
        (m.upper(), path) for path, ops in api_schema.raw_schema["paths"].items() for m in ops
    }
    assert served - FUZZED_WITH_THEIR_CLIENTS == {(method, path) for method, path, _ in OPERATIONS}


@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [(method, path, mode) for method, path, modes in OPERATIONS for mode in modes],
)
def test_no_server_error_and_the_schema_holds(api_schema, method, path, mode):
    operation = api_schema[path][method]
    strategy = operation.as_strategy(generation_mode=GenerationMode(mode))

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES,
        deadline=REQUEST_TIMEOUT * 1000,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def fuzz(case):
        sent.append(case)
        case.call_and_validate(
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=REQUEST_TIMEOUT,
            excluded_checks=[positive_data_acceptance],
            additional_checks=[valid_data_is_accepted],
        )

    sent: list = []
    fuzz()
    print(f"{method} {path} {mode}: {len(sent)} requests")
    assert sent
