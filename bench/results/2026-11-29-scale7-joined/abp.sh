#!/usr/bin/env bash
set -u
cd $WORK/s7
cap=$1
export OMP_WAIT_POLICY=PASSIVE
./row.sh $cap pd2-$cap-1 --rows default --threads 2
./row.sh $cap pl2-$cap-1 --rows on-demand-lru --threads 2
./row.sh $cap pl2-$cap-2 --rows on-demand-lru --threads 2
./row.sh $cap pd2-$cap-2 --rows default --threads 2
date
