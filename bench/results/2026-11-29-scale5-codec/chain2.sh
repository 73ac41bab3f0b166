#!/usr/bin/env bash
# After chain.sh: HF + accelerate under the same 8 GiB cap in this session (its offload folder and the store
# do not fit on the disk together, so the store goes first).
set -u
cd $REPO && . .venv/bin/activate
W=$WORK; O=$W/codec
log() { echo "$(date -u +%T) $*" | tee -a $O/chain.log; }
while pgrep -f chain.sh > /dev/null; do sleep 10; done
log "delete coded store; accelerate 8GiB"
rm -rf $W/dsv2l.coded
moeinf bench scale $W/dsv2l --memory-cap 8GiB --rows accelerate --prompts 1 --accelerate-tokens 3 --json --out $O/acc8 > $O/acc8.log 2>&1
log "done2"
