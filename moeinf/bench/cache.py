"""Cache benchmark: expert-cache hit ratio against cache size for the eviction policies.

Replays routing traces through the offline simulator (`moeinf.policy.simulate`, one cache tier, demand
fetches only, sequences one after the other with the cache kept warm) for the fitted policy (the
activation-aware family with constants fitted per cache size on the EAMC side, `moeinf.policy.fitted`;
the header reports the fit's time), activation-aware (layer distance x the running sequence's decayed
share, see `ActivationAwareEviction`), LRU, LFU,
neighbour-aware and Belady's oracle (the upper bound), with the cache holding 5% to 60% of all experts.
Input: a raw routing trace of a real model (`--traces FILE`, JSONL written by `moeinf trace`); without
one, a synthetic workload (sparse per-sequence expert reuse, task-dependent; see
`moeinf.policy.synthetic`), reported as `"workload": "synthetic"`.

The requests are split at random (`--seed`) into an evaluation set (`--eval-share`), which is replayed,
and an EAMC set, the history a deployment would have traced before: its access counts seed every
policy's counts (LFU's frequencies, activation-aware eviction's collection prior) and is all the
fitted policy is fitted on. `--ablation` adds
the activation-aware score with each of its parts taken out, at 10% and 25%. `--gate-weights` lets each
token count k x its gate weight in the running sequence's counts (the fitted and fixed scores read them;
the EAMC's access counts, LRU, LFU and the oracle do not change); on the development traces it does not
help the fitted policy, so the runtime counts tokens (1/k each, the gate weights left out).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from moeinf.bench.common import emit, machine
from moeinf.policy import EvictionPolicy, make_eviction
from moeinf.policy.eviction import ActivationAwareEviction
from moeinf.policy.fitted import (
    EvictionFit,
    FittedEviction,
    Setting,
    access_counts,
    fit_eviction,
    request_counts,
)
from moeinf.policy.simulate import Accesses, simulate
from moeinf.policy.synthetic import SyntheticModel

log = logging.getLogger(__name__)

POLICIES = ("fitted", "activation-aware", "lru", "lfu", "neighbor", "oracle")
"""`fitted`: the activation-aware family with its constants fitted per cache size on the EAMC side
(`moeinf.policy.fitted`); `activation-aware`: the fixed score."""
FRACTIONS = (0.05, 0.1, 0.2, 0.25, 0.45, 0.6)
QUICK_FRACTIONS = (0.05, 0.2, 0.45)
ABLATION_FRACTIONS = (0.1, 0.25)
ABLATION: dict[str, dict[str, Any]] = {
    "activation-aware": {},
    "-follow": {"follow": 0.0},
    "-distance": {"distance": False, "layer_weighted": False},
    "-recency": {"recency": 1.0},
    "-prior": {"prior_tokens": 0.0},
    "-follow-recency": {"follow": 0.0, "recency": 1.0},
    "-follow-distance-recency": {"follow": 0.0, "distance": False, "layer_weighted": False, "recency": 1.0},
    "paper": {"follow": 0.0, "distance": False, "recency": 1.0, "prior_tokens": None},
}
"""Activation-aware variants of `--ablation`: keyword arguments of `ActivationAwareEviction`. "paper" is
Algorithm 2 with the fitted collection prior and its (1 - l / L) layer term, as the runtime used it."""


@dataclass(frozen=True)
class Workload:
    """Routing traces to replay ([S, L, E] per sequence) and where they came from."""

    name: str
    """"synthetic" or the trace file path."""
    traces: list[np.ndarray]
    tasks: list[str]
    num_layers: int
    num_experts: int
    top_k: int
    details: dict[str, Any]


def load_workload(path: str | None, *, quick: bool, seed: int, top1: bool = False,
                  gate_weights: bool = False, command: str = "cache") -> Workload:
    """The traces of `path` (a raw routing trace, `moeinf.trace.rawtrace`, .jsonl or .jsonl.gz), or a
    synthetic workload. `top1`: keep one expert per token and layer (`top1_counts`). `gate_weights`: a
    token counts k x its gate weight (`RawTrace.step_counts`; top-1: its gate weight, in units of the
    mean weight, `scale_weights`). A file that cannot be read ends the benchmark with a one-line error
    (naming `moeinf bench COMMAND`)."""
    if path is not None:
        from moeinf.trace.rawtrace import RawTraceError, read_routed, read_step_counts

        traces: list[np.ndarray] = []
        tasks: list[str] = []
        top_k = 0
        try:
            if top1 or gate_weights:
                for routed in read_routed(path):
                    traces.append(top1_counts(routed, weighted=gate_weights) if top1
                                  else routed.step_counts(weighted=True))
                    tasks.append(routed.task)
                    top_k = 1 if top1 else routed.top_k
            else:
                for _, task, k, counts in read_step_counts(path):
                    traces.append(counts)
                    tasks.append(task)
                    top_k = k
        except RawTraceError as exc:
            raise SystemExit(f"moeinf bench {command}: error: {exc}") from None
        if not traces:
            raise SystemExit(f"moeinf bench {command}: error: {path} holds no request; record one with "
                             "`moeinf trace`")
        _, num_layers, num_experts = traces[0].shape
        details: dict[str, Any] = {"requests": len(traces)}
        if top1:
            details["top1_proxy"] = True
        if gate_weights:
            details["gate_weights"] = True
        return Workload(name=str(path), traces=traces, tasks=tasks, num_layers=num_layers,
                        num_experts=num_experts, top_k=top_k, details=details)
    model = synthetic_model(quick=quick, seed=seed)
    traces, synthetic_tasks = model.traces(12 if quick else 40, seed=seed + 1)
    return Workload(name="synthetic", traces=traces, tasks=[str(t) for t in synthetic_tasks],
                    num_layers=model.num_layers, num_experts=model.num_experts, top_k=model.top_k,
                    details={"synthetic": True, "sequences": len(traces), "num_tasks": model.num_tasks,
                             "reuse": model.reuse, "seed": seed})


def top1_counts(raw: Any, *, weighted: bool = False) -> np.ndarray:
    """[S, L, E] counts of a `RawTrace` (or its `Routed` tokens) with one expert per token and layer: the
    highest-gate one where the trace has gate weights, else the first listed (a top-1 stand-in for a model
    with the same routing, to test a policy on a top-1 access pattern). `weighted`: each token counts its
    gate weight instead of 1 (without weights: 1 in a `RawTrace`, 1/k as `read_routed` reads a file)."""
    from moeinf.trace.rawtrace import Routed

    routed = raw if isinstance(raw, Routed) else Routed.of(raw)
    counts = np.zeros((routed.num_steps, routed.num_layers, routed.num_experts), dtype=np.float32)
    if not routed.steps.size:
        return counts
    # every token is picked and counted at once: numpy calls per (step, layer) cost more than the rest of a
    # sweep
    ids, gates = routed.ids, routed.weights
    rows = np.arange(len(ids))
    pick = np.argmax(gates, axis=1)
    chosen = ids[rows, pick]
    value = gates[rows, pick] if weighted else np.ones(len(ids))
    kept = chosen >= 0
    np.add.at(counts, (routed.steps[kept], routed.layers[kept], chosen[kept]), np.maximum(value[kept], 1e-6))
    return counts


def scale_weights(traces: list[np.ndarray], history: np.ndarray) -> list[np.ndarray]:
    """Gate-weighted counts in units of the mean weight of an access on the EAMC side (`history`), so that
    the score's prior, in tokens, keeps its meaning (k x the weights of a top-k token already sum to k)."""
    routed = np.concatenate([traces[i][traces[i] > 0] for i in history])
    mean = float(routed.mean()) if routed.size else 1.0
    return [trace / mean for trace in traces]


