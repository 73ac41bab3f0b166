#!/usr/bin/env bash
# the final same-window scale batch: synth, pack, then replayed 8/16 GiB (default, LRU, previous default) and own 8 GiB
set -u
cd $REPO; . .venv/bin/activate
S=$WORK/s6; T=$TRACES/dsv2lite-puffin-700.jsonl.gz
date
( time moeinf zoo synth deepseek-v2-lite $WORK/dsv2l ) > $S/final-synth.log 2>&1
date
( time $S/cg.sh pack7 2147483648 moeinf pack $WORK/dsv2l --offload-dir $WORK/dsv2l.moeinf --no-progress ) > $S/final-pack.log 2>&1
date
fio --name=r --filename=$WORK/dsv2l.moeinf/experts.bin --rw=randread --bs=2M --direct=1 --runtime=8 --time_based --ioengine=psync --readonly 2>&1 | grep READ: > $S/final-fio.txt
for cap in 8GiB 16GiB; do
  moeinf bench scale $WORK/dsv2l --memory-cap $cap --store $WORK/dsv2l.moeinf --routing-trace $T \
    --rows-routing replayed --rows default,on-demand-lru --prompts 2 --new-tokens 16 --json --out $S/final-r$cap > $S/final-r$cap.json 2> $S/final-r$cap.err
  moeinf bench scale $WORK/dsv2l --memory-cap $cap --store $WORK/dsv2l.moeinf --routing-trace $T \
    --rows-routing replayed --rows default --set prefetch_min_probability=0.3 --set prefetch_cut=nearest \
    --prompts 2 --new-tokens 16 --json --out $S/final-prev$cap > $S/final-prev$cap.json 2> $S/final-prev$cap.err
  date
done
moeinf bench scale $WORK/dsv2l --memory-cap 8GiB --store $WORK/dsv2l.moeinf --rows default --rows-routing own \
  --prompts 2 --new-tokens 16 --hf-reference $REPO/bench/results/2026-11-29-scale4/acc8.jsonl --json --out $S/final-own8 > $S/final-own8.json 2> $S/final-own8.err
fio --name=r --filename=$WORK/dsv2l.moeinf/experts.bin --rw=randread --bs=2M --direct=1 --runtime=8 --time_based --ioengine=psync --readonly 2>&1 | grep READ: >> $S/final-fio.txt
date
echo done
