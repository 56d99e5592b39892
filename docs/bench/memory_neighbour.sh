#!/bin/bash
# One device at cpu=0.5 alone, and with a neighbour streaming memory on the other core: how much
# dearer a decoded token's CPU gets when another core streams beside it (N emulated devices do,
# on one host's memory). QUOTA: the neighbour's CPU quota in us of a 10 ms period (-1: a whole
# core). Alternating, PAIRS pairs. Run as root from the repository.
# usage: QUOTA=5000 PAIRS=3 bash docs/bench/memory_neighbour.sh
set -e
CG=/sys/fs/cgroup/cpu/etp-neighbour
mkdir -p $CG
echo 10000 > $CG/cpu.cfs_period_us
echo "${QUOTA:-5000}" > $CG/cpu.cfs_quota_us
SP=
STATE=$(mktemp -d)
trap 'kill $SP 2>/dev/null || true; wait 2>/dev/null || true; rmdir $CG; rm -rf "$STATE"' EXIT
for pair in $(seq "${PAIRS:-3}"); do
  for mode in ${MODES:-alone neighbour}; do
    SP=
    if [ $mode = neighbour ]; then
      .venv/bin/python -c "
import os; os.environ['OPENBLAS_NUM_THREADS'] = '1'
import numpy as np
os.sched_setaffinity(0, {1})
m = np.full((64 * 1024, 1024), 0.5, np.float32)  # 256 MB, streamed from memory
v = np.ones(1024, np.float32)
while True:
    m @ v" &
      SP=$!
      echo $SP > $CG/tasks
      sleep 2
    fi
    nodes=1
    [ $mode = split ] && nodes=2
    .venv/bin/edgetp bench --local-nodes $nodes --device cpu=0.5 --dtype f32 --tokens 32 --rounds 1 \
      --state-dir "$STATE" --json "$STATE/run.json" > /dev/null 2>&1
    [ -n "$SP" ] && kill $SP && wait $SP 2>/dev/null || true
    python3 -c "
import json; r = json.load(open('$STATE/run.json'))['runs'][0]
print('pair $pair, $mode:', r['ms_per_token'], 'ms a token,', ' + '.join(map(str, r['rounds_cpu_ms_per_token'][0])), 'ms of CPU')"
  done
done
