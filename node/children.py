"""Processes a node starts to run its own code, forked from a server that imported it once.

A kernel check runs in a child process (a kernel that crashes must not take the node with it),
and a local cluster's workers are processes of their own. Each started as a new interpreter
spends seconds of CPU importing torch before doing anything: 2.5-3.3 s on a Zen 3 core
(`/usr/bin/time python -c "import torch"`), paid again by every check and every worker. A
process that starts many (the master of a local cluster) runs multiprocessing's fork server
instead (`start_server`): an interpreter that imports the node's code once (`PRELOAD`) and
forks each child from that state, whose pages the children share until they write them. The
server is single-threaded; forking the caller itself, with ZeroMQ's and BLAS's threads
running, would not be safe. The server holds ~150 MB of its own (the imports' heap), so a
process that starts a child now and then (a device's `edgetp join`, one kernel check per plan)
runs none and starts a new interpreter for each child, as it always did.

A child runs as its caller: with the caller's environment as it is at the start (not the one
the server started with), and in the caller's cgroups. The server only ever runs in the
cgroups this process started in: a caller that has moved to others since (the master of
emulated devices enters its device's, and leaves it on exit, ending what is left in it)
starts a new interpreter for the child too (and not multiprocessing's "spawn", whose resource
tracker would start in those cgroups and be ended with them).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import forkserver
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NoReturn

# torch, NumPy, ZeroMQ and the node's modules, the kernel check's too; node.fork_server first
PRELOAD = ["edgetp.node.fork_server", "edgetp.node.worker"]
CHILD_MAIN = "from edgetp.node.children import _main; _main()"  # a child interpreter's code
_PR_SET_NAME = 15  # prctl(2): the name `ps` and `top` show (15 bytes)
# Who the out-of-memory killer takes first (oom_score_adj): a kernel check before the node it
# checks for, a local worker and the fork server before the master, which speaks for them all.
OOM_CHECK = 1000
OOM_WORKER = 500


def _cgroups() -> str:
    try:
        return Path("/proc/self/cgroup").read_text()
    except OSError:
        return ""


_HOME_CGROUPS = _cgroups()  # read at import, before anything in this process moves it
_serving = False  # this process runs a fork server


def alive(pid: int) -> bool:
    """Whether a process `pid` exists (a zombie included): what a process that was killed
    outright left behind is found by its name's pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_server() -> None:
    """From now on, fork this process's children from a server (started here, unless it runs
    already, or this process is not in the cgroups it started in)."""
    global _serving
    if not _serving and _cgroups() == _HOME_CGROUPS:
        forkserver.set_forkserver_preload(PRELOAD)
        previous = signal.getsignal(signal.SIGINT)  # None: set outside Python, not ours to move
        if previous is None or threading.current_thread() is not threading.main_thread():
            forkserver.ensure_running()  # no Ctrl-C comes to a thread (the chat app reads it)
        else:
            # The server starts with Ctrl-C ignored (an ignored signal stays so across exec):
            # one in the moment before its first import (node.fork_server) printed its
            # traceback under edgetp's own line. This process ignores it for that moment too.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                forkserver.ensure_running()
            finally:
                signal.signal(signal.SIGINT, previous)
        _serving = True


def _end_server() -> None:
    """Kill this process's fork server at once, before it forks a child asked for."""
    global _serving
    # multiprocessing keeps it there; typeshed leaves out the private attribute
    pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)  # this process's child: no zombie left for init to reap
        except (ProcessLookupError, ChildProcessError):
            pass
    _serving = False


