"""How a node's child processes end (node/children.py): with the code they exit with, their
output written, and, in a process of its own, what it left for atexit done."""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import pytest

from node import children

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
