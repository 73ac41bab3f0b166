import json,sys,glob,statistics as st,os
for f in sorted(glob.glob(sys.argv[1]+'/*.jsonl')):
    rs=[json.loads(l) for l in open(f) if l.strip()]
    r=[x['ratio'] for x in rs]; p=[x['paired_ratio'] for x in rs]; d=[x['demand_over_ideal'] for x in rs]; q=[x['preempt_over_ideal'] for x in rs]
    print(f"{os.path.basename(f)[:-6]:22s} n={len(rs)} ratio {st.median(r):.3f} ({' '.join('%.2f'%x for x in r)}) paired {st.median(p):.3f} demand {st.median(d):.2f} ({' '.join('%.2f'%x for x in d)}) preempt {st.median(q):.2f} cpu {st.median([x['engine_cpu_s_per_gb'] for x in rs]):.3f}")
