"""Scratch: does a learned next-use model (features of counts and recency, fit on the EAMC side against the
true next use) evict better than the fitted score at one cell? Python replay, top-1 or top-k traces."""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from moeinf.bench.cache import FRACTIONS, busiest_layer, load_workload, split
from moeinf.policy.fitted import access_counts, request_counts
from moeinf.policy.simulate import Accesses

SH = os.environ["SHARED"] + "/data/traces/"
RES = Path(__file__).resolve().parents[1] / "data"
trace, top1, seed, frac = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), float(sys.argv[4])
model_kind = sys.argv[5] if len(sys.argv) > 5 else "gbdt"
files = {
    "dsv2lite": SH + "dsv2lite-puffin-700.jsonl.gz",
    "gptoss20b": SH + "gptoss20b-fingerprint-400.jsonl.gz",
}
wl = load_workload(files[trace], quick=False, seed=seed, top1=top1)
L, E = wl.num_layers, wl.num_experts
ev, hist = split(len(wl.traces), 0.25, seed)
rep = [wl.traces[i] for i in ev]
H = [wl.traces[i] for i in hist]
rng = np.random.default_rng(seed)
order = rng.permutation(len(H))
ntrain = max(1, len(H) // 4)
train = [H[i] for i in np.sort(order[:ntrain])]
seedside = [H[i] for i in order[ntrain:]]
total = L * E
i = min(range(len(FRACTIONS)), key=lambda j: abs(FRACTIONS[j] - frac))
cap = max(busiest_layer(rep), round(FRACTIONS[i] * total))
NEVER = np.iinfo(np.int64).max
# "gbdt": LRU's decisions, 9 features; "gbdt-lfu": LFU's decisions and a 10th, the fixed score's share
FEATS = 10 if model_kind.endswith("-lfu") else 9


def replay(acc, counts, firsts, scorer, collect=None, sample_every=50):
    keys, vs, vl, ns, nv = acc.keys, acc.visit_start, acc.visit_layer, acc.new_sequence, acc.next_visit
    stamp = np.full(total, -1.0)  # step of last use
    req_count = np.zeros(total)
    req_used = np.zeros(total)
    decayed = np.zeros(total)
    coll = counts.astype(float).copy().reshape(-1)
    first = firsts.astype(float).copy().reshape(-1)
    layer_tot = coll.reshape(L, E).sum(1)
    first_tot = first.reshape(L, E).sum(1)
    next_use = np.full(total, NEVER, dtype=np.int64)
    resident = np.zeros(total, dtype=bool)
    occ = 0
    hits = misses = 0
    step = 0
    req_steps = 0
    prev_layer = L
    decisions = 0
    layer_of = np.arange(total) // E
    for v in range(vl.size):
        layer = vl[v]
        if ns[v]:
            req_count[:] = 0
            req_used[:] = 0
            decayed[:] = 0
            req_steps = 0
        if layer <= prev_layer:
            step += 1
            req_steps += 1
            decayed *= 0.9
        prev_layer = layer
        a0, a1 = vs[v], vs[v + 1]
        ks = keys[a0:a1]
        for a in range(a0, a1):
            next_use[keys[a]] = nv[a]
        missing = ks[~resident[ks]]
        over = occ + missing.size - cap
        if over > 0:
            cand = np.flatnonzero(resident)
            cand = cand[~np.isin(cand, ks)]
            cl = layer_of[cand]
            ahead = (cl - layer - 1) % L
            f = np.empty((cand.size, FEATS))
            f[:, 0] = np.log1p(np.where(stamp[cand] >= 0, step - stamp[cand], 1e6))
            f[:, 1] = np.log1p(req_count[cand])
            f[:, 2] = np.log1p(req_steps)
            f[:, 3] = req_used[cand]
            f[:, 4] = np.log((coll[cand] + 1) / (layer_tot[cl] + E))
            f[:, 5] = np.log((first[cand] + 1) / (first_tot[cl] + E))
            f[:, 6] = ahead / L
            f[:, 7] = np.log1p(decayed[cand])
            f[:, 8] = cl / L
            if FEATS == 10:
                f[:, 9] = np.log(
                    (req_count[cand] + 8 * (coll[cand] + 1) / (layer_tot[cl] + E)) / (req_steps + 8)
                )
            if collect is not None and decisions % sample_every == 0:
                dist = np.where(next_use[cand] == NEVER, 10**7, next_use[cand] - v)
                collect.append((f, np.log1p(dist)))
            decisions += 1
            pred = scorer(f, cand)  # higher = evict first
            victims = cand[np.argpartition(-pred, over - 1)[:over]] if over < cand.size else cand
            resident[victims] = False
            occ -= victims.size
        for k in ks:
            if resident[k]:
                hits += 1
            else:
                misses += 1
                resident[k] = True
                occ += 1
            if req_used[k] == 0:
                first[k] += 1
                first_tot[layer] += 1
            req_used[k] = 1
            req_count[k] += 1
            decayed[k] += 1
            coll[k] += 1
            layer_tot[layer] += 1
            stamp[k] = step
    return hits, misses


lru = lambda f, c: f[:, 0]
lfu = lambda f, c: -f[:, 4]
BEHAVIOUR = lfu if model_kind.endswith("-lfu") else lru
t = time.perf_counter()
tr_acc = Accesses.of(train)
c_seed, f_seed = access_counts(seedside), request_counts(seedside)
rows = []
replay(tr_acc, c_seed, f_seed, BEHAVIOUR, collect=rows, sample_every=3)
X = np.concatenate([r[0] for r in rows])
y = np.concatenate([r[1] for r in rows])
print("train rows", X.shape, "replay s", round(time.perf_counter() - t, 1), flush=True)
if model_kind.startswith("gbdt"):
    from sklearn.ensemble import HistGradientBoostingRegressor

    m = HistGradientBoostingRegressor(max_iter=200, max_leaf_nodes=31, learning_rate=0.1).fit(X, y)
else:
    from sklearn.linear_model import Ridge
    from sklearn.preprocessing import PolynomialFeatures

    poly = PolynomialFeatures(2, include_bias=False)
    lin = Ridge(alpha=1.0).fit(poly.fit_transform(X), y)

    class M:
        def predict(self, X):
            return lin.predict(poly.transform(X))

    m = M()
print("fit s", round(time.perf_counter() - t, 1), flush=True)
acc = Accesses.of(rep)
c_all, f_all = access_counts(H), request_counts(H)
res = {}
for name, sc in [("lru", lru), ("learned", lambda f, c: m.predict(f))]:
    h, mi = replay(acc, c_all, f_all, sc)
    res[name] = h / (h + mi)
    print(name, h, mi, round(h / (h + mi), 5), flush=True)
rows = [
    json.loads(l)
    for l in (RES / f"{trace}{'-top1' if top1 else ''}-seed{seed}.jsonl").read_text().splitlines()
    if l.strip()
]
pol = {r["policy"]: r for r in rows if r["capacity"] == cap}
n = pol["lru"]["hits"] + pol["lru"]["misses"]
ratio = {k: v["hits"] / n for k, v in pol.items()}
best = max(ratio["lru"], ratio["lfu"])
target = max(best + min(0.03, (ratio["oracle"] - best) / 3), ratio["activation-aware"] - 0.01)
print(
    json.dumps(
        {
            "cell": [trace, top1, seed, frac, cap],
            "kernel": ratio,
            "target": target,
            "python": res,
            "learned_minus_target_pt": 100 * (res["learned"] - target),
        }
    )
)