def synthetic_model(*, quick: bool, seed: int, num_experts: int | None = None, top_k: int | None = None,
                    num_layers: int | None = None) -> SyntheticModel:
    """The synthetic stand-in model of the policy benchmarks (quick: smaller)."""
    return SyntheticModel(num_layers=num_layers or (8 if quick else 16), num_experts=num_experts or
                          (32 if quick else 64), top_k=top_k or (2 if quick else 4), seed=seed)


VICTIM_SHAPE = (48, 128, 1536)
"""Layers, experts and cached experts of the victim-time measurement (a 30B-class MoE at 25% cache)."""


def victim_times(*, calls: int = 2000, seed: int = 0) -> dict[str, float]:
    """Median microseconds (wall, and `<name>_cpu`: this thread's CPU time) of one `victim` call per
    runtime policy, as the runtime asks it: 48 layers x 128 experts, 1,536 resident, 8 keys of the
    current layer protected, a running EAM."""
    from moeinf.policy import EvictionContext

    num_layers, num_experts, cached = VICTIM_SHAPE
    rng = np.random.default_rng(seed)
    times: dict[str, float] = {}
    for name in ("fitted", "activation-aware", "lru", "lfu", "neighbor"):
        if name == "fitted":
            # the costliest form of the family: the expected next-use distance, transitions on
            policy = FittedEviction(num_layers, num_experts, top_k=8)
            policy.use(Setting(shape=1.0, follow=0.5, carry=0.1))
        else:
            policy = make_eviction(name, num_layers, num_experts)
        resident = rng.choice(num_layers * num_experts, size=cached, replace=False)
        for index in resident:
            policy.on_insert(policy.key(index))
        for index in rng.choice(resident, size=4 * cached):
            policy.on_access(policy.key(index))
        eam = rng.poisson(0.5, size=(num_layers, num_experts)).astype(np.float32)  # [L, E]
        protected = frozenset(policy.key(index) for index in resident[:8])
        ctx = EvictionContext(cur_eam=eam, layer=int(resident[0]) // num_experts, protected=protected)
        policy.victim(ctx)  # warm-up (and, on a fresh install, the kernel's compilation)
        samples, cpu = [], []
        for _ in range(calls):
            start, start_cpu = time.perf_counter(), time.thread_time()
            policy.victim(ctx)
            samples.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
        times[name] = round(float(np.median(samples)) * 1e6, 2)
        # CPU time of this thread: what the call costs when the machine is shared (wall time includes waits)
        times[f"{name}_cpu"] = round(float(np.median(cpu)) * 1e6, 2)
        if isinstance(policy, ActivationAwareEviction):
            times["activation-aware_alpha"] = policy.alpha
    return times


def busiest_layer(traces: Sequence[np.ndarray]) -> int:
    """The most experts one layer visit needs at once: the smallest possible cache."""
    return max(int(np.count_nonzero(np.asarray(t), axis=2).max()) for t in traces)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a small workload and three cache sizes")
    parser.add_argument("--json", action="store_true", help='print {"results": [...]} instead of a table')
    parser.add_argument("--traces", metavar="FILE", help="raw routing trace (JSONL from `moeinf trace`); "
                        "default: a synthetic workload")
    parser.add_argument("--out", metavar="DIR", help="write cache.jsonl and cache.png here")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload and of the split")
    parser.add_argument("--eval-share", type=float, default=0.25,
                        help="share of the requests replayed; the others are the EAMC set (default 0.25)")
    parser.add_argument("--ablation", action="store_true",
                        help="also replay activation-aware with each part of its score taken out")
    parser.add_argument("--top1", action="store_true",
                        help="keep one expert per token and layer (the highest-gate one, else the first "
                        "listed): a top-1 proxy of the traced model")
    parser.add_argument("--gate-weights", action="store_true",
                        help="count each token k x its gate weight in the running sequence's counts "
                        "(a trace without weights holds 1/k: unchanged)")
    parser.add_argument("--victim-only", action="store_true",
                        help="only time the runtime's victim choice (48 x 128 experts, 1,536 cached)")


def split(count: int, eval_share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(evaluation, EAMC) request indices, each ascending: a seeded random `eval_share` of `count`."""
    if not 0 < eval_share < 1:
        raise SystemExit(f"moeinf bench cache: error: --eval-share must lie in (0, 1), got {eval_share}")
    order = np.random.default_rng(seed).permutation(count)
    cut = min(count - 1, max(1, round(count * eval_share)))
    return np.sort(order[:cut]), np.sort(order[cut:])


def run(args: argparse.Namespace) -> int:
    if args.gate_weights and args.traces is None:
        raise SystemExit("moeinf bench cache: error: --gate-weights needs --traces FILE (the synthetic "
                         "workload has no gate weights)")
    layers, experts, cached = VICTIM_SHAPE
    victim = {"bench": "cache-victim", "num_layers": layers, "num_experts": experts, "cached": cached,
              "median_us": victim_times(seed=args.seed), "machine": machine()}
    if args.victim_only:
        print(json.dumps(victim))
        return 0
    started, cpu_started = time.perf_counter(), time.process_time()  # the sweep, reading the trace included
    workload = load_workload(args.traces, quick=args.quick, seed=args.seed, top1=args.top1,
                             gate_weights=args.gate_weights)
    total = workload.num_layers * workload.num_experts
    evaluation, history = split(len(workload.traces), args.eval_share, args.seed)
    if args.gate_weights and args.top1:
        workload = replace(workload, traces=scale_weights(workload.traces, history))
    replayed = [workload.traces[i] for i in evaluation]
    counts = access_counts([workload.traces[i] for i in history])
    firsts = request_counts([workload.traces[i] for i in history])
    smallest = busiest_layer(replayed)
    accesses = Accesses.of(replayed)
    capacities = [max(smallest, round(f * total)) for f in (QUICK_FRACTIONS if args.quick else FRACTIONS)]
    # the fitted policy sees the EAMC side only, as `moeinf trace` would have traced it
    fit_started, fit_cpu_started = time.perf_counter(), time.process_time()
    fit = fit_eviction([workload.traces[i] for i in history], capacities=capacities, seed=args.seed)
    fit_seconds, fit_cpu = time.perf_counter() - fit_started, time.process_time() - fit_cpu_started
    def sweep_row(job: tuple[int, str]) -> dict[str, Any]:
        capacity, name = job
        # demand fetches only: no prefetcher covers any layer (see ActivationAwareEviction)
        policy = make_policy(name, workload, fit, capacity)
        return replay_row(name, accesses, capacity, total, policy, counts, firsts)

    # The replays are independent and the compiled replay releases the GIL: threads run them on every
    # core, sharing the accesses (processes would copy them), in the table's order.
    jobs = [(capacity, name) for capacity in capacities for name in POLICIES]
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        results: list[dict[str, Any]] = list(pool.map(sweep_row, jobs))
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    if args.ablation:
        for fraction in ABLATION_FRACTIONS:
            capacity = max(smallest, round(fraction * total))
            for variant, kwargs in ABLATION.items():
                policy = ActivationAwareEviction(workload.num_layers, workload.num_experts, **kwargs)
                row = replay_row(variant, accesses, capacity, total, policy, counts, firsts)
                results.append({**row, "ablation": True})
    header = {"bench": "cache", "workload": workload.name, "victim_us": victim["median_us"],
              "num_layers": workload.num_layers,
              "num_experts": workload.num_experts, "top_k": workload.top_k, **workload.details,
              "evaluation_requests": len(evaluation), "eamc_requests": len(history),
              "eval_share": args.eval_share, "seed": args.seed, "accesses": int(accesses.keys.size),
              "seconds": round(seconds, 2), "cpu_seconds": round(cpu_seconds, 2),
              "fit_seconds": round(fit_seconds, 2), "fit_cpu_seconds": round(fit_cpu, 2),
              "fit": fit.to_json(), "machine": machine()}
    emit("cache", results, header, out=args.out, as_json=args.json, plot=plot, table=table)
    return 0


def make_policy(name: str, workload: Workload, fit: EvictionFit, capacity: int) -> EvictionPolicy:
    """A fresh policy of the sweep; `fitted` with the row of `fit` for `capacity`."""
    if name == "fitted":
        policy = FittedEviction(workload.num_layers, workload.num_experts, fit)
        policy.set_capacity(capacity)
        return policy
    return make_eviction(name, workload.num_layers, workload.num_experts, allow_oracle=True,
                         prefetching=False)


def replay_row(name: str, accesses: Accesses, capacity: int, total: int, policy: EvictionPolicy,
               counts: np.ndarray, firsts: np.ndarray) -> dict[str, Any]:
    """One replay as a result row; `counts` and `firsts` seed the policy (`simulate`)."""
    result = simulate(accesses, capacity, policy, counts=counts, firsts=firsts)
    log.info("%s at %d experts: hit ratio %.3f", name, capacity, result.hit_ratio)
    return {"policy": name, "cache_fraction": round(capacity / total, 4), "capacity": capacity,
            "hit_ratio": round(result.hit_ratio, 4), "hits": result.hits, "misses": result.misses}


def table(results: Sequence[dict[str, Any]], header: dict[str, Any]) -> str:
    """Hit ratio per cache fraction (rows) and policy (columns); `gain` = fitted minus the best of LRU and
    LFU, `wanted` = the smaller of 3 points and a third of that baseline's gap to the oracle, `vs fixed` =
    fitted minus activation-aware. Then the ablation, if run."""
    lines = [f"expert cache hit ratio, workload {header['workload']} (L={header['num_layers']}, "
             f"E={header['num_experts']}, top-{header['top_k']}), {header['evaluation_requests']} requests "
             f"replayed, counts seeded from {header['eamc_requests']}; fit {header['fit_seconds']} s "
             f"({header['fit_cpu_seconds']} s CPU), sweep {header['seconds']} s "
             f"({header['cpu_seconds']} s CPU)",
             "cache  " + "".join(f"{name:>18}" for name in POLICIES)
             + f"{'gain':>8}{'wanted':>8}{'vs fixed':>9}"]
    sweep = [row for row in results if not row.get("ablation")]
    for fraction in sorted({row["cache_fraction"] for row in sweep}):
        by_policy = {row["policy"]: row["hit_ratio"] for row in sweep if row["cache_fraction"] == fraction}
        baseline = max(by_policy["lru"], by_policy["lfu"])
        wanted = min(0.03, (by_policy["oracle"] - baseline) / 3)
        lines.append(f"{fraction:5.0%}  " + "".join(f"{by_policy[name]:>18.3f}" for name in POLICIES)
                     + f"{by_policy['fitted'] - baseline:>+8.3f}{wanted:>8.3f}"
                     + f"{by_policy['fitted'] - by_policy['activation-aware']:>+9.3f}")
    ablation = [row for row in results if row.get("ablation")]
    if ablation:
        lines.append("ablation of activation-aware (hit ratio):")
        for fraction in sorted({row["cache_fraction"] for row in ablation}):
            lines.append(f"{fraction:5.0%}  " + ", ".join(f"{row['policy']} {row['hit_ratio']:.3f}" for row in
                                                          ablation if row["cache_fraction"] == fraction))
    return "\n".join(lines)


def plot(path: Path, results: Sequence[dict[str, Any]], header: dict[str, Any]) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    for name in POLICIES:
        rows = [row for row in results if row["policy"] == name and not row.get("ablation")]
        axes.plot([100 * row["cache_fraction"] for row in rows], [row["hit_ratio"] for row in rows],
                  marker="o", label=name)
    axes.set_xlabel("cache size (% of all experts)")
    axes.set_ylabel("hit ratio")
    axes.set_title(f"expert cache, {header['workload']} workload")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
