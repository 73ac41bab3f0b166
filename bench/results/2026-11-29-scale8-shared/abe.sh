#!/usr/bin/env bash
# early shared experts on (E) / off (N) for the default row, and on-demand LRU (L, early on), alternated
set -u
cd $WORK/s8
cap=$1
./row.sh $cap E-$cap-1 --rows default
./row.sh $cap N-$cap-1 --rows default --set early_shared_experts=false
./row.sh $cap L-$cap-1 --rows on-demand-lru
./row.sh $cap L-$cap-2 --rows on-demand-lru
./row.sh $cap N-$cap-2 --rows default --set early_shared_experts=false
./row.sh $cap E-$cap-2 --rows default
date
