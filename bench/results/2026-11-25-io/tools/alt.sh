#!/bin/bash
# usage: alt.sh ROUNDS OUTDIR "name|cmd" ...   (run under flock by the caller)
R=$1; O=$2; shift 2
cd /work/main && . .venv/bin/activate
for i in $(seq "$R"); do
  for spec in "$@"; do
    n=${spec%%|*}; c=${spec#*|}
    echo "$n $(date -u +%H:%M:%S) $(cat /proc/loadavg)" >> "$O/loadavg.txt"
    $c >> "$O/$n.jsonl"
    echo "$n-end $(date -u +%H:%M:%S) $(cat /proc/loadavg)" >> "$O/loadavg.txt"
  done
done
