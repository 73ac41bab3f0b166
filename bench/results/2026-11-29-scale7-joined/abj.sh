#!/usr/bin/env bash
# joined transitions (default, 3 layers) vs one layer, replayed, alternated (order swapped each pair)
set -u
cd $WORK/s7
for cap in "$@"; do
  for i in 1 2 3; do
    if [ $((i % 2)) = 1 ]; then
      ./row.sh $cap j3-$cap-$i --rows default
      ./row.sh $cap j1-$cap-$i --rows default --set lookahead_transition_layers=1
    else
      ./row.sh $cap j1-$cap-$i --rows default --set lookahead_transition_layers=1
      ./row.sh $cap j3-$cap-$i --rows default
    fi
  done
  date
done
