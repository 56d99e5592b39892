"""Membership as a state machine (master/cluster/membership.py): every (state, event) pair, written
out
as a table, against `apply`; and a node's life through the Hub's events in order."""

from __future__ import annotations

import itertools

import pytest

from edgetp.master.cluster import membership as S
from edgetp.master.cluster.membership import State

EVENTS = {
    "taken_in": S.TakenIn(),
    "welcomed": S.Welcomed(),
    "ready": S.Ready(),
    "failed": S.Failed("it stopped answering"),
    "superseded": S.Superseded(),
    "left_out": S.LeftOut("its link would slow every token"),
    "closed": S.Closed("master shutting down"),
}
BYE_DROPPED = ("bye", "dropped", True)  # told BYE, asked to join again
BYE_CLOSED = ("bye", "master shutting down", None)
INVALID = "invalid"
P, PL, LO, SE, SB, LS, GO = (State.PENDING, State.PLANNED, State.LOADING, State.SERVING,
                             State.STANDBY, State.LOST, State.GONE)  # fmt: skip

# state -> event -> (the state after, the effects: "forget" the heartbeat, "bye", "standby")
TABLE: dict[State, dict[str, object]] = {
    P: {
        "taken_in": (PL, []), "welcomed": INVALID, "ready": (P, []),
        "failed": (GO, ["forget", BYE_DROPPED]), "superseded": (GO, []), "left_out": INVALID,
        "closed": (GO, [BYE_CLOSED]),
    },
    PL: {
        "taken_in": (PL, []), "welcomed": (LO, []), "ready": (PL, []), "failed": (LS, []),
        "superseded": (LS, []), "left_out": (SB, ["standby"]), "closed": (GO, [BYE_CLOSED]),
    },
    LO: {
        "taken_in": (PL, []), "welcomed": INVALID, "ready": (SE, []), "failed": (LS, []),
        "superseded": (LS, []), "left_out": INVALID, "closed": (GO, [BYE_CLOSED]),
    },
    SE: {
        "taken_in": (PL, []), "welcomed": INVALID, "ready": (SE, []), "failed": (LS, []),
        "superseded": (LS, []), "left_out": INVALID, "closed": (GO, [BYE_CLOSED]),
    },
    SB: {
        "taken_in": (PL, []), "welcomed": INVALID, "ready": (SB, []),
        "failed": (GO, ["forget", BYE_DROPPED]), "superseded": (GO, []), "left_out": (SB, []),
        "closed": (GO, [BYE_CLOSED]),
    },
    LS: {
        "taken_in": (GO, ["forget", BYE_DROPPED]), "welcomed": INVALID, "ready": (LS, []),
        "failed": (LS, []), "superseded": (LS, []), "left_out": INVALID, "closed": (GO, []),
    },
    GO: {
        "taken_in": (GO, []), "welcomed": INVALID, "ready": (GO, []), "failed": (GO, []),
        "superseded": (GO, []), "left_out": INVALID, "closed": (GO, []),
    },
}  # fmt: skip


def _kinds(effects: list[S.Effect]) -> list[object]:
    out: list[object] = []
    for effect in effects:
        if isinstance(effect, S.SendBye):
            reason = "dropped" if effect.reason.startswith("dropped") else effect.reason
            out.append(("bye", reason, effect.rejoin))
        else:
            out.append("standby" if isinstance(effect, S.SendStandby) else "forget")
    return out


def test_the_table_covers_every_state_and_every_event():
    assert set(TABLE) == set(State)
    assert all(set(row) == set(EVENTS) for row in TABLE.values())
    assert set(type(e) for e in EVENTS.values()) == set(S.Event.__args__)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("state", "event"), list(itertools.product(State, EVENTS)), ids=lambda v: getattr(v, "value", v)
)
def test_every_transition(state, event):
    status = S.Status(state, failure="it left" if state is LS else "")
    want = TABLE[state][event]
    if want == INVALID:
        with pytest.raises(S.InvalidTransition):
            S.apply(status, EVENTS[event])
        return
    after, effects = S.apply(status, EVENTS[event])
    assert (after.state, _kinds(effects)) == want


def test_a_lost_node_keeps_its_first_failure_and_is_told_it():
    lost, _ = S.apply(S.Status(SE), S.Failed("RuntimeError: out of memory"))
    lost, _ = S.apply(lost, S.Failed("it stopped answering"))
    gone, effects = S.apply(lost, S.TakenIn())
    assert gone.state is GO
    assert effects == [
        S.ForgetHeartbeat(),
        S.SendBye("dropped from the plan (RuntimeError: out of memory)", True),
    ]


def test_a_node_too_small_for_its_share_is_not_asked_to_join_again():
    lost, _ = S.apply(S.Status(LO), S.Failed("too small", rejoin=False))
    bye = S.SendBye("dropped from the plan (too small)", False)
    assert S.apply(lost, S.TakenIn())[1][-1] == bye


def test_a_planned_node_whose_process_joined_again_is_dropped_without_a_bye():
    """The new process has its identity: a BYE would reach the new one."""
    lost, _ = S.apply(S.Status(SE), S.Superseded())
    assert (lost.state, lost.failure) == (LS, "it joined again")
    assert S.apply(lost, S.TakenIn()) == (S.Status(GO, "it joined again", True, True), [
        S.ForgetHeartbeat()
    ])  # fmt: skip


def test_a_node_s_life():
    status, seen = S.Status(), []
    life = [S.TakenIn(), S.Welcomed(), S.Ready(), S.TakenIn(), S.LeftOut("slow link")]
    life += [S.TakenIn(), S.Welcomed(), S.Ready(), S.Failed("it left"), S.TakenIn()]
    for event in life:
        status, _ = S.apply(status, event)
        seen.append(status.state)
    assert seen == [PL, LO, SE, PL, SB, PL, LO, SE, LS, GO]
