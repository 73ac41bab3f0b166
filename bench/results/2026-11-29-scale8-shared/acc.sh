#!/usr/bin/env bash
# After abo.sh: HF + accelerate under the same 8 GiB cap (its offload folder and the store do not fit on the
# disk together, so the store goes first), then the store packed again under a 2 GiB cgroup.
set -u
cd $REPO && . .venv/bin/activate
while pgrep -f abo.sh > /dev/null; do sleep 10; done
echo "$(date -u +%T) delete store; accelerate 8GiB"
rm -rf $WORK/dsv2l.moeinf
moeinf bench scale $WORK/dsv2l --memory-cap 8GiB --rows accelerate --prompts 1 --accelerate-tokens 3 --json --out $WORK/s8/acc8 > $WORK/s8/acc8.log 2>&1
echo "$(date -u +%T) accelerate done; repack"
rm -rf $WORK/dsv2l.accelerate-offload
bash bench/results/2026-11-29-scale5-codec/cg.sh pack 2147483648 moeinf pack $WORK/dsv2l --offload-dir $WORK/dsv2l.moeinf --no-progress > $WORK/s8/pack.log 2>&1
echo "$(date -u +%T) packed rc $?"
