#!/bin/bash
# Against llama.cpp on the same files and machine, alternating rounds: SmolLM2's Q4_1 file and
# Gemma 3 270M's Q4_K_M (Q4_K, Q6_K, Q5_0 and Q8_0 tensors), at 1 and 2 threads:
#   decode with an empty context and with ~2048 tokens in it (llama-bench tg64 and tg64 @ d2048;
#   edgetp bench after a short prompt and after a ~2048-token one), and
#   prefill of a 512-token prompt (llama-bench pp512; edgetp: that prompt's tokens over its time
#   to first token).
# LLAMA_BENCH is a llama-bench built from the llama-cpp-python source package (cmake
# -DGGML_NATIVE=ON); it is not a dependency.
# ACTIVATIONS (default "exact") lists edgetp's --activations modes to run beside each llama.cpp run.
# Usage, from the repository: LLAMA_BENCH=/path/to/llama-bench [ACTIVATIONS="exact int8"] bash
#   docs/bench/llamacpp_types_ab.sh
# NumPy's OpenBLAS takes its kernels from OPENBLAS_CORETYPE where it is set (a prefill's
# products go to BLAS): some hosts set it for every program; the script says what it ran with.
set -e
lscpu | grep 'Model name'
echo "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE-(unset)}"
text() {  # about $2 tokens of plain prose for model $1
  .venv/bin/python - "$1" "$2" <<'PY'
import sys
from edgetp.models.bundled import model_path
from edgetp.models.source import open_model
tok = open_model(model_path(sys.argv[1])).tokenizer()
prose = ("The history of the bicycle begins in the early nineteenth century, when inventors in "
         "Europe built wooden machines that riders pushed along with their feet. ") * 200
print(tok.decode(tok.encode(prose)[: int(sys.argv[2])]))
PY
}
for model in smollm2-135m-instruct gemma3-270m; do
  M=$(.venv/bin/python -c "from edgetp.models.bundled import model_path; print(model_path('$model'))")
  P512=$(text $model 512)
  P2048=$(text $model 2040)
  for r in 1 2; do
    for t in 1 2; do
      echo "## $model, round $r, $t thread(s)"
      "$LLAMA_BENCH" -m "$M" -t $t -p 512 -n 64 -r 2 2>/dev/null | grep -E 'pp512|tg64'
      "$LLAMA_BENCH" -m "$M" -t $t -p 0 -n 64 -d 2048 -r 2 2>/dev/null | grep -E 'tg64'
      for a in ${ACTIVATIONS:-exact}; do
        echo "  edgetp, activations $a"
        for p in short "$P512" "$P2048"; do
          args=(--local-nodes 1 --threads $t --model $model --tokens 64 --rounds 1 --context 2200
                --activations $a)
          [ "$p" = short ] || args+=(--prompt "$p")
          .venv/bin/edgetp bench "${args[@]}" 2>&1 | grep -E '^model |^    1 ' | sed 's/^model .*prompt/  prompt/'
        done
      done
    done
  done
done
