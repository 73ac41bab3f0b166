# The 13 (trace, seed, size) cells that 2026-11-29-fitted3 misses, two queues side by side (2 cores).
# $SHARED: the shared data folder. Writes bound.jsonl (one line per cell).
set -e
F=../2026-11-29-fitted3
D=$SHARED/data/traces/dsv2lite-puffin-700.jsonl.gz
G=$SHARED/data/traces/gptoss20b-fingerprint-400.jsonl.gz
one() { python bound.py "$@" >> "q$Q.jsonl"; }
(Q=1; for s in 0 1 2; do for f in 0.45 0.6; do one $D --top1 --seed $s --fraction $f --fit-jsonl $F/dsv2lite-top1-seed0.jsonl; done; done
 one $G --seed 0 --fraction 0.6 --fit-jsonl $F/gptoss20b-seed0.jsonl) &
(Q=2; one $G --top1 --seed 0 --fraction 0.6 --fit-jsonl $F/gptoss20b-top1-seed0.jsonl
 for s in 1 2; do for f in 0.45 0.6; do one $G --top1 --seed $s --fraction $f --fit-jsonl $F/gptoss20b-top1-seed0.jsonl; done; done
 one $G --seed 2 --fraction 0.6 --fit-jsonl $F/gptoss20b-seed0.jsonl) &
wait
cat q1.jsonl q2.jsonl > bound.jsonl && rm q1.jsonl q2.jsonl
