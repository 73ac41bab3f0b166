"""EAMC benchmark: how long matching a partial EAM takes, and how online adaptation follows a shift.

Matching (default mode): an EAMC of `--capacity` entries `[L, E]` (synthetic EAMs with task structure,
`moeinf.trace.synthetic`; matching cost does not depend on the values), and `--matches` partial EAMs, each
observed up to a random layer depth d in 1..L. Two figures, median and p99 over all matches:

- `match_us`: what the runtime pays at a decode step after the router of layer d-1 sent the new token
  to its top-k experts: `Matcher.add(d - 1, ids)` (k contiguous `[P]` vectors) then `Matcher.match(d)`
  (one `[d] @ [d, P]` product, argmax);
- `prefill_match_us`: the same when a whole row arrives at once (`Matcher.update(d - 1, row)`);
- `full_match_us`: the stateless `EAMC.match(partial, d)`: one `[P, d*E] @ [d*E]` product from scratch.

`--sweep` repeats the measurement for capacities 10..1000. `--shift` runs the distribution-shift
experiment (`distribution_shift`): accuracy per sequence before and after a workload change, with the
online rebuild. `--traces FILE` measures prediction accuracy on a real raw routing trace
(`prediction_accuracy`). Results are printed as a table, or as one JSON object with `--json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from moeinf.bench.common import machine
from moeinf.trace.eamc import EAMC
from moeinf.trace.matcher import Matcher
from moeinf.trace.online import OnlineEAMC
from moeinf.trace.synthetic import Workload

SWEEP = (10, 30, 100, 300, 1000)
QUICK_SWEEP = (10, 100, 300)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity", type=int, default=300, help="EAMC entries P (default 300)")
    parser.add_argument("--layers", type=int, default=48, help="MoE layers L (default 48)")
    parser.add_argument("--experts", type=int, default=128, help="experts per layer E (default 128)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (default 8)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per synthetic sequence (default 64)")
    parser.add_argument("--matches", type=int, default=2000, help="timed matches (default 2000, min 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help=f"match times for capacities {SWEEP}")
    parser.add_argument("--shift", action="store_true",
                        help="distribution-shift experiment with online rebuild")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="BLAS threads while matching (default 1: the runtime matches on its own thread)")
    parser.add_argument("--traces", metavar="FILE",
                        help="raw routing trace (moeinf trace --raw-out): also measure prediction accuracy")
    parser.add_argument("--quick", action="store_true",
                        help=f"1000 matches; the sweep covers {QUICK_SWEEP}")
    parser.add_argument("--out", metavar="DIR", help="append the result as one JSON line to DIR/eamc.jsonl")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def percentiles(seconds: list[float]) -> tuple[float, float]:
    """(median, p99) in microseconds."""
    us = np.asarray(seconds) * 1e6
    return round(float(np.median(us)), 2), round(float(np.percentile(us, 99)), 2)


def time_matching(capacity: int, num_layers: int, num_experts: int, *, top_k: int = 8, tokens: int = 64,
                  matches: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Median and p99 (us) of the runtime's decode-step and prefill matches and of the stateless match."""
    workload = Workload.make(num_layers, num_experts, top_k=top_k, tasks=16, seed=seed)
    eamc = EAMC(workload.sample(capacity, tokens=tokens, seed=seed + 1, exact=False)[0])
    queries = workload.sample(64, tokens=tokens, seed=seed + 2, exact=False)[0]
    rng = np.random.default_rng(seed + 3)
    depths = rng.integers(1, num_layers + 1, size=matches).tolist()
    picks = rng.integers(0, len(queries), size=matches).tolist()
    matcher = Matcher(eamc)
    decode, prefill, full, chosen = [], [], [], []
    for depth, pick in zip(depths, picks, strict=True):
        query, layer = queries[pick], depth - 1
        # The decode step: the runtime has seen this sequence up to its previous token, and the router of
        # `layer` just sent the new token to `top_k` experts (untimed setup, timed update + match).
        token = rng.choice(np.flatnonzero(query[layer]), size=min(top_k, np.count_nonzero(query[layer])),
                           replace=False)
        before = query[layer].copy()
        before[token] -= 1
        matcher.reset()
        matcher.update_all(query, layer)
        matcher.update(layer, before)
        start = time.perf_counter()
        matcher.add(layer, token)
        index, _ = matcher.match(depth)
        decode.append(time.perf_counter() - start)
        chosen.append(index)
        # The prefill: a whole row arrives at once.
        matcher.update(layer, np.zeros(num_experts, dtype=np.float32))
        start = time.perf_counter()
        matcher.update(layer, query[layer])
        matcher.match(depth)
        prefill.append(time.perf_counter() - start)
    # Timed in a loop of its own: a large product evicts the caches the incremental path relies on.
    for depth, pick, index in zip(depths, picks, chosen, strict=True):
        query = queries[pick]
        start = time.perf_counter()
        full_index, _ = eamc.match(query, depth)
        full.append(time.perf_counter() - start)
        scores = eamc.similarities(query, depth)
        assert np.isclose(scores[index], scores[full_index], atol=1e-5), "incremental and full match disagree"
    result: dict[str, Any] = {"capacity": capacity, "layers": num_layers, "experts": num_experts,
                              "matches": matches}
    for name, times in (("match", decode), ("prefill_match", prefill), ("full_match", full)):
        result[f"{name}_us"], result[f"{name}_p99_us"] = percentiles(times)
    return result