def start(
    target: Callable[..., Any],
    args: tuple[Any, ...],
    name: str,
    env: dict[str, str] | None = None,
    oom_score_adj: int = 0,
) -> Child | subprocess.Popen[bytes]:
    """`target(*args)` in a child process named `name` (`ps` shows it), with `env` (this
    process's environment unless given); its exit code is target's SystemExit code, 0 on
    return, 1 on an exception, -N when killed by signal N. `oom_score_adj` (OOM_WORKER,
    OOM_CHECK) has the out-of-memory killer take the child before its caller; 0 leaves it as
    the process it comes from (the fork server's is OOM_WORKER)."""
    global _serving
    call = (target, args, dict(env or os.environ), name, oom_score_adj)
    if _serving and _cgroups() == _HOME_CGROUPS:
        process = multiprocessing.get_context("forkserver").Process(target=_enter, args=call)
        try:
            process.start()
            return Child(process)
        except (EOFError, ConnectionError):  # the server is gone: the OOM killer, a user
            _serving = False  # a new interpreter for this child and the next
        except (KeyboardInterrupt, SystemExit):
            # A Ctrl-C (or a SIGTERM's exit) while the server was still importing, its first
            # seconds: the request is in, and the server would fork the child once done, with
            # no caller left to end it (a local worker ran on 10-40 s, until its link gave up).
            _end_server()
            raise
    started = subprocess.Popen(
        [sys.executable, "-c", CHILD_MAIN, str(oom_score_adj)],
        stdin=subprocess.PIPE,
        env=call[2],
    )
    assert started.stdin is not None
    with started.stdin:
        started.stdin.write(pickle.dumps(call))
    return started


def exit_now(code: int) -> NoReturn:
    """End this process with `code` as `sys.exit` would, but without the interpreter's teardown.

    What must run on exit still runs (the atexit functions: temporary files, logging's
    handlers, multiprocessing's children) and buffered output is written. The teardown that is
    skipped frees every object one by one, the tens of thousands torch made at import among
    them: 1.0-1.1 s of CPU at every exit of a process that loaded a model, on a Zen 3 core (a
    process forked by the server is ended so by multiprocessing, after its own finalizers and
    without the atexit functions it inherited: such a child leaves by `sys.exit`).
    """
    if multiprocessing.parent_process() is not None:
        sys.exit(code)
    atexit._run_exitfuncs()
    end_process(code)


def end_process(code: int) -> NoReturn:
    """Write what is buffered and end at once: `exit_now` without the atexit functions."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, a stream closed: nothing more to say
            pass
    os._exit(code)


def _main() -> NoReturn:
    """A child started as a new interpreter: the call `start` pickled to its standard input."""
    set_oom_score_adj(int(sys.argv[1]))  # before the call's imports: most of what it holds
    target, args, env, name, oom_score_adj = pickle.loads(sys.stdin.buffer.read())
    _enter(target, args, env, name, oom_score_adj)
    exit_now(0)


def set_oom_score_adj(score_adj: int) -> None:
    """Have the out-of-memory killer take this process before those with a lower score:
    where processes do not fit together, it takes the largest, which was the one that speaks
    for them (a node of 196 MB beside its kernel check at `--device mem=220MB`, a master
    beside its fork server and worker in a 400 MB container), and it died with no word said."""
    if score_adj:
        try:
            Path("/proc/self/oom_score_adj").write_text(str(score_adj))  # raising: no privilege
        except OSError:
            pass  # not Linux: no OOM killer to steer


def _enter(
    target: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    name: str,
    oom_score_adj: int,
) -> None:
    set_oom_score_adj(oom_score_adj)
    os.environ.clear()
    os.environ.update(env)
    # Ctrl-C ends a child as it ends its caller, whatever the server that forked it ignores.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the name is only for people reading `ps`
    # What it inherited stays out of its collections (and their writes out of the pages it
    # shares with the server): `memory.window.keep_imports_out_of_collections`, whose module
    # this one does not import (the fork server imports it before torch).
    gc.freeze()
    target(*args)


def redirect_output(stdout: str | None, stderr: str) -> None:
    """This process's file descriptors 1 and 2 to these files (appended; 1 to /dev/null when
    `stdout` is None): what C code prints lands there too, not in the caller's terminal."""
    for fd, path in ((1, stdout or os.devnull), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)


class Child:
    """A started child, with the part of subprocess.Popen's interface its callers use.

    The fork server reports a child's exit; if the server itself is killed (the kernel's OOM
    killer, a user), its children run on, adopted by init, and the report reads as an exit
    with code 255. So a child whose pid is still running is running, whatever was reported.
    """

    def __init__(self, process: BaseProcess) -> None:
        assert process.pid is not None, "made of a started process"
        self.process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        code = self.process.exitcode
        return None if code is not None and self._still_running() else code

    def _still_running(self) -> bool:
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False  # gone: the server reaped it, or init did after the server died
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.process.join(timeout)
        while (code := self.poll()) is None:  # not exited, or outlived its server
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.05)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
