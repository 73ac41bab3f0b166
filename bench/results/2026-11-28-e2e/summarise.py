import sys, json
for f in sys.argv[1:]:
    for l in open(f):
        if not l.startswith('{'): continue
        r = json.loads(l); m = r['ms_per_token']; c = r['main_thread_cpu_ms_per_token']
        print(f"{r['variant']:10s} med {r['median_ms']:7.2f} mean {r['mean_ms']:7.2f} stall {m['stall']:5.2f} plan {m['plan']:5.2f} guess {m['guess']:4.2f} mainCPU {c['total']:6.2f} settle {r.get('settle_ms_per_token_all_passes','-')} MB {r['mb_per_token']} reads {r['reads_per_token']} demand {r['demand_reads_per_token']} eq {r['tokens_equal_first']}")