def distribution_shift(*, num_layers: int = 16, num_experts: int = 64, top_k: int = 4, capacity: int = 50,
                       before: int = 200, after: int = 80, rebuild_after: int = 12, threshold: float = 0.5,
                       tokens: int = 48, seed: int = 0) -> dict[str, Any]:
    """Accuracy per sequence when the workload changes, with the online rebuild of the EAMC.

    The EAMC is built from `before` sequences of workload A; then `after` sequences of workload B (other
    tasks) are served one by one, each predicted by the entry nearest its whole EAM (the best the EAMC
    can do) and reported to `OnlineEAMC`. The result lists the accuracy of every B sequence and how many
    were served before the accuracy of 5 consecutive sequences recovered to 90% of the pre-shift level.
    """
    old = Workload.make(num_layers, num_experts, top_k=top_k, tasks=8, seed=seed)
    new = Workload.make(num_layers, num_experts, top_k=top_k, tasks=8, seed=seed + 100)
    trained = old.sample(before, tokens=tokens, seed=seed + 1)[0]
    online = OnlineEAMC(EAMC.build(trained, capacity, seed=seed), threshold, rebuild_after, seed=seed)
    baseline = [online.report(e, online.current.match(e)[1])
                for e in old.sample(40, tokens=tokens, seed=seed + 2)[0]]
    scores = []
    for eam in new.sample(after, tokens=tokens, seed=seed + 3)[0]:
        scores.append(online.report(eam, online.current.match(eam)[1]))
        online.wait()  # serve the next sequence with the rebuilt EAMC once it is ready
    level = 0.9 * float(np.mean(baseline))
    window = 5
    recovered = next((i for i in range(len(scores) - window + 1)
                      if np.mean(scores[i:i + window]) >= level), None)
    return {"baseline_accuracy": round(float(np.mean(baseline)), 4),
            "accuracy": [round(s, 4) for s in scores],
            "recovered_after": recovered, "rebuilds": online.rebuilds, "rebuild_after": rebuild_after,
            "threshold": threshold, "capacity": capacity}


