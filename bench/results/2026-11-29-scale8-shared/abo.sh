#!/usr/bin/env bash
# own routing, 8 GiB: early shared experts on (E) / off (N), alternated
set -u
cd $WORK/s8
./rowo.sh 8GiB Eo-8GiB-1
./rowo.sh 8GiB No-8GiB-1 --set early_shared_experts=false
./rowo.sh 8GiB No-8GiB-2 --set early_shared_experts=false
./rowo.sh 8GiB Eo-8GiB-2
date
