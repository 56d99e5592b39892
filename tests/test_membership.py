"""Workers joining and leaving between requests: re-plan, ship only what changed, same answer."""

from __future__ import annotations

import signal
import time

import pytest
from cluster_threads import master_threads

from master.cluster import Hub
from master.generate import start, stream
from master.local import LocalWorkers
from master.params import SamplingParams
from master.session import Session

pytestmark = pytest.mark.slow

PROMPT = "List three uses of a paperclip:"


def answer(session: Session, tokenizer) -> list[int]:
    (g,) = start(session.engine, [tokenizer.encode(PROMPT)], [SamplingParams(max_tokens=24)])
    for _ in stream(session.engine, tokenizer, [g]):
        pass
    return g.tokens


@master_threads(3)
def test_join_and_leave_between_requests(smollm2, smollm2_tokenizer, tmp_path):
    hub = Hub("127.0.0.1", 0, model_names=(smollm2.name,))
    session = Session(smollm2, hub, tmp_path / "master", 128, 1, equal_shares=True)
    # Each worker has a state folder of its own, so what ships to it is counted.
    first = LocalWorkers(1, hub.port, 1, tmp_path / "w1", False, hub.token, first=1)
    second = None
    try:
        session.start(workers=1, timeout=120)
        shipped_first = hub.shipped_bytes
        one = answer(session, smollm2_tokenizer)
        assert not session.replan_if_changed()

        second = LocalWorkers(1, hub.port, 1, tmp_path / "w2", False, hub.token, first=2)
        assert session.replan_if_changed(wait=60)
        shipped_join = hub.shipped_bytes - shipped_first
        assert [m.name for m in hub.members] == ["local-1", "local-2"]
        assert len(session.engine.slices) == 1  # the master's own; two workers hold the rest
        two = answer(session, smollm2_tokenizer)

        second.procs[0].send_signal(signal.SIGINT)  # a worker leaves
        before_leave = hub.shipped_bytes
        deadline = time.monotonic() + 30
        while not session.replan_if_changed(wait=0.5):
            assert time.monotonic() < deadline, "the leave was not noticed"
        shipped_leave = hub.shipped_bytes - before_leave
        assert [m.name for m in hub.members] == ["local-1"]
        three = answer(session, smollm2_tokenizer)
    finally:
        session.close()
        first.stop()
        if second:
            second.stop()
    print(
        f"2 nodes: shipped {shipped_first} B; worker joined -> 3 nodes: shipped {shipped_join} B; "
        f"worker left -> 2 nodes: shipped {shipped_leave} B"
    )
    assert one == two == three
    assert shipped_join > 0
    # Back to the 2-node plan: the remaining worker still holds those shards; nothing ships.
    assert shipped_leave == 0
    assert second.procs[0].returncode == 0  # it left cleanly
