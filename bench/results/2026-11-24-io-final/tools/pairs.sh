#!/bin/bash
# Alternating before / after / after --no-verify runs of moeinf bench io (defaults), one lock for the set.
# usage: pairs.sh ROUNDS OUTDIR
S=/work/bench-data/qwen3-30b-a3b-geometry.store
T=$(dirname "$0")
cd /work/main && . .venv/bin/activate
for i in $(seq "$1"); do
  for v in before after after-noverify; do
    case $v in
      before) cmd="python $T/run_old.py bench io $S --json";;
      after) cmd="moeinf bench io $S --json";;
      after-noverify) cmd="moeinf bench io $S --json --no-verify";;
    esac
    echo "$v $(date -u +%H:%M:%S) $(cat /proc/loadavg)" >> "$2/loadavg.txt"
    $cmd >> "$2/$v.jsonl"
    echo "$v-end $(date -u +%H:%M:%S) $(cat /proc/loadavg)" >> "$2/loadavg.txt"
  done
done
