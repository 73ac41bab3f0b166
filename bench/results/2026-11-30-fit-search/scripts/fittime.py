import sys, time
from moeinf.bench.cache import load_workload, split, busiest_layer, FRACTIONS
from moeinf.policy.fitted import fit_eviction

wl = load_workload(sys.argv[1], quick=False, seed=0)
ev, hist = split(len(wl.traces), 0.25, 0)
rep = [wl.traces[i] for i in ev]
total = wl.num_layers * wl.num_experts
caps = [max(busiest_layer(rep), round(f * total)) for f in FRACTIONS]
for w in [int(x) for x in sys.argv[2].split(",")]:
    t = time.perf_counter()
    c = time.process_time()
    fit = fit_eviction(
        [wl.traces[i] for i in hist], capacities=caps, seed=0, workers=w, passes=int(sys.argv[3])
    )
    print(
        "workers",
        w,
        "passes",
        sys.argv[3],
        "wall",
        round(time.perf_counter() - t, 1),
        "cpu",
        round(time.process_time() - c, 1),
        "cand",
        fit.meta["candidates"],
        flush=True,
    )
