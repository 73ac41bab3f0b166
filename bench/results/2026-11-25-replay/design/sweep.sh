#!/bin/bash
# design sweep: continuous only at x1 and x2, one config per line of $1
cd /work/main && . .venv/bin/activate
while read -r name flags; do
  [ -z "$name" ] && continue
  echo "== $name $flags load $(cat /proc/loadavg) $(date +%T)"
  python /tmp/serve-design/instrument.py /tmp/serve-design/p-$name.jsonl replay --model moeinf/zoo/weights/full --device-cache 25% --duration 60 --length-scale 0.1 --max-new-tokens 48 --batching continuous --rps-scale 1 2 --policies hybrid+activation-aware --out /tmp/serve-design/$name $flags 2>&1 | tr "\r" "\n" | grep "^| cont"
  echo "   end load $(cat /proc/loadavg) $(date +%T)"
done < "$1"
