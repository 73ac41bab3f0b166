#!/usr/bin/env bash
# row.sh CAP TAG [ARGS]: one replayed row of `moeinf bench scale` (its own process and memory cgroup)
cd $REPO; . .venv/bin/activate
cap=$1; tag=$2; shift 2
moeinf bench scale $WORK/dsv2l --memory-cap $cap --store $WORK/dsv2l.moeinf \
  --routing-trace $TRACES/dsv2lite-puffin-700.jsonl.gz --rows-routing replayed \
  --prompts 2 --new-tokens 16 --json --out $WORK/s9/$tag "$@" > $WORK/s9/$tag.json 2> $WORK/s9/$tag.err
python - <<PY
import json
for l in open('$WORK/s9/$tag/scale.jsonl'):
    r=json.loads(l)
    print('$tag', r['config'], r['cap_bytes']>>30, 'ms', round(r['ms_per_token']), 'GB', round(r['os_read_bytes_per_token']/1e9,2), 'stall', round(r['stall_ms_per_token']), 'cpu', round(r['cpu_ms_per_token']), 'rq', round(r['runqueue_ms_per_token']), 'ccpu', round(r.get('compute_thread_cpu_ms_per_token',0)), 'crq', round(r.get('compute_thread_runqueue_ms_per_token',0)), 'hit', round(r['hit_ratio'],3), 'prec', round(r['prefetch_precision'],3), 'rec', round(r['prefetch_recall'],3), flush=True)
PY
