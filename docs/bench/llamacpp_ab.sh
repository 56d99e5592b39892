#!/bin/bash
# Decode against llama.cpp on the same file and machine, alternating rounds: llama.cpp's
# llama-bench, then edgetp at q4_1 and at f32, 2 threads each. LLAMA_BENCH is a llama-bench
# built from the llama-cpp-python source package (cmake -DGGML_NATIVE=ON); it is not a dependency.
# Usage, from the repository: LLAMA_BENCH=/path/to/llama-bench bash docs/bench/llamacpp_ab.sh
set -e
M=$(.venv/bin/python -c 'from edgetp.models.bundled import model_path; print(model_path())')
lscpu | grep 'Model name'
for r in 1 2 3; do
  echo "## round $r"
  "$LLAMA_BENCH" -m "$M" -t 2 -p 0 -n 128 -r 3 2>/dev/null | grep tg128
  for d in q4_1 f32; do
    .venv/bin/edgetp bench --local-nodes 1 --threads 2 --dtype $d --tokens 64 --rounds 1 2>&1 |
      grep -E '^memory:|^    1 '
  done
done
