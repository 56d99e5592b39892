"""Imported by the fork server alone, first of `node.children.PRELOAD`: the server ends without
the interpreter's teardown, as edgetp's other processes do (`node.children.exit_now`).

The server holds a copy of its caller's standard output and error, so whoever reads those to
their end (`subprocess.run(..., capture_output=True)`, a shell's `$(edgetp run ...)`) waits for
the server too; with the teardown it ended 0.9 s after its caller (a Zen 3 core, strace of
`edgetp run --local-nodes 2`).
"""

from __future__ import annotations

import atexit
import signal

from edgetp.node.children import OOM_WORKER, end_process, set_oom_score_adj

# The server starts workers; where they do not fit beside the master, the out-of-memory killer
# takes it before the master, which then says what happened. Set before its imports of torch.
set_oom_score_adj(OOM_WORKER)

# Registered before the imports that follow it in the server, so their atexit functions run
# first (atexit runs the last registered first); the server writes no files and starts its
# children with os.fork, so multiprocessing's own (registered earlier) has nothing to do there.
atexit.register(end_process, 0)

# multiprocessing has the server ignore Ctrl-C once its imports are done; a Ctrl-C at the
# terminal reaches every process of the group, and one in the seconds it imports torch
# printed the server's traceback under edgetp's own line. Its caller is told, and ends it.
# `node.children.start_server` starts the server with Ctrl-C ignored already; this is for one
# that multiprocessing starts again by itself (the first was killed: the OOM killer, a user).
signal.signal(signal.SIGINT, signal.SIG_IGN)
