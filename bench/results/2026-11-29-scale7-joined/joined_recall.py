"""Precision and recall of the expert transitions at the default floor (0.3), one layer against three.

    python joined_recall.py TRACE [--seed S]

A quarter of the trace's requests (by seed) are held out; the transitions are fit on the rest, as
`moeinf trace` fits them (one layer: depth 3; joined: depth 5, 3 layers). On the held-out requests'
decoded positions, every layer predicts the next 1-3 layers from its own routing and, joined, the
token's two layers before it; a prediction counts when its calibrated chance reaches 0.3.
"""

import argparse
import time

import numpy as np

from moeinf.bench.trace_routing import _traces, trace_positions
from moeinf.policy.lookahead import Transitions, _onehot

parser = argparse.ArgumentParser()
parser.add_argument("trace")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
requests = [(prefill, np.asarray(index)) for prefill, index, _ in map(trace_positions, _traces(args.trace))]
layers, k = requests[0][1].shape[1:]
experts = int(max(index.max() for _, index in requests)) + 1
held = set(np.random.default_rng(args.seed).permutation(len(requests))[: len(requests) // 4].tolist())
fit = [index for i, (_, index) in enumerate(requests) if i not in held]
for depth, sources in ((3, 1), (5, 3)):
    started = time.perf_counter()
    transitions = Transitions.fit(fit, layers, experts, depth, sources=sources)
    fit_s = time.perf_counter() - started
    hits, picked, truths = np.zeros(4), np.zeros(4), np.zeros(4)
    for i in sorted(held):
        prefill, index = requests[i]
        index = index[prefill:]
        if index.shape[0] == 0:
            continue
        onehot = _onehot(index, layers, experts)
        for layer in range(layers - 1):
            earlier = [index[:, layer - 1 - j] for j in range(min(2, layer))]
            chances = transitions.chances(layer, index[:, layer], earlier, ahead=3)
            for d in range(1, chances.shape[0] + 1):
                truth, pick = onehot[:, layer + d] > 0, chances[d - 1] >= 0.3
                hits[d] += (pick & truth).sum()
                picked[d] += pick.sum()
                truths[d] += truth.sum()
    print(f"{args.trace.rsplit('/', 1)[-1]} seed {args.seed} layers joined {sources} (depth {depth}, fit "
          f"{fit_s:.1f} s): " + ", ".join(f"{d} ahead P {hits[d] / picked[d]:.3f} R {hits[d] / truths[d]:.3f}"
                                       for d in (1, 2, 3)), flush=True)
