"""Residency: which experts are where, and the offloaded experts forward that waits for them.

- `tiers.py`, `device.py`, `copier.py`: slots of expert blobs: the engine's host pool; a device tier fed by
  a copy thread.
- `cache.py`: `ExpertCache`, residency of one compute tier (demand fetches, prefetches, eviction by policy).
- `offloader.py`: per-sequence EAMs, prefetch planning, the layer loop (route -> EAM -> prefetch -> wait ->
  compute, the compute being `moeinf.kernels.moe`'s).
- `lookahead.py`: next layers' experts guessed from this layer's router input, and the pace of reads.
- `experts.py`: the modules that replace a model's experts modules.
- `stats.py`: the counters.

The math lives below (`moeinf.kernels`), the per-architecture fast paths above (`moeinf.models`), and
`moeinf.builder` assembles all of it.
"""
