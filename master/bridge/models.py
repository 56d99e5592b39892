"""The models a server answers for (`edgetp serve --model A --model B`), one resident at a time.

A request names its model; each takes a lease on it (`Models.use`) that lasts until its answer
is sent (`Leases`, a plain ASGI middleware, hands them back). A request for a model that is not
resident waits; once the resident model has no lease left (its running streams are finished),
the cluster switches to the model of the oldest waiting request: the resident's session and
batcher close and that model's open, and every request waiting for it goes on. A request for the
resident model that comes while another model's request waits, waits too, so no model starves.
A model left without a lease for `unload_after` seconds is unloaded; the next request loads it.
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

log = logging.getLogger(__name__)

_LEASES: contextvars.ContextVar[list[Served]] = contextvars.ContextVar("edgetp_leases")


@dataclass(frozen=True)
class ModelChoice:
    """A model the server may load: its id, the other names a request may use, its file's
    time (for /v1/models), and how to load it (its Served and how to close it)."""

    model_id: str
    aliases: tuple[str, ...]
    created: int
    load: Callable[[], tuple[Served, Callable[[], None]]] = field(compare=False)

    def named(self, model: str) -> bool:
        return model in (self.model_id, *self.aliases)


class Models:
    """Which model is resident, who holds it, and who waits for which (see the module)."""

    def __init__(
        self,
        choices: Sequence[ModelChoice],
        resident: tuple[Served, Callable[[], None]] | None = None,
        unload_after: float | None = None,
    ) -> None:
        self.choices = list(choices)
        self._resident: ModelChoice | None = self.choices[0] if resident else None
        self._served: Served | None = resident[0] if resident else None
        self._close: Callable[[], None] | None = resident[1] if resident else None
        self._held = 0  # leases on the resident model
        self._waiting: list[_Waiter] = []  # requests waiting for a model, oldest first
        self._switching = False
        self._wake = asyncio.Event()
        self._idle_since = time.monotonic()
        self.unload_after = unload_after
        self.failure = ""  # why the last load failed

    @classmethod
    def single(cls, served: Served) -> Models:
        """One model, resident already (closed by its owner, not here)."""
        choice = ModelChoice(served.model_id, served.aliases, served.created, lambda: (served, _no))
        return cls([choice], (served, _no))

    @property
    def current(self) -> Served | None:
        """The resident model's, if one is."""
        return self._served

    def choice(self, model: str | None) -> ModelChoice:
        """The model a request names (None: the resident one, else the first), or a 404 that
        lists the models there are."""
        if model is None:
            return self._resident or self.choices[0]
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
        back; waits while another model is resident or is waited for first."""
        wanted = self.choice(model)
        if not (wanted is self._resident and not self._others_wait(wanted)):
            waiter = _Waiter(wanted)
            self._waiting.append(waiter)
            try:
                await self._until_resident(waiter)
            finally:
                self._waiting.remove(waiter)
                self._notify()
        assert self._served is not None
        self._held += 1
        leases = _LEASES.get(None)
        if leases is not None:
            leases.append(self._served)
        else:  # not through the app (no middleware): nothing would give it back
            self._held -= 1
        return self._served

    def _others_wait(self, wanted: ModelChoice) -> bool:
        return any(w.choice is not wanted for w in self._waiting)

    async def _until_resident(self, waiter: _Waiter) -> None:
        wanted = waiter.choice
        while True:
            if wanted is self._resident and not self._switching:
                # loaded for the oldest waiter: every request then waiting for it goes on
                first = self._waiting[0] is waiter
                if first or waiter.admitted or not self._others_wait(wanted):
                    return
            elif not self._switching and self._held == 0 and self._waiting[0] is waiter:
                await self._switch(wanted)
                continue
            wake = self._wake
            await wake.wait()

    async def _switch(self, to: ModelChoice) -> None:
        """Close the resident model and load `to` (on a thread: it splits and ships)."""
        self._switching = True
        try:
            if self._close is not None:
                log.warning("switching from %s to %s", self._served and self._served.model_id,
                            to.model_id)  # fmt: skip
                closing, self._close, self._served, self._resident = self._close, None, None, None
                await run_in_threadpool(closing)
            try:
                self._served, self._close = await run_in_threadpool(to.load)
            except Exception as exc:
                self.failure = f"model {to.model_id!r} could not be loaded: {exc}"
                log.error("%s", self.failure)
                raise APIError(
                    503, self.failure, type="server_error", code="model_unavailable"
                ) from None
            self._resident, self.failure = to, ""
            for w in self._waiting:
                w.admitted = w.admitted or w.choice is to
        finally:
            self._switching = False
            self._notify()

    def release(self, served: Served) -> None:
        """A lease given back (its request's answer was sent, or the request went away)."""
        if served is self._served:
            self._held -= 1
            if self._held == 0:
                self._idle_since = time.monotonic()
        self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def unload_idle(self) -> None:
        """Unload the resident model once it has been without a lease for `unload_after` s."""
        while self.unload_after is not None:
            await asyncio.sleep(min(1.0, self.unload_after))
            idle = time.monotonic() - self._idle_since
            if (
                self._close is not None
                and self._held == 0
                and not self._waiting
                and not self._switching
                and idle >= self.unload_after
            ):
                log.warning("unloading %s: idle for %.0f s", self._resident and
                            self._resident.model_id, idle)  # fmt: skip
                self._switching = True
                closing, self._close, self._served, self._resident = self._close, None, None, None
                try:
                    await run_in_threadpool(closing)
                finally:
                    self._switching = False
                    self._notify()

    def close(self) -> None:
        """Close the resident model (the server is stopping)."""
        if self._close is not None:
            closing, self._close = self._close, None
            closing()


@dataclass
class _Waiter:
    """A request waiting for its model; `admitted` once a switch loaded that model for it."""

    choice: ModelChoice
    admitted: bool = False


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
