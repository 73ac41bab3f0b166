#!/usr/bin/env bash
# the tree's default (joined transitions) against on-demand LRU, alternated (order swapped each pair)
set -u
cd $WORK/s7
for cap in "$@"; do
  ./row.sh $cap fd-$cap-1 --rows default
  ./row.sh $cap fl-$cap-1 --rows on-demand-lru
  ./row.sh $cap fl-$cap-2 --rows on-demand-lru
  ./row.sh $cap fd-$cap-2 --rows default
  date
done
