"""The offloading runtime: tiers and residency, the offloaded experts forward, exact expert compute.

- `compute.py`: one expert's exact math (`GatedKernel`, `DenseActDenseKernel`), tokens grouped by expert.
- `tiers.py`, `device.py`: slots of expert blobs: the engine's host pool; a device tier fed by a copy thread.
- `cache.py`: `ExpertCache`, residency of one compute tier (demand fetches, prefetches, eviction by policy).
- `offloader.py`: per-sequence EAMs, prefetch planning, the layer loop (route -> EAM -> prefetch -> wait ->
  compute).
- `experts.py`: the modules that replace a model's experts modules.
- `builder.py`: assembles all of it for `moeinf.api.MoE`; `stats.py`: the counters.
"""