def prediction_accuracy(path: str | Path, capacity: int, *, test_share: float = 0.25,
                        seed: int = 0) -> dict[str, Any]:
    """How well the EAMC foresees the experts a sequence's generated tokens will use (`eam.accuracy`).

    From a raw routing trace (`moeinf trace --raw-out`): an EAMC is built from the whole EAMs of a
    random (1 - test_share) of the sequences; each test sequence is matched on its prefill (prompt)
    EAM, and the matched entry is scored against the EAM of its decode steps. Baselines: the global
    popularity of the training sequences, and the prompt's own EAM (its experts are reused); "blend"
    ranks by prompt share + 0.5 * matched share + 0.25 * popularity; "mean" by the three shares
    averaged, the runtime's estimate past the look-ahead (`hybrid` prefetch).
    """
    from moeinf.trace.eam import accuracy, flat_unit_rows, sum_normalize_rows
    from moeinf.trace.eamc import distinct_count
    from moeinf.trace.rawtrace import load_step_counts

    counts = [c for _, _, c in load_step_counts(path) if len(c) > 1]
    if len(counts) < 8:
        raise SystemExit(f"moeinf bench eamc: error: {path} has {len(counts)} sequences with decode steps; "
                         "trace at least 8 with --max-new-tokens >= 2")
    order = np.random.default_rng(seed).permutation(len(counts))
    cut = max(1, int(round(len(counts) * test_share)))
    test, train = order[:cut], order[cut:]
    train_eams = np.stack([counts[i].sum(axis=0) for i in train])
    effective = min(capacity, distinct_count(flat_unit_rows(train_eams)))
    eamc = EAMC.build(train_eams, effective, seed=seed)
    popularity = sum_normalize_rows(train_eams).sum(axis=0)
    scores: dict[str, list[float]] = {"eamc": [], "popularity": [], "prompt": [], "blend": [], "mean": []}
    for i in test:
        prefill, future = counts[i][0], counts[i][1:].sum(axis=0)
        _, matched = eamc.match(prefill)
        scores["eamc"].append(accuracy(future, matched))
        scores["popularity"].append(accuracy(future, popularity))
        scores["prompt"].append(accuracy(future, prefill))
        # the prompt's own experts first, the matched entry and then popularity breaking their ties
        blend = (sum_normalize_rows(prefill) + 0.5 * sum_normalize_rows(matched)
                 + 0.25 * sum_normalize_rows(popularity))
        scores["blend"].append(accuracy(future, blend))
        # the runtime's estimate past the look-ahead (`hybrid`): the three shares averaged
        mean = (sum_normalize_rows(prefill) + sum_normalize_rows(matched)
                + sum_normalize_rows(popularity)) / 3
        scores["mean"].append(accuracy(future, mean))
    return {"traces": str(path), "train": len(train), "test": len(test), "capacity": effective,
            **{f"accuracy_{name}": round(float(np.mean(v)), 4) for name, v in scores.items()}}


def run(args: argparse.Namespace) -> int:
    if args.matches < 1000:
        raise SystemExit("moeinf bench eamc: error: --matches must be >= 1000 for a stable p99")
    header = {"bench": "eamc", "machine": machine(), "seed": args.seed, "top_k": args.top_k,
              "tokens": args.tokens, "blas_threads": args.blas_threads}
    results: dict[str, Any] = dict(header)
    if args.shift:
        results["shift"] = distribution_shift(seed=args.seed)
    if args.traces:
        results["prediction"] = prediction_accuracy(args.traces, args.capacity, seed=args.seed)
    capacities = (QUICK_SWEEP if args.quick else SWEEP) if args.sweep else (args.capacity,)
    matches = 1000 if args.quick else args.matches
    with threadpool_limits(args.blas_threads):
        results["matching"] = [time_matching(p, args.layers, args.experts, top_k=args.top_k,
                                             tokens=args.tokens, matches=matches, seed=args.seed)
                               for p in capacities]
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with (out / "eamc.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(results) + "\n")
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{'capacity':>8} {'layers':>6} {'experts':>7} {'match_us':>9} {'p99':>9} "
          f"{'prefill_match_us':>16} {'p99':>9} {'full_match_us':>13} {'p99':>9}")
    for row in results["matching"]:
        print(f"{row['capacity']:>8} {row['layers']:>6} {row['experts']:>7} {row['match_us']:>9} "
              f"{row['match_p99_us']:>9} {row['prefill_match_us']:>16} {row['prefill_match_p99_us']:>9} "
              f"{row['full_match_us']:>13} {row['full_match_p99_us']:>9}")
    if args.traces:
        pred = results["prediction"]
        print(f"prediction of decode-step experts ({pred['test']} test sequences, EAMC of "
              f"{pred['capacity']} from {pred['train']}): eamc {pred['accuracy_eamc']}, "
              f"popularity {pred['accuracy_popularity']}, prompt's own experts {pred['accuracy_prompt']}, "
              f"blend {pred['accuracy_blend']}, mean (the runtime's hybrid) {pred['accuracy_mean']}")
    if args.shift:
        shift = results["shift"]
        print(f"shift: baseline accuracy {shift['baseline_accuracy']}, first after shift "
              f"{shift['accuracy'][0]}, recovered after {shift['recovered_after']} sequences "
              f"({shift['rebuilds']} rebuilds, rebuild_after={shift['rebuild_after']})")
    return 0
