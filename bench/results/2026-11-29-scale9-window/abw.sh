#!/usr/bin/env bash
# default (E), prefetch_window 0.1 (W) and on-demand LRU (L), alternated, replayed routing
set -u
cd $WORK/s9
cap=$1; w=${2:-0.1}; t=${3:-W}
./row.sh $cap E-$cap-1 --rows default
./row.sh $cap $t-$cap-1 --rows default --set prefetch_window=$w
./row.sh $cap L-$cap-1 --rows on-demand-lru
./row.sh $cap $t-$cap-2 --rows default --set prefetch_window=$w
./row.sh $cap E-$cap-2 --rows default
./row.sh $cap L-$cap-2 --rows on-demand-lru
date
