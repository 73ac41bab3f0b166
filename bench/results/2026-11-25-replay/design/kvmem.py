"""Design only: KV cache bytes of continuous batching's running rows on the zoo model at 25%."""
import resource, torch
torch.set_num_threads(1)
from moeinf.commands import options
from moeinf.serve.loader import load_backend
from moeinf.serve.backend import SamplingParams
import argparse
model = "moeinf/zoo/weights/full"
p = argparse.ArgumentParser(); options.add_offload_arguments(p, no_offload=True)
args = p.parse_args(["--device-cache", "25%", "--prefetch", "hybrid", "--eviction", "activation-aware"])
backend = load_backend(model, None)  # the KV cache does not depend on offloading
batch = backend.open_batch()
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
for g in range(8):
    keys = list(range(8 * g, 8 * g + 8))
    batch.join(keys, [[5 + (i % 50)] * 408 for i in keys], [params] * 8)
for _ in range(46):
    batch.step()
layers = batch._layers(batch._cache)
kv = sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size() for l in layers)
print("rows", len(batch), "width", batch._mask.shape[1], "kv MiB", kv / 2**20,
      "per token KiB", kv / (len(batch) * batch._mask.shape[1]) / 1024,
      "maxrss MiB before/after", rss0 / 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
