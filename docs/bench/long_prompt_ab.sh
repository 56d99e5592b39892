#!/bin/bash
# Agent-sized prompts against llama.cpp on the same file and machine, alternating rounds: prefill
# of N tokens (llama-bench ppN; edgetp bench --prompt-tokens N: the prompt over its time to first
# token) and decode after them (llama-bench tg32 @ dN; edgetp's 32 tokens after the prompt).
# SmolLM2 holds 8192 tokens: edgetp's longest prompt is 8160 with 32 decoded after it, and
# llama-bench is given the same depths (its pp8192 too, the figure the bars name).
# LLAMA_BENCH is a llama-bench built from the llama-cpp-python source package (cmake
# -DGGML_NATIVE=ON); it is not a dependency.
# Usage, from the repository: LLAMA_BENCH=/path/to/llama-bench [ROUNDS=2] [MODEL=name]
#   [THREADS=2] bash docs/bench/long_prompt_ab.sh [N ...]   (default N: 4096 8160)
set -e
MODEL=${MODEL:-smollm2-135m-instruct}
M=$(.venv/bin/python -c "from edgetp.models.bundled import model_path; print(model_path('$MODEL'))")
T=${THREADS:-2}
[ $# -gt 0 ] || set -- 4096 8160
lscpu | grep 'Model name'
for r in $(seq 1 "${ROUNDS:-2}"); do
  for n in "$@"; do
    echo "## round $r, $n tokens, $T threads"
    "$LLAMA_BENCH" -m "$M" -t "$T" -p "$n" -n 0 -r 1 2>/dev/null | grep -E "pp$n"
    [ "$n" = 8160 ] && "$LLAMA_BENCH" -m "$M" -t "$T" -p 8192 -n 0 -r 1 2>/dev/null | grep pp8192
    "$LLAMA_BENCH" -m "$M" -t "$T" -p 0 -n 32 -d "$n" -r 1 2>/dev/null | grep -E 'tg32'
    .venv/bin/edgetp bench --model "$MODEL" --prompt-tokens "$n" --tokens 32 --rounds 1 \
      --threads "$T" 2>&1 | sed -n '/^a prompt of/,/KV at depth/p'
  done
done
