"""The models a server answers for (`edgetp serve --model A --model B`): as many resident as the
memory budget holds, at least one.

A request names its model; each takes a lease on it (`Models.use`) that lasts until its answer
is sent (`Leases`, a plain ASGI middleware, hands them back). A request for a resident model goes
on at once. One for a model that is not resident waits in line; the oldest waiting is loaded
beside the resident ones where the budget holds them all (each model's `need`, what it holds with
every layer resident and its KV cache full), and otherwise in place of the least recently used:
those take no new lease (a request for one of them waits too, so no model starves), and each is
closed once its running streams are finished. Loads and closes run one at a time, on a thread;
the other resident models answer meanwhile. Without a budget one model is resident at a time. A
model left without a lease for `unload_after` seconds is unloaded; the next request loads it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from edgetp.master.bridge.core import Served
from edgetp.master.bridge.errors import APIError
from edgetp.memory.budget import format_size

log = logging.getLogger(__name__)

_LEASES: contextvars.ContextVar[list[Served]] = contextvars.ContextVar("edgetp_leases")


@dataclass(frozen=True)
class ModelChoice:
    """A model the server may load: its id, the other names a request may use, its file's
    time (for /v1/models), how to load it (its Served and how to close it), and about the
    memory it holds once loaded (bytes; `plan.resident_bytes`)."""

    model_id: str
    aliases: tuple[str, ...]
    created: int
    load: Callable[[], tuple[Served, Callable[[], None]]] = field(compare=False)
    need: int = 0

    def named(self, model: str) -> bool:
        return model in (self.model_id, *self.aliases)


@dataclass(eq=False)
class _Loaded:
    """A resident model: its Served, how to close it, the leases on it, since when it has had
    none, and whether it is to make room (it takes no new lease)."""

    served: Served
    close: Callable[[], None]
    held: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    leaving: bool = False


class Models:
    """Which models are resident, who holds them, and who waits for which (see the module)."""

    def __init__(
        self,
        choices: Sequence[ModelChoice],
        resident: tuple[Served, Callable[[], None]] | None = None,
        unload_after: float | None = None,
        budget: int | None = None,
    ) -> None:
        self.choices = list(choices)
        # resident models, the least recently used first
        self._resident: dict[ModelChoice, _Loaded] = {}
        if resident:
            self._resident[self.choices[0]] = _Loaded(*resident)
        self._waiting: list[_Waiter] = []  # requests waiting for a model, oldest first
        self._busy = False  # a load or a close is running
        self._wake = asyncio.Event()
        self.unload_after = unload_after
        self.budget = budget
        self.failure = ""  # why the last load failed

    @classmethod
    def single(cls, served: Served) -> Models:
        """One model, resident already (closed by its owner, not here)."""
        choice = ModelChoice(served.model_id, served.aliases, served.created, lambda: (served, _no))
        return cls([choice], (served, _no))

    @property
    def current(self) -> Served | None:
        """The resident model used last, if one is."""
        return next(reversed([r.served for r in self._resident.values()]), None)

    @property
    def resident(self) -> list[Served]:
        """Every resident model's, the least recently used first."""
        return [r.served for r in self._resident.values()]

    def choice(self, model: str | None) -> ModelChoice:
        """The model a request names (None: the resident one used last, else the first), or a
        404 that lists the models there are."""
        if model is None:
            return next(reversed(list(self._resident)), self.choices[0])
        for c in self.choices:
            if c.named(model) or c.named(model.removesuffix(":latest")):  # (Ollama's tag)
                return c
        ids = " or ".join(repr(c.model_id) for c in self.choices)
        raise APIError(
            404,
            f"model {model!r} is not served here: use {ids} (GET /v1/models), or leave the "
            "field out",
            param="model",
            code="model_not_found",
        )

    async def use(self, model: str | None) -> Served:
        """The named model's Served, resident, with a lease on it that its request's end gives
        back; waits while it is not resident, or is to make room for another."""
        wanted = self.choice(model)
        if not self._open(wanted):
            waiter = _Waiter(wanted)
            self._waiting.append(waiter)
            try:
                await self._until_resident(waiter)
            finally:
                self._waiting.remove(waiter)
                if not self._waiting:  # nobody left to make room for
                    for loaded in self._resident.values():
                        loaded.leaving = False
                self._notify()
        loaded = self._resident.pop(wanted)
        self._resident[wanted] = loaded  # the most recently used now
        leases = _LEASES.get(None)
        if leases is not None:
            loaded.held += 1
            leases.append(loaded.served)
        # else: not through the app (no middleware), nothing would give it back
        return loaded.served

    def _open(self, choice: ModelChoice) -> bool:
        loaded = self._resident.get(choice)
        return loaded is not None and not loaded.leaving

    async def _until_resident(self, waiter: _Waiter) -> None:
        while not self._open(waiter.choice):
            wake = self._wake
            if self._busy or self._waiting[0] is not waiter or not await self._step(waiter.choice):
                await wake.wait()

    def _fits(self, choice: ModelChoice, beside: Sequence[ModelChoice]) -> bool:
        if not beside:
            return True
        if self.budget is None:
            return False
        return choice.need + sum(c.need for c in beside) <= self.budget

    async def _step(self, to: ModelChoice) -> bool:
        """One step towards `to` resident, for the oldest waiting request: load it where it fits
        beside the resident models; else mark the least recently used to leave, as many as it
        takes, and close one of them without a lease. False: nothing to do until a lease of
        those is given back."""
        for loaded in self._resident.values():
            loaded.leaving = False
        if to in self._resident:  # it was to leave for a request that went away
            return True
        kept = list(self._resident)
        while kept and not self._fits(to, kept):
            self._resident[kept.pop(0)].leaving = True
        leaving = [c for c, r in self._resident.items() if r.leaving]
        if not leaving:
            await self._load(to)
            return True
        idle = [c for c in leaving if self._resident[c].held == 0]
        if idle:
            await self._close(idle[0], f"to make room for {to.model_id}")
            return True
        return False

    async def _close(self, choice: ModelChoice, why: str) -> None:
        self._busy = True
        try:
            log.warning("unloading %s (%s)", choice.model_id, why)
            closing = self._resident.pop(choice).close
            await run_in_threadpool(closing)
        finally:
            self._busy = False
            self._notify()

    async def _load(self, to: ModelChoice) -> None:
        self._busy = True
        try:
            beside = [c.model_id for c in self._resident]
            log.warning("loading %s%s", to.model_id,
                        f" beside {', '.join(beside)}" if beside else "")  # fmt: skip
            try:
                loaded = _Loaded(*await run_in_threadpool(to.load))
            except Exception as exc:
                self.failure = f"model {to.model_id!r} could not be loaded: {exc}"
                log.error("%s", self.failure)
                raise APIError(
                    503, self.failure, type="server_error", code="model_unavailable"
                ) from None
            self._resident[to], self.failure = loaded, ""
            if beside:
                held = sum(c.need for c in self._resident)
                log.info("%d models resident, about %s of the budget's %s", len(self._resident),
                         format_size(held), format_size(self.budget or 0))  # fmt: skip
        finally:
            self._busy = False
            self._notify()

    def release(self, served: Served) -> None:
        """A lease given back (its request's answer was sent, or the request went away)."""
        for loaded in self._resident.values():
            if loaded.served is served:
                loaded.held -= 1
                if loaded.held == 0:
                    loaded.idle_since = time.monotonic()
        self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def unload_idle(self) -> None:
        """Unload each resident model once it has been without a lease for `unload_after` s."""
        while self.unload_after is not None:
            await asyncio.sleep(min(1.0, self.unload_after))
            now = time.monotonic()
            for choice, loaded in list(self._resident.items()):
                idle = now - loaded.idle_since
                if not self._busy and loaded.held == 0 and idle >= self.unload_after:
                    await self._close(choice, f"idle for {idle:.0f} s")

    def close(self) -> None:
        """Close every resident model (the server is stopping)."""
        while self._resident:
            _, loaded = self._resident.popitem()
            loaded.close()


@dataclass
class _Waiter:
    """A request waiting for its model (a waiter of its own: the line holds one per request)."""

    choice: ModelChoice


def _no() -> None:
    return None


class Leases:
    """Plain ASGI middleware: each request's leases (`Models.use`) go back when its answer has
    been sent or its client went away, whatever the route did in between."""

    def __init__(self, app: Any, models: Models) -> None:
        self.app = app
        self.models = models

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[Served] = []
        token = _LEASES.set(leases)
        try:
            await self.app(scope, receive, send)
        finally:
            _LEASES.reset(token)
            for served in leases:
                self.models.release(served)
