"""Finding a master with real mDNS traffic (kept on the loopback interface)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from edgetp.master.cluster.hub import Hub
from edgetp.node.discovery import Announcer, MasterAd, browse
from edgetp.node.protocol import PROTOCOL_VERSION
from edgetp.node.security import TOKEN_ENV, fingerprint

LOOPBACK = "127.0.0.1"


def _join(*args: str, token: str | None, state) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    if token:
        env[TOKEN_ENV] = token
    cmd = [sys.executable, "-m", "edgetp.tui.cli", "join", "--interface", LOOPBACK, "--state-dir"]
    return subprocess.Popen(
        [*cmd, str(state), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _announce(hub: Hub, cluster: str) -> Announcer:
    ad = MasterAd(
        cluster, "model.gguf", PROTOCOL_VERSION, fingerprint(hub.keys.public), LOOPBACK, hub.port
    )
    return Announcer(ad, [LOOPBACK], LOOPBACK)


def test_browse_sees_the_announcement():
    hub = Hub(LOOPBACK, 0)
    cluster = f"test-{uuid.uuid4().hex[:6]}"
    announcer = _announce(hub, cluster)
    try:
        ads = [a for a in browse(2.0, LOOPBACK) if a.cluster == cluster]
    finally:
        announcer.close()
        hub.close()
    assert len(ads) == 1
    ad = ads[0]
    assert (ad.host, ad.port, ad.model, ad.version) == (
        LOOPBACK,
        hub.port,
        "model.gguf",
        PROTOCOL_VERSION,
    )
    assert ad.fingerprint == fingerprint(hub.keys.public)


def test_join_without_an_address_finds_and_joins_the_master(tmp_path):
    hub = Hub(LOOPBACK, 0)
    cluster = f"test-{uuid.uuid4().hex[:6]}"
    announcer = _announce(hub, cluster)
    proc = _join("--cluster", cluster, token=str(hub.token), state=tmp_path)
    try:
        hub.wait_for_workers(1, timeout=60)
        assert len(hub.nodes) == 1
    finally:
        announcer.close()
        hub.close()
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert f"joining {cluster} at {LOOPBACK}:{hub.port}" in err


def test_join_says_so_when_no_master_answers(tmp_path):
    proc = _join("--cluster", "no-such-cluster", token=None, state=tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert "no master named 'no-such-cluster' answered" in last
    assert "edgetp join HOST:PORT --token TOKEN" in last


def test_join_says_at_once_when_the_master_s_host_or_port_cannot_be(tmp_path):
    """A name that does not resolve (ZeroMQ would retry it until the join timed out, 30 s on,
    saying only that no master answered) and a port that cannot be: said before anything
    loads."""
    for address, said in [
        ("no-such-host.invalid", "cannot find the master's host 'no-such-host.invalid'"),
        ("localhost:http", "the master's port must be in 1..65535, got 'http'"),
        ("localhost:70000", "the master's port must be in 1..65535, got '70000'"),
    ]:
        proc = _join(address, token=None, state=tmp_path)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 1, err
        assert said in err.strip().splitlines()[-1], err
