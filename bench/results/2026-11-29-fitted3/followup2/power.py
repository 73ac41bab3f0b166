"""Scratch: per-key prior strength (stickiness) on top of the fitted score (issue 40)."""
import pickle, sys, time, json
import numpy as np
from numba import njit
from moeinf.policy.kernels import (observe, observe_layer, _ahead, ACTIVATION, P_EPS, P_DISTANCE, P_SPAN,
                                   P_TOPK, P_ALPHA, P_MIX, P_FOLLOW, RECENT, FOLLOW, SLOW, TOTAL, SLOW_TOTAL,
                                   FOLLOWED)
from moeinf.bench.cache import split, access_counts, busiest_layer
from moeinf.policy.simulate import Accesses, simulate
from moeinf.policy.fitted import fit_eviction, FittedEviction, _policy, mean_top_k


@njit(cache=True, nogil=True)
def choose_k(params, num_layers, members, stamp, count, blocked, running, layer_state, seen_total, layer,
             akey, out, q):
    inv_experts = 1.0 / (stamp.size // num_layers)
    eps, by_distance = params[P_EPS], params[P_DISTANCE] > 0.0
    span, topk = params[P_SPAN] * num_layers, params[P_TOPK]
    alpha, m = params[P_ALPHA], params[P_MIX]
    recent, follow, slow = running[RECENT], running[FOLLOW], running[SLOW]
    n = members.size
    cand = np.empty(n, dtype=np.int64)
    scores = np.empty(n)
    found = 0
    for i in members:
        if blocked[i]:
            continue
        kl = int((i + 0.5) * inv_experts)
        a = alpha * akey[i]
        pi = count[i] / seen_total[kl] if seen_total[kl] > 0 else 0.0
        fm = params[P_FOLLOW] * layer_state[FOLLOWED, kl]
        t = layer_state[TOTAL, kl] + a
        fast = (recent[i] + a * pi) / t if t > 0 else 0.0
        if m > 0.0:
            ts = layer_state[SLOW_TOTAL, kl] + a
            sl = (slow[i] + a * pi) / ts if ts > 0 else 0.0
            if q == 1.0:
                base = (1.0 - m) * fast + m * sl
            elif q > 50.0:
                base = max((1.0 - m) * fast, m * sl)
            elif q == 0.0:
                base = fast ** (1.0 - m) * sl ** m
            else:
                base = ((1.0 - m) * fast ** q + m * sl ** q) ** (1.0 / q)
        else:
            base = fast
        share = (1.0 - fm) * base + fm * follow[i] + eps
        ahead = _ahead(kl, layer, num_layers)
        if span > 0.0:
            chance = min(1.0, topk * share)
            s = -(ahead + 1.0 + span * (1.0 / chance - 1.0))
        elif by_distance:
            s = share / (ahead + 1.0)
        else:
            s = share
        cand[found] = i
        scores[found] = s
        found += 1
    wanted = min(out.size, found)
    keys = cand[:found]
    by_stamp = np.argsort(stamp[keys], kind="mergesort")
    order = by_stamp[np.argsort(scores[:found][by_stamp], kind="mergesort")]
    out[:wanted] = keys[order[:wanted]]
    return wanted


@njit(cache=True, nogil=True)
def replay_k(params, num_layers, capacity, keys, tokens, visit_start, visit_layer, new_sequence, stamp, count,
             resident, clock, alphas, loglik, running, layer_state, transition, flags, akey, q):
    size = resident.size
    num_experts = size // num_layers
    eam = np.zeros(size)
    blocked = np.zeros(size, dtype=np.bool_)
    out = np.empty(size, dtype=np.int64)
    members = np.flatnonzero(resident)
    occupancy = members.size
    members = np.concatenate((members, np.zeros(size - occupancy, dtype=np.int64)))
    slot = np.full(size, -1, dtype=np.int64)
    slot[members[:occupancy]] = np.arange(occupancy)
    grown = np.zeros(num_layers, dtype=np.bool_)
    whole = True
    seen_total = np.zeros(num_layers)
    for kl in range(num_layers):
        for i in range(kl * num_experts, (kl + 1) * num_experts):
            seen_total[kl] += count[i]
    hits = 0
    misses = 0
    for v in range(visit_layer.size):
        if new_sequence[v]:
            eam[:] = 0.0
            whole = True
        start, stop = visit_start[v], visit_start[v + 1]
        layer = visit_layer[v]
        missing = 0
        for a in range(start, stop):
            key = keys[a]
            eam[key] += tokens[a]
            blocked[key] = True
            if not resident[key]:
                missing += 1
        grown[layer] = grown[layer] or stop > start
        over = occupancy + missing - capacity
        if over > 0:
            if whole:
                observe(num_layers, eam, running, layer_state, transition, count, params, alphas, loglik, flags)
                whole = False
            else:
                for gl in range(num_layers):
                    if grown[gl]:
                        observe_layer(gl, num_experts, eam, running, layer_state, transition, count, params,
                                      alphas, loglik)
            grown[:] = False
            found = choose_k(params, num_layers, members[:occupancy], stamp, count, blocked, running,
                             layer_state, seen_total, layer, akey, out[:over], q)
            for j in range(over):
                key = out[j]
                resident[key] = False
                occupancy -= 1
                moved = members[occupancy]
                members[slot[key]] = moved
                slot[moved] = slot[key]
                slot[key] = -1
        for a in range(start, stop):
            key = keys[a]
            if resident[key]:
                hits += 1
            else:
                misses += 1
                resident[key] = True
                members[occupancy] = key
                slot[key] = occupancy
                occupancy += 1
                stamp[key] = clock[0]
                clock[0] += 1
        for a in range(start, stop):
            key = keys[a]
            stamp[key] = clock[0]
            clock[0] += 1
            count[key] += 1.0
            seen_total[layer] += 1.0
            blocked[key] = False
    return hits, misses


def run_k(acc, capacity, policy, counts, akey, q=1.0):
    policy.reset(counts)
    e = policy
    return replay_k(e.params, acc.num_layers, capacity, acc.keys, acc.tokens, acc.visit_start, acc.visit_layer,
                    acc.new_sequence, e.stamp, e.count, e.resident, e.clock, e.alphas, e.loglik, e.running,
                    e.layer_state, e.transition, e.flags, akey, q)


def overdispersion(traces, num_layers, num_experts):
    """Per key, beta-binomial concentration from the between-request variance of its use rate."""
    c = np.array([np.count_nonzero(t, axis=0) for t in traces], dtype=np.float64)  # [R, L, E] steps using
    n = np.array([np.count_nonzero(t.sum(axis=2), axis=0) for t in traces], dtype=np.float64)  # [R, L]
    n = np.maximum(n, 1.0)[:, :, None]
    k = c.sum(axis=(0,)) / n.sum(axis=0)  # pooled rate per visit [L, E]
    r = c / n
    var = (n * (r - k) ** 2).sum(axis=0) / n.sum(axis=0)  # weighted variance
    noise = k * (1 - k) * (len(traces) / n.sum(axis=0))  # mean 1/n approx
    base = np.maximum(k * (1 - k), 1e-12)
    phi = np.clip((var - noise * 0 - k * (1 - k) / n.mean(axis=0)) / base, 1e-3, 1.0)
    alpha = 1.0 / phi - 1.0
    alpha = np.maximum(alpha, 1e-3)
    return alpha.reshape(-1), k.reshape(-1)


def main():
    name, fraction, seed = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    qs = [float(b) for b in sys.argv[4].split(",")]
    mixes = [float(b) for b in sys.argv[5].split(",")]
    wl = pickle.load(open(f"$WORK/{name}.pkl", "rb"))
    ev, hi = split(len(wl.traces), 0.25, seed)
    hist = [wl.traces[i] for i in hi]
    acc = Accesses.of([wl.traces[i] for i in ev])
    counts = access_counts(hist)
    total = wl.num_layers * wl.num_experts
    cap = max(busiest_layer([wl.traces[i] for i in ev]), round(fraction * total))
    fit = fit_eviction(hist, capacities=[cap], seed=seed)
    setting = fit.settings[0]
    print("fit", setting, flush=True)
    arrays = [np.asarray(x) for x in hist]
    order = np.random.default_rng(seed).permutation(len(arrays))
    sizes = np.array([np.count_nonzero(arrays[i]) for i in order])
    take = max(1, min(len(arrays) // 2, int(np.searchsorted(np.cumsum(sizes), 150_000)) + 1))
    facc = Accesses.of([arrays[i] for i in np.sort(order[:take])])
    fcounts = access_counts([arrays[i] for i in order[take:]])
    ones = np.ones(total)
    pol = FittedEviction(wl.num_layers, wl.num_experts, fit); pol.set_capacity(cap)
    base = simulate(acc, cap, pol, counts=counts).hits
    pol = FittedEviction(wl.num_layers, wl.num_experts, fit); pol.set_capacity(cap)
    fbase = simulate(facc, cap, pol, counts=fcounts).hits
    print("eval accesses", acc.keys.size, "fitted hits", base, "fit-side", fbase, flush=True)
    from dataclasses import replace
    from moeinf.policy.fitted import Setting
    for q in qs:
        for mix in mixes:
            for slow in (0.995, 1.0):
                s = replace(setting, mix=mix, slow=slow)
                res = []
                for (A, C) in ((facc, fcounts), (acc, counts)):
                    p = FittedEviction(wl.num_layers, wl.num_experts, fit); p.set_capacity(cap); p.use(s)
                    h, m = run_k(A, cap, p, C, ones, q)
                    res.append(h)
                print(f"q {q} mix {mix} slow {slow}: fit-side {res[0]-fbase:+d}  eval {res[1]-base:+d} "
                      f"({(res[1]-base)/acc.keys.size*100:+.3f} pt)", flush=True)


main()
