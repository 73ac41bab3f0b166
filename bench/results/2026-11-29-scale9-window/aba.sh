#!/usr/bin/env bash
# on-demand with the activation-aware eviction (A: prefetch=none) against the default (E), alternated
set -u
cd $WORK/s9
cap=$1
./row.sh $cap A-$cap-1 --rows default --set prefetch=none
./row.sh $cap E-$cap-3 --rows default
./row.sh $cap E-$cap-4 --rows default
./row.sh $cap A-$cap-2 --rows default --set prefetch=none
date
