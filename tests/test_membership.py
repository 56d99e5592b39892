"""Workers joining and leaving between requests: re-plan, ship only what changed, same answer."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from cluster_threads import master_threads

from edgetp.master.cluster.hub import Hub
from edgetp.master.cluster.local import LocalWorkers, machine_speed
from edgetp.master.cluster.session import Session
from edgetp.master.generation.generate import start, stream
from edgetp.master.generation.params import SamplingParams
from edgetp.memory.budget import FILE_TYPES, MemoryOptions
from edgetp.node.security import TOKEN_ENV

pytestmark = pytest.mark.slow

PROMPT = "List three uses of a paperclip:"


def answer(session: Session, tokenizer) -> list[int]:
    (g,) = start(session.engine, [tokenizer.encode(PROMPT)], [SamplingParams(max_tokens=24)])
    for _ in stream(session.engine, tokenizer, [g]):
        pass
    return g.tokens


@master_threads(3)
def test_join_and_leave_between_requests(smollm2, smollm2_tokenizer, tmp_path, caplog):
    hub = Hub("127.0.0.1", 0, model_names=(smollm2.name,))
    session = Session(
        smollm2, hub, tmp_path / "master", 128, 1, equal_shares=True, memory=FILE_TYPES
    )
    # Each worker has a state folder of its own, so what ships to it is counted.
    first = LocalWorkers(1, hub.port, 1, tmp_path / "w1", False, hub.token, first=1)
    second = None
    try:
        session.start(workers=1, timeout=120)
        shipped_first = hub.shipped_bytes
        one = answer(session, smollm2_tokenizer)
        assert not session.replan_if_changed()
        # A serving worker measures its speed when asked (before a re-plan), and goes on.
        joined_speed = hub.members[0].capacity.speed
        assert joined_speed == machine_speed(1)  # a local worker's figure: the master's probe
        with caplog.at_level(logging.WARNING):
            hub.measure_speeds(lambda: 1.0)
            hub.measure_links()  # and sends the master's ECHOs back
        assert not [r for r in caplog.records if "did not measure" in r.getMessage()]
        assert hub.members[0].link is not None, caplog.text
        print(f"local-1 measured {joined_speed} GB/s joining, {hub.members[0].capacity.speed} now")

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


@master_threads(3)
def test_a_device_too_small_for_its_share_is_refused_and_the_cluster_goes_on(
    smollm2, smollm2_tokenizer, tmp_path
):
    """A device whose memory budget cannot hold its share joins a running cluster: the
    re-plan leaves it out and tells it what budget would do, and the cluster answers as
    before, instead of going down with the plan that could not be held."""
    hub = Hub("127.0.0.1", 0, model_names=(smollm2.name,))
    session = Session(
        smollm2, hub, tmp_path / "master", 128, 1, equal_shares=True, memory=FILE_TYPES
    )
    first = LocalWorkers(1, hub.port, 1, tmp_path / "w1", False, hub.token, first=1)
    small = None
    try:
        session.start(workers=1, timeout=120)
        one = answer(session, smollm2_tokenizer)
        tiny = MemoryOptions(budget=4 * 10**6)
        small = LocalWorkers(1, hub.port, 1, tmp_path / "w2", False, hub.token, 2, tiny)
        assert session.replan_if_changed(wait=60)  # it joined: planned without it
        assert [m.name for m in hub.members] == ["local-1"]
        assert answer(session, smollm2_tokenizer) == one
        assert small.procs[0].wait(timeout=30) == 1
        said = small.logs[0].read_text().strip().splitlines()[-1]
        print(f"\nthe small device: {said}")
        assert said.startswith("edgetp: error: the master said: dropped from the plan (node ")
        assert "local-2: a memory budget of 4.0 MB cannot hold" in said
        assert "give --memory-budget" in said
        assert not session.replan_if_changed(wait=1)  # it does not come back
    finally:
        session.close()
        first.stop()
        if small:
            small.stop()


def test_a_worker_started_with_sigint_ignored_still_leaves_on_sigint(tmp_path):
    """A node is told to leave with SIGINT (Ctrl-C). A process inherits an ignored SIGINT from
    its parent (here a script's `trap '' INT`; also a shell's background job, or a parent inside
    glibc's system(), as the suite's own processes were once); it must leave all the same,
    not serve on unnoticed."""
    ignoring = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh"]
    status = subprocess.run([*ignoring, "cat", "/proc/self/status"], capture_output=True, text=True)
    ignored = next(line for line in status.stdout.splitlines() if line.startswith("SigIgn"))
    assert int(ignored.split()[1], 16) & 1 << (signal.SIGINT - 1), ignored  # the trap holds
    hub = Hub("127.0.0.1", 0)
    join = [sys.executable, "-m", "edgetp.tui.cli", "join", f"127.0.0.1:{hub.port}",
            "--name", "ignoring", "--state-dir", str(tmp_path)]  # fmt: skip
    env = os.environ | {TOKEN_ENV: str(hub.token)}
    worker = subprocess.Popen([*ignoring, *join], env=env, stderr=subprocess.PIPE, text=True)
    try:
        hub.wait_for_workers(1, timeout=60)
        hub.take_in()  # in the plan being made: its leaving calls for another
        worker.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 15
        while not hub.watch_membership(wait=0.5):
            assert time.monotonic() < deadline, "the worker did not leave"
        assert hub.members[0].failure == "it left", hub.members[0]
        assert worker.wait(timeout=15) == 0, worker.stderr.read() if worker.stderr else ""
    finally:
        worker.kill()
        worker.wait()
        hub.close()
