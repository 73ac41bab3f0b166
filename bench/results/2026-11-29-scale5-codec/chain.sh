#!/usr/bin/env bash
# The codec measurement at DeepSeek-V2-Lite size: exact rows, then coded rows, one at a time.
set -u
cd $REPO && . .venv/bin/activate
W=$WORK; O=$W/codec; T=$TRACES/dsv2lite-puffin-700.jsonl.gz
REF=$REPO/bench/results/2026-11-29-scale4/acc8.jsonl
log() { echo "$(date -u +%T) $*" | tee -a $O/chain.log; }
drive() { log "drive $1: $(fio --name=r --filename=$1 --rw=randread --bs=2M --direct=1 --ioengine=psync --runtime=10 --time_based --readonly 2>&1 | grep -o "READ: bw=[^ ]*")"; }
log "pack exact"
( /usr/bin/time -v $O/cg.sh pack-exact 2147483648 moeinf pack $W/dsv2l --offload-dir $W/dsv2l.moeinf --no-progress ) > $O/pack-exact.log 2>&1
drive $W/dsv2l.moeinf/experts.bin
log "exact own 8GiB"
moeinf bench scale $W/dsv2l --memory-cap 8GiB --store $W/dsv2l.moeinf --rows default --rows-routing own --prompts 2 --new-tokens 16 --hf-reference $REF --json --out $O/e8own > $O/e8own.log 2>&1
log "exact replayed 8GiB pair"
moeinf bench scale $W/dsv2l --memory-cap 8GiB --store $W/dsv2l.moeinf --routing-trace $T --rows-routing replayed --rows default,on-demand-lru --prompts 2 --new-tokens 16 --json --out $O/e8r > $O/e8r.log 2>&1
log "exact replayed 16GiB pair"
moeinf bench scale $W/dsv2l --memory-cap 16GiB --store $W/dsv2l.moeinf --routing-trace $T --rows-routing replayed --rows on-demand-lru,default --prompts 2 --new-tokens 16 --json --out $O/e16r > $O/e16r.log 2>&1
log "delete exact, pack coded"
rm -rf $W/dsv2l.moeinf
( /usr/bin/time -v $O/cg.sh pack-coded 2147483648 moeinf pack $W/dsv2l --offload-dir $W/dsv2l.coded --compress --no-progress ) > $O/pack-coded.log 2>&1
drive $W/dsv2l.coded/experts.bin
log "coded own 8GiB"
moeinf bench scale $W/dsv2l --memory-cap 8GiB --store $W/dsv2l.coded --rows default --rows-routing own --prompts 2 --new-tokens 16 --hf-reference $REF --json --out $O/c8own > $O/c8own.log 2>&1
log "coded replayed 8GiB pair"
moeinf bench scale $W/dsv2l --memory-cap 8GiB --store $W/dsv2l.coded --routing-trace $T --rows-routing replayed --rows default,on-demand-lru --prompts 2 --new-tokens 16 --json --out $O/c8r > $O/c8r.log 2>&1
log "coded replayed 16GiB pair"
moeinf bench scale $W/dsv2l --memory-cap 16GiB --store $W/dsv2l.coded --routing-trace $T --rows-routing replayed --rows on-demand-lru,default --prompts 2 --new-tokens 16 --json --out $O/c16r > $O/c16r.log 2>&1
drive $W/dsv2l.coded/experts.bin
log "done"
