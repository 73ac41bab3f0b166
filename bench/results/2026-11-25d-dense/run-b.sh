#!/bin/bash
# (b) at 2 threads: int8 and int4 at 25% and 10% of the store's own expert bytes, then int4 at 10% of the bf16 bytes
set -x
. /work/main/.venv/bin/activate
LL=/work/llbuild/src/llama_cpp_python-0.3.36/vendor/llama.cpp
M=/work/bench-data/e2e-zoo-full-2048x768
for spec in "store int8,int4 25%,10% b-store" "bf16 int4 10% b-bf16-int4-10"; do
  set -- $spec
  echo "loadavg before: $(cat /proc/loadavg) $(date -u +%T)"; free -m
  flock /tmp/moeinf-bench.lock moeinf bench llamacpp $M --llama-cpp-dir $LL --prompts 4 --new-tokens 32 --threads 2 \
      --precisions $2 --budgets $3 --budget-basis $1 --skip-all-in-ram --out $4.jsonl
  echo "loadavg after: $(cat /proc/loadavg) $(date -u +%T)"; free -m
done
