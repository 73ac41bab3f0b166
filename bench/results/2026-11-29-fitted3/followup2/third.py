"""Scratch: a stand-in trace with the third model's geometry (24 x 128, top-1, 387 requests, ~300 decode
steps each, gate weights), to time `moeinf bench cache --traces` on that shape."""
import numpy as np
from moeinf.policy.synthetic import SyntheticModel
from moeinf.trace.rawtrace import RawTrace, write_raw

model = SyntheticModel(num_layers=24, num_experts=128, top_k=1, num_tasks=8, working_set=12, reuse=0.9,
                       prompt_tokens=(20, 200), new_tokens=(100, 511), seed=3)
traces, tasks = model.traces(387, seed=4)
rng = np.random.default_rng(5)
out = []
for i, (t, task) in enumerate(zip(traces, tasks)):
    steps = []
    for s in range(t.shape[0]):
        step = {}
        for layer in range(24):
            ids = np.repeat(np.arange(128), t[s, layer]).reshape(-1, 1)
            rng.shuffle(ids)
            step[layer] = (ids, rng.uniform(0.3, 1.0, size=ids.shape).astype(np.float32))
        steps.append(step)
    out.append(RawTrace(f"r{i}", str(task), 24, 128, 1, steps))
write_raw("$WORK/third.jsonl", out)
print(sum(x.shape[0] for x in traces), "steps")
