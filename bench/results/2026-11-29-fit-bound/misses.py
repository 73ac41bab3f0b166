"""Where the misses are: replay one cell with the Python replay of moeinf/policy/simulate.py (the same
decisions as the compiled one), recording whether each access hit, and split the misses into an expert's
first use in its request and later uses. Policies: the fitted one (the fit row of `--fit-jsonl` for the
size), LFU, LRU and Belady, with the split of `moeinf bench cache`.

    python misses.py $SHARED/data/traces/dsv2lite-puffin-700.jsonl.gz --top1 --seed 0 --fraction 0.45 \
        --fit-jsonl ../2026-11-29-fitted3/dsv2lite-top1-seed0.jsonl
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from moeinf.bench.cache import access_counts, load_workload, make_policy, split
from moeinf.policy import simulate as sim
from moeinf.policy.fitted import EvictionFit


class Recording(sim._Replay):
    """The demand replay, noting before each visit which of its accesses are resident."""

    def run(self) -> None:
        self.hit = np.zeros(self.accesses.keys.size, dtype=bool)
        self.position = 0
        super().run()

    def _visit(self, step, layer, accessed, eam) -> None:
        for key in accessed:
            self.hit[self.position] = key in self.resident
            self.position += 1
        super()._visit(step, layer, accessed, eam)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces")
    parser.add_argument("--top1", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fraction", type=float, required=True)
    parser.add_argument("--fit-jsonl", required=True)
    args = parser.parse_args()
    workload = load_workload(args.traces, quick=False, seed=args.seed, top1=args.top1)
    evaluation, history = split(len(workload.traces), 0.25, args.seed)
    accesses = sim.Accesses.of([workload.traces[i] for i in evaluation])
    counts = access_counts([workload.traces[i] for i in history])
    fit = EvictionFit.from_json(json.loads(open(args.fit_jsonl).readline())["fit"])
    capacity = max(accesses.busiest, round(args.fraction * workload.num_layers * workload.num_experts))
    request = (np.cumsum(accesses.new_sequence) - 1)[np.repeat(np.arange(accesses.visit_layer.size),
                                                                np.diff(accesses.visit_start))]
    first = np.ones(accesses.keys.size, dtype=bool)
    last_request: dict[int, int] = {}
    for a, (key, req) in enumerate(zip(accesses.keys.tolist(), request.tolist(), strict=True)):
        first[a] = last_request.get(key) != req
        last_request[key] = req
    print("| policy | hit ratio | misses | at the expert's first use in its request | at a later use |")
    print("|---|---|---|---|---|")
    for name in ("fitted", "lfu", "lru", "oracle"):
        policy = make_policy(name, workload, fit, capacity)
        policy.reset(counts)
        replay = Recording(accesses, capacity, policy, None, None, math.inf, 1)
        replay.run()
        missed = ~replay.hit
        print(f"| {name} | {replay.hit.mean():.4f} | {missed.sum()} | {(missed & first).sum()} | "
              f"{(missed & ~first).sum()} |")


if __name__ == "__main__":
    main()
