"""How a node's child processes end (node/children.py): with the code they exit with, their
output written, and, in a process of its own, what it left for atexit done."""

from __future__ import annotations

import atexit
import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_until

from edgetp.node import children

CODE = 3


def leave(out: str) -> None:
    """A child's work: output that waits in a buffer, a file to remove on exit, then out."""
    children.redirect_output(out, out + ".err")
    left = Path(out + ".left")
    left.touch()
    atexit.register(left.unlink)
    print("the answer", end="")  # a file's stdout is block-buffered: still in the buffer
    children.exit_now(CODE)


@pytest.mark.parametrize("forked", [True, False], ids=["forked-by-the-server", "new-interpreter"])
def test_a_child_ends_with_its_code_and_its_output(tmp_path, monkeypatch, forked):
    if not forked:  # the way a process that runs no fork server starts its children
        monkeypatch.setattr(children, "_serving", False)
    out = str(tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    child = children.start(leave, (out,), "edgetp-test", env)
    assert child.wait(60) == CODE, Path(out + ".err").read_text()
    assert Path(out).read_text() == "the answer"
    # A process of its own runs its atexit functions; one forked by the server runs none
    # (multiprocessing ends its children so): the server's own are not the child's to run.
    assert Path(out + ".left").exists() == forked


INTERRUPTED = """
import os, signal, sys, threading, time
from pathlib import Path

from edgetp.node import children


def child(marker: str) -> None:
    Path(marker).write_text(str(os.getpid()))
    time.sleep(60)  # a child that lives on, as a worker does: it is ended by whoever forked it


if __name__ == "__main__":
    # Ctrl-C as a terminal's command has it, whatever the test process that started this one
    # left it at (an ignored signal stays ignored across exec: Python then sets no handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    children.PRELOAD = [*children.PRELOAD, "slow_import"]  # the server's imports, longer
    children.start_server()
    print(children.forkserver._forkserver._forkserver_pid, flush=True)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        children.start(child, (sys.argv[1],), "edgetp-test")
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        raise SystemExit(130)
"""


def test_a_child_asked_for_in_the_server_s_first_seconds_is_not_forked_after_a_ctrl_c(tmp_path):
    """A Ctrl-C while the fork server still imports ends its caller; the server, which ignores
    it, would fork the child it was asked for once done, and nobody would end that child."""
    # The server's imports made slow on purpose: the Ctrl-C must land while they run.
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(3)\n")
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    marker = tmp_path / "forked"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script), str(marker)], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    try:
        server, said = done.stdout.split()
        assert (done.returncode, said) == (130, "interrupted"), done.stderr
        # The server ends once its imports are done (3 s more at least), without forking.
        wait_until(lambda: not Path(f"/proc/{server}").exists(), 60, "end of the fork server")
        assert not marker.exists()
    finally:
        if marker.exists():
            os.kill(int(marker.read_text()), signal.SIGKILL)


SERVER_SIGNALS = """
from pathlib import Path

from edgetp.node import children

children.start_server()
pid = children.forkserver._forkserver._forkserver_pid
print(Path(f"/proc/{pid}/status").read_text())
"""


def test_the_fork_server_ignores_ctrl_c_from_its_first_moment(tmp_path):
    """Its caller is told of a Ctrl-C, and ends it; the server itself must not print a traceback
    for one, also before its first import has set it to ignore them."""
    script = tmp_path / "server.py"
    script.write_text(SERVER_SIGNALS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    status = dict(line.split(":\t", 1) for line in done.stdout.splitlines() if ":\t" in line)
    assert int(status["SigIgn"], 16) & (1 << (signal.SIGINT - 1)), done.stdout + done.stderr


def frozen_exit() -> None:
    """A child's work: exit 0 when what it inherited is out of its collections' walks."""
    children.exit_now(0 if gc.get_freeze_count() > len(gc.get_objects()) else 1)


def test_a_forked_child_leaves_what_it_inherited_out_of_its_collections():
    """A child's collections hold its GIL, and with it its heartbeats, while they walk what
    the collector tracks (memory.window.return_freed_memory): the server's imports, torch's
    among them, are left out of them, and so are the pages the child shares with the server."""
    child = children.start(frozen_exit, (), "edgetp-test")
    assert child.wait(60) == 0
