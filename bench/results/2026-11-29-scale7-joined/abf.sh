#!/usr/bin/env bash
# joined transitions: floor 0.4 vs the default 0.3, alternated (order swapped each pair)
set -u
cd $WORK/s7
for cap in "$@"; do
  ./row.sh $cap f4-$cap-1 --rows default --set prefetch_min_probability=0.4
  ./row.sh $cap f3-$cap-1 --rows default
  ./row.sh $cap f3-$cap-2 --rows default
  ./row.sh $cap f4-$cap-2 --rows default --set prefetch_min_probability=0.4
  date
done
