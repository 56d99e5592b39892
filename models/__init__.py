"""Model formats, configs, tokenizers and the math of a layer's blocks.

Imported first by every package of edgetp (each package's __init__ imports it), so that the
setting below is in the environment before torch, or this package's C kernels, load an OpenMP
runtime: each reads it once, when it loads.
"""

import os

# OpenMP's threads sleep as soon as a parallel region ends instead of spinning for the next one.
# A process holds two OpenMP runtimes (torch's and the C kernels') and OpenBLAS's own threads:
# spinning workers of one took the cores from the others' next region. SmolLM2 on one process
# with 2 threads (Zen 5), once the context passed the ~29 positions at which attention splits
# its heads between threads: 304 ms a token where it takes 11.4 with them asleep, 480 against
# 45 for 8 sequences batched; short contexts unchanged (11.9 and 11.4). A user's own setting
# wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
