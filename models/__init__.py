"""Model formats, configs, tokenizers and the math of a layer's blocks.

Imported first by every package of edgetp (each package's __init__ imports it), so that the
settings below are in the environment before torch, or this package's C kernels, load an OpenMP
runtime: each reads it once, when it loads.
"""

import os

# OpenMP's threads (GNU's runtime, torch's and the C kernels') spin ~1,000 rounds for the next
# parallel region, then sleep. A process holds two such runtimes and OpenBLAS's threads; at
# GNU's default (300,000 rounds) their spinning took the cores from a process that also runs
# Python threads (the bridge's batcher and its server): SmolLM2 on one process, 2 threads,
# Zen 5, decoding through the batcher once the context passed the ~29 positions at which
# attention splits its heads between threads, took 304-312 ms a token and 480-600 a step of 8
# sequences; at 1,000 rounds 14 and 43. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) did as well
# there but cost the single-threaded loop (`edgetp bench`, 1 node): 12.8 ms a token against 5.1
# at the default and 4.9 at 1,000. A user's own setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
# GNU's runtime spins only 100 rounds ("throttled") once it manages more threads than the machine
# has cores, as it does when two threads have started parallel regions (each keeps a team): the
# bridge's batcher thread beside the main thread, which checked and timed the kernels at start.
# Every parallel region then woke its team from sleep: SmolLM2, one node, 2 threads, a decode
# step in a thread took 24.4 ms against 11.2 on the main thread, and a streamed answer through
# `edgetp serve` 29.2 ms a token. "active" raises the throttled count to 1,000, the count above,
# and leaves it at that (GOMP_SPINCOUNT set): 11.9 ms in a thread, 12.9 ms a streamed token.
os.environ.setdefault("OMP_WAIT_POLICY", "active")
# OpenBLAS's threads yield for 2**28 cycles (~0.1 s) after a product before they sleep, and in
# a prompt's step that is the whole step: torch's second thread for the attention over a long
# reused prefix found the other core taken (SmolLM2, 1 process, 138 new tokens over 1,356 kept:
# 0.38 s with the default, 0.30 at 2**10; decode unchanged, 5.0-5.1 ms a token either way).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "10")
