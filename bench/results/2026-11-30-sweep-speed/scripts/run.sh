#!/usr/bin/env bash
# The 12 sweeps of issue 40's target (2 traces, their top-1 proxies, seeds 0-2) and the third model's stand-in,
# one at a time, each under /usr/bin/time -v. Usage: SHARED=... WORK=... bash run.sh OUTDIR
set -euo pipefail
out=${1:?OUTDIR}
mkdir -p "$out"
T=$SHARED/data/traces
for name in gptoss20b dsv2lite; do
  file=$T/gptoss20b-fingerprint-400.jsonl.gz
  [ $name = dsv2lite ] && file=$T/dsv2lite-puffin-700.jsonl.gz
  for top1 in "" "--top1"; do
    for seed in 0 1 2; do
      tag=$name${top1:+-top1}-seed$seed
      /usr/bin/time -v -o "$out/$tag.time.txt" moeinf bench cache --traces "$file" $top1 --seed $seed \
        --out "$out/$tag.jsonl" > "$out/$tag.txt" 2>&1
    done
  done
done
/usr/bin/time -v -o "$out/third-seed0.time.txt" moeinf bench cache --traces "$WORK/third.jsonl" --seed 0 \
  --out "$out/third-seed0.jsonl" > "$out/third-seed0.txt" 2>&1
echo done > "$out/DONE"
