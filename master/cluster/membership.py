"""A worker's membership of the cluster, as a pure state machine: `apply(status, event)`; and
what the master knows of each worker (`Member`).

The Hub (master/cluster/hub.py) is the I/O around it: it turns messages, silences and plans into
events, applies them, and carries out the effects (the BYE or STANDBY to send, the heartbeat to
forget). Every rule of who is in the plan, who waits and who is dropped is here, and
tests/test_membership_states.py checks every (state, event) pair.

    PENDING --TakenIn--> PLANNED --Welcomed--> LOADING --Ready--> SERVING
    PLANNED --LeftOut--> STANDBY           (its link would slow every token; weighed again later)
    PLANNED, LOADING, SERVING --Failed--> LOST --TakenIn--> GONE (told BYE)
    PENDING, STANDBY --Failed--> GONE (told BYE: no plan waits on it)
    every live state --TakenIn--> PLANNED (a re-plan weighs everyone again)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from edgetp.memory.window import FIGURES_KEPT
from edgetp.node.messages import Capacity


class State(Enum):
    PENDING = "pending"  # joined; takes a share when the next plan is made
    PLANNED = "planned"  # in the plan being made, not yet told its slice
    LOADING = "loading"  # told its slice (WELCOME): fetching and loading it
    SERVING = "serving"  # its slice loaded (READY): computes its partials
    STANDBY = "standby"  # left out of this plan, joined and beating; weighed again at the next
    LOST = "lost"  # failed, left or went silent while in the plan: dropped at the next re-plan
    GONE = "gone"  # dropped: the hub no longer holds it


# The states of a node the current plan counts on (or the plan being made counts in).
IN_PLAN = frozenset({State.PLANNED, State.LOADING, State.SERVING, State.LOST})
ALIVE = frozenset({State.PENDING, State.PLANNED, State.LOADING, State.SERVING, State.STANDBY})


@dataclass(frozen=True)
class Status:
    state: State = State.PENDING
    failure: str = ""  # why it was lost, in words
    rejoin: bool = True  # once dropped, whether it is asked to join again (not if too small)
    superseded: bool = False  # a new process of the same identity took its place: no BYE


# -- events ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TakenIn:
    """A plan is about to be made: everyone alive is weighed in it; the lost are dropped."""


@dataclass(frozen=True)
class Welcomed:
    """The plan told it its slice (WELCOME)."""


@dataclass(frozen=True)
class Ready:
    """It said READY: its slice is loaded."""


@dataclass(frozen=True)
class Failed:
    """It said ERROR or LEAVE, sent what it should not, went silent or is unreachable."""

    why: str
    rejoin: bool = True


@dataclass(frozen=True)
class Superseded:
    """A new process with its identity joined (restarted, or joining again)."""


@dataclass(frozen=True)
class LeftOut:
    """The plan leaves it out, for `reason`."""

    reason: str


@dataclass(frozen=True)
class Closed:
    """The master shuts down, for `reason`."""

    reason: str


Event = TakenIn | Welcomed | Ready | Failed | Superseded | LeftOut | Closed


# -- effects: what the hub does for a transition ---------------------------------------------
@dataclass(frozen=True)
class SendBye:
    reason: str
    rejoin: bool | None  # None: the master shuts down


@dataclass(frozen=True)
class SendStandby:
    reason: str


@dataclass(frozen=True)
class ForgetHeartbeat:
    pass


Effect = SendBye | SendStandby | ForgetHeartbeat


class InvalidTransition(Exception):
    """An event that cannot happen in this state: a bug in the caller, not a node's doing."""


def apply(status: Status, event: Event) -> tuple[Status, list[Effect]]:
    """The status after `event`, and what the hub must do for it."""
    state = status.state
    if isinstance(event, Welcomed | LeftOut) and state is not State.PLANNED:
        if isinstance(event, LeftOut) and state is State.STANDBY:
            return status, []  # left out again
        raise InvalidTransition(f"{type(event).__name__} for a node that is {state.value}")
    if state is State.GONE:
        return status, []  # a message that was on its way when it was dropped
    if isinstance(event, TakenIn):
        if state is State.LOST:
            return _dropped(status, f"dropped from the plan ({status.failure})", status.rejoin)
        return replace(status, state=State.PLANNED), []
    if isinstance(event, Welcomed):
        return replace(status, state=State.LOADING), []
    if isinstance(event, LeftOut):
        return replace(status, state=State.STANDBY), [SendStandby(event.reason)]
    if isinstance(event, Ready):
        return (
            (replace(status, state=State.SERVING), []) if state is State.LOADING else (status, [])
        )
    if isinstance(event, Closed):
        if state is State.LOST:
            return replace(status, state=State.GONE), []
        return replace(status, state=State.GONE), [SendBye(event.reason, None)]
    if isinstance(event, Superseded):
        if state in IN_PLAN:  # the plan counted on the old process: re-plan without it
            lost = replace(status, state=State.LOST, superseded=True)
            return lost if status.failure else replace(lost, failure="it joined again"), []
        return replace(status, state=State.GONE), []  # no plan holds it: the new one takes over
    # Failed
    if state is State.LOST:
        return status, []  # its first failure says why; the others say no more
    if state in IN_PLAN:
        return replace(status, state=State.LOST, failure=event.why, rejoin=event.rejoin), []
    where = "standby" if state is State.STANDBY else "the nodes waiting for a plan"
    failed = replace(status, failure=event.why, rejoin=event.rejoin)
    return _dropped(failed, f"dropped from {where} ({event.why})", event.rejoin)


def _dropped(status: Status, why: str, rejoin: bool) -> tuple[Status, list[Effect]]:
    """GONE, its heartbeat forgotten, and told why (so that one merely paused joins again when
    it wakes), unless a new process of its identity took its place."""
    effects: list[Effect] = [ForgetHeartbeat()]
    if not status.superseded:
        effects.append(SendBye(why, rejoin))
    return replace(status, state=State.GONE), effects


@dataclass(frozen=True)
class Link:
    """A worker's link to the master, as the master timed it with ECHOs: the round trip of a
    message the size of a sum's (Hub.measure_links), and the bytes a second a large one added
    (inf: too fast to tell apart from the round trip's noise)."""

    rtt_s: float
    bytes_per_s: float


@dataclass
class Member:
    """A worker the hub knows: who it is, what it can do, its membership status and its part of
    the plan."""

    identity: bytes
    name: str
    capacity: Capacity
    model: str | None
    address: str = ""
    status: Status = field(default_factory=Status)
    beat_seen: bool = False  # its heartbeat came since it was told its slice
    window: int | None = None  # layers of its slice in memory, as planned
    slice: dict[str, list[int]] | None = None  # its share of every layer, as planned
    head_rows: int = 0  # its rows of the lm_head, as planned
    link: Link | None = None  # as last timed (Hub.measure_links); None: not timed
    # Its latest step's figures (loader, memory), and every step's since the last clear.
    figures: dict[str, Any] = field(default_factory=dict)
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=FIGURES_KEPT))

    @property
    def state(self) -> State:
        return self.status.state

    @property
    def alive(self) -> bool:
        return self.status.state in ALIVE

    @property
    def ready(self) -> bool:
        return self.status.state is State.SERVING

    @property
    def failure(self) -> str:
        """Why it was lost, when it was."""
        return self.status.failure
