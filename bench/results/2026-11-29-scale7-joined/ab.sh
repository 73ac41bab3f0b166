#!/usr/bin/env bash
# threads 1 vs 2, default and LRU, replayed, alternated (order reversed in the second round)
set -u
cd $WORK/s7
cap=$1
./row.sh $cap d2-$cap-1 --rows default --threads 2
./row.sh $cap d1-$cap-1 --rows default --threads 1
./row.sh $cap l2-$cap-1 --rows on-demand-lru --threads 2
./row.sh $cap l1-$cap-1 --rows on-demand-lru --threads 1
./row.sh $cap l1-$cap-2 --rows on-demand-lru --threads 1
./row.sh $cap l2-$cap-2 --rows on-demand-lru --threads 2
./row.sh $cap d1-$cap-2 --rows default --threads 1
./row.sh $cap d2-$cap-2 --rows default --threads 2
date
