#!/bin/bash
# Final before/after: alternating runs of moeinf bench io (defaults), each under the shared lock.
S=/work/bench-data/qwen3-30b-a3b-geometry.store
cd /work/main && . .venv/bin/activate
for i in 1 2 3 4 5 6; do
  for v in before after after-noverify; do
    case $v in
      before) cmd="python /tmp/io/run_old.py bench io $S --json";;
      after) cmd="moeinf bench io $S --json";;
      after-noverify) cmd="moeinf bench io $S --json --no-verify";;
    esac
    flock /tmp/moeinf-bench.lock bash -c "echo \"$v \$(date -u +%H:%M:%S) \$(cat /proc/loadavg)\" >> /tmp/io/final/loadavg.txt; $cmd >> /tmp/io/final/$v.jsonl; echo \"$v-end \$(date -u +%H:%M:%S) \$(cat /proc/loadavg)\" >> /tmp/io/final/loadavg.txt"
  done
done
echo done >> /tmp/io/final/loadavg.txt
