#!/usr/bin/env bash
# io_nice 0 vs 10 for the default row, alternated (order reversed in the second round)
set -u
cd $WORK/s8
cap=$1
./row.sh $cap n0-$cap-1 --rows default
./row.sh $cap n10-$cap-1 --rows default --set io_nice=10
./row.sh $cap n10-$cap-2 --rows default --set io_nice=10
./row.sh $cap n0-$cap-2 --rows default
date
