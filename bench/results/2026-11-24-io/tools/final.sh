#!/bin/bash
# The committed engine (checksums in the reading thread, with CPU counters): defaults vs --no-verify, alternating.
S=/work/bench-data/qwen3-30b-a3b-geometry.store
cd /work/main && . .venv/bin/activate
for i in 1 2 3 4; do
  for v in final final-noverify; do
    case $v in
      final) cmd="moeinf bench io $S --json";;
      final-noverify) cmd="moeinf bench io $S --json --no-verify";;
    esac
    flock /tmp/moeinf-bench.lock bash -c "echo \"$v \$(date -u +%H:%M:%S) \$(cat /proc/loadavg)\" >> /tmp/io/final2/loadavg.txt; $cmd >> /tmp/io/final2/$v.jsonl; echo \"$v-end \$(date -u +%H:%M:%S) \$(cat /proc/loadavg)\" >> /tmp/io/final2/loadavg.txt"
  done
done
echo done >> /tmp/io/final2/loadavg.txt
