#!/usr/bin/env bash
# prefetch floor 0.3 (the default, E) against 0.4 (F), replayed routing, alternated
set -u
cd $WORK/s8
cap=$1
./row.sh $cap E3-$cap-1 --rows default
./row.sh $cap F4-$cap-1 --rows default --set prefetch_min_probability=0.4
./row.sh $cap F4-$cap-2 --rows default --set prefetch_min_probability=0.4
./row.sh $cap E3-$cap-2 --rows default
date
