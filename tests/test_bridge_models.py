"""Several models on one server (`edgetp serve --model A --model B`): both listed, and a request
naming one switches the cluster to it, under traffic, with nothing lost or mixed up; as many
stay resident as the memory budget holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from http_client import HTTP

from edgetp.master.bridge.client import start_server
from edgetp.master.bridge.core import Served
from edgetp.master.bridge.models import _LEASES, ModelChoice, Models
from edgetp.models.config import DEFAULT_MODEL

PROMPTS = {DEFAULT_MODEL: "The capital of France is", "gemma3-270m": "Once upon a time,"}


def _complete(client: openai.OpenAI, model: str, stream: bool) -> str:
    """A greedy continuation of the model's prompt, streamed or whole."""
    asked = dict(model=model, prompt=PROMPTS[model], temperature=0, max_tokens=8)
    if not stream:
        return client.completions.create(**asked).choices[0].text  # type: ignore[call-overload]
    chunks = client.completions.create(stream=True, **asked)  # type: ignore[call-overload]
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.slow
def test_requests_for_two_models_under_traffic_each_get_their_models_answer(shared_state):
    """SmolLM2 and Gemma 3 on one single-device server. Each model's answer alone (asked once,
    the model then resident by itself: the second is loaded for it) is the reference; then 8
    requests at once, alternating the two models, half of them streamed: every one answers,
    each with its model's reference answer, the server switching between them as they come.
    /v1/models and /api/tags list both; a model not served is a 404 that names them. The
    budget holds either model (SmolLM2 ~190 MB, Gemma 3 ~400 MB at this context and 8 slots,
    `plan.resident_bytes`), not both: one is resident at a time."""
    args = ["--local-nodes", "1", "--context", "256", "--state-dir", str(shared_state),
            "--memory-budget", "450MB", "--model", DEFAULT_MODEL,
            "--model", "gemma3-270m"]  # fmt: skip
    server = start_server(args)
    try:
        listed = HTTP.get(f"{server.base}/v1/models", timeout=30).json()["data"]
        tags = HTTP.get(f"{server.base}/api/tags", timeout=30).json()["models"]
        assert len(listed) == 2 and len(tags) == 2, (listed, tags)
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="-", max_retries=0)
        alone = {model: _complete(client, model, False) for model in PROMPTS}
        assert all(alone.values()) and len(set(alone.values())) == 2, alone
        asked = [(list(PROMPTS)[i % 2], i % 4 < 2) for i in range(8)]
        with ThreadPoolExecutor(len(asked)) as pool:
            answers = list(pool.map(lambda a: _complete(client, *a), asked))
        assert answers == [alone[model] for model, _ in asked], (answers, alone)
        switches = [line for line in server.log if "to make room for" in line]
        assert len(switches) >= 3, list(server.log)  # the one for `alone`, two or more here
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="llama-70b", prompt="x", max_tokens=1)
        assert all(m["id"] in str(missing.value) for m in listed), missing.value
        print(f"alone: {alone}; {len(switches)} switches")
    finally:
        server.stop()


def _choices(events: list[str], need: int = 0) -> Callable[[str], ModelChoice]:
    """Models whose loads and closes are the seam (no cluster): what is tested is when `Models`
    loads and closes, told in `events`."""

    def choice(name: str) -> ModelChoice:
        def load() -> tuple[Served, Callable[[], None]]:
            events.append(f"load {name}")
            served = Served(None, None, name)  # type: ignore[arg-type]
            return served, lambda: events.append(f"close {name}")

        return ModelChoice(name, (), 0, load, need)

    return choice


def test_models_stay_resident_as_the_budget_holds_them_the_least_recently_used_leaving():
    """A budget of two models' needs: a second is loaded beside the first, a third in place
    of the one used least recently, once its running request is done; a request for a model
    that is to leave waits too, and is answered after it, so none starves."""
    events: list[str] = []
    choice = _choices(events, need=100)
    a, b, c = choice("a"), choice("b"), choice("c")

    async def lease(models: Models, name: str) -> list[Served]:
        leases: list[Served] = []
        token = _LEASES.set(leases)
        try:
            await models.use(name)
        finally:
            _LEASES.reset(token)
        return leases

    async def scenario() -> None:
        models = Models([a, b, c], a.load(), budget=250)
        held_a = await lease(models, "a")
        held_b = await lease(models, "b")  # beside a: 200 of 250
        assert events == ["load a", "load b"]
        assert [s.model_id for s in models.resident] == ["a", "b"]
        for served in held_b:
            models.release(served)
        held_a += await lease(models, "a")  # b is now the least recently used
        for_c = asyncio.create_task(lease(models, "c"))
        await asyncio.sleep(0.05)
        assert events == ["load a", "load b", "close b", "load c"]  # a holds its leases
        assert [s.model_id for s in models.resident] == ["a", "c"]
        held_c = await for_c
        # Room for one only: b needs a and c gone, both leased. A request for a, which is to
        # leave, waits behind b's; each model leaves once its leases are given back.
        models.budget = 150
        for_b = asyncio.create_task(lease(models, "b"))
        await asyncio.sleep(0.05)
        for_a = asyncio.create_task(lease(models, "a"))
        await asyncio.sleep(0.05)
        assert not for_b.done() and not for_a.done()
        assert events[-1] == "load c"  # nothing closed under a lease
        models.release(held_c[0])
        await asyncio.sleep(0.05)
        assert events[-1] == "close c" and not for_b.done()
        for served in held_a:
            models.release(served)
        held_b = await for_b
        assert events[-2:] == ["close a", "load b"] and not for_a.done()
        models.release(held_b[0])
        held_a = await for_a
        assert events[-2:] == ["close b", "load a"]
        assert [s.model_id for s in models.resident] == ["a"]
        # A request for c marks a, leased, to leave, and one for a waits behind it; c's goes
        # away (its client left): a stays, and the request for it goes on, nothing reloaded.
        for_c = asyncio.create_task(lease(models, "c"))
        await asyncio.sleep(0.05)
        for_a = asyncio.create_task(lease(models, "a"))
        await asyncio.sleep(0.05)
        assert not for_a.done()
        for_c.cancel()
        held_a += await asyncio.wait_for(for_a, 5)
        assert events[-2:] == ["close b", "load a"]

    asyncio.run(scenario())


def test_a_model_idle_for_unload_after_is_unloaded_and_the_next_request_loads_it():
    """`--unload-after`: the resident model, without a lease for that long, is closed; a later
    request for it loads it again."""
    events: list[str] = []
    choice = _choices(events)

    async def scenario() -> None:
        a = choice("a")
        models = Models([a, choice("b")], a.load(), unload_after=0.2)
        unloading = asyncio.create_task(models.unload_idle())
        token = _LEASES.set([])
        held = await models.use("a")  # a lease: not idle while held
        await asyncio.sleep(0.6)
        assert events == ["load a"] and models.current is held
        models.release(held)
        await asyncio.sleep(1.5)
        assert events == ["load a", "close a"] and models.current is None
        assert (await models.use(None)).model_id == "a"  # the first, loaded again
        assert events == ["load a", "close a", "load a"]
        unloading.cancel()
        _LEASES.reset(token)

    asyncio.run(scenario())
