"""Waiting on what a test waits for, not for a time.

A test waits for an event: a condition polled until it holds, or a call until it returns. The
deadline only turns a hang into a failure that says what never came; it is no speed bar, so
give it the time after which a wait is known to be stuck, not the time the thing usually takes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from textual.pilot import Pilot

T = TypeVar("T")

POLL_S = 0.02  # how often a condition is looked at: cheap, and far below any wait here


def _said(what: str | Callable[[], object]) -> str:
    return what if isinstance(what, str) else str(what())


def wait_until(condition: Callable[[], T], timeout: float, what: str | Callable[[], object]) -> T:
    """`condition()`'s first true value, looked at every POLL_S s. AssertionError naming `what`
    (a string, or a callable that describes the state at the failure) if it does not come
    within `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {_said(what)} within {timeout:g} s")
        time.sleep(POLL_S)
    return value


async def until_shown(
    pilot: Pilot,
    condition: Callable[[], object],
    timeout: float,
    what: str | Callable[[], object],
) -> float:
    """Seconds until `condition()` holds in a Textual app, which runs its events meanwhile (the
    seconds are a figure to print, not one to bound). AssertionError naming `what` (as
    `wait_until`'s) after `timeout` s."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started >= timeout:
            raise AssertionError(f"no {_said(what)} within {timeout:g} s")
        await pilot.pause(POLL_S)
    return time.monotonic() - started


def returns_within(call: Callable[[], T], timeout: float, what: str) -> T:
    """What `call()` returns or raises, called in a thread of its own; AssertionError if it
    has not returned within `timeout` s (a hang: the thread is left behind, a daemon)."""
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=f"returns_within: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    assert outcome, f"{what} did not return within {timeout:g} s: it hangs"
    ok, value = outcome[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]
