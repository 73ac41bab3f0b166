"""Choose a batch plan by predicting its tokens/s from a roofline of this machine (MoE-Lightning's HRM,
simplified to one CPU level and one drive).

A plan: batch size B, whether the expert reads of later layers are prefetched while this one computes
(`pipeline`: the offloader's prefetching; off = reads on demand), and the expert kernel (`grouped` or
`per_expert`, from the kernel table at the plan's tokens per expert). Per decode step of B rows:

    q[l, e]   = probability that a token routes to expert e of layer l (the EAMC's shares, else uniform)
    touched_l = sum_e 1 - (1 - q[l, e])^B                    distinct experts a step needs, per layer
    misses_l  = touched_l - hits_l: while a layer computes, the cache holds its touched experts; the other
                slots keep the most popular experts, and the slots misses take turn over every pass
    io_l      = misses_l x expert bytes / drive bandwidth (the runtime's reader, measured now)
    verify_l  = misses_l x expert bytes / checksum rate (the reader's CPU, taken from the compute thread
                where they share a core)
    experts_l = touched_l x kernel seconds per expert at B k / touched_l tokens per expert
    dense     = dense bytes / memory bandwidth + B x dense FLOPs / matmul rate + KV bytes read / memory bw
    cpu       = sum_l (experts_l + verify_l) + dense             one compute thread: nothing here overlaps
    step      = max(sum_l io_l, cpu) with the pipeline; without it each layer's reads start with the
                layer: dense + sum_l max(io_l + one expert, experts_l + verify_l)

The prefill passes are the same over the tokens of `join` prompts each (the whole batch, or a quarter),
padded to the longest of them (the workload's prompt lengths, in run order), and yield each row's first
token. A batch costs its prefills + (N - 1) steps (context growing); the job costs its batches. Memory
bounds B: the KV cache of B rows at full length must fit beside the expert cache and the dense weights
in the memory available. Predictions are checked against runs by `moeinf bench batch-throughput`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import kernels, roofline

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MEMORY_SHARE = 0.5
"""The KV cache of a plan may take at most this share of the memory available beside the expert cache
and the dense weights (activations, the allocator and the page cache need the rest)."""


@dataclass(frozen=True)
class Workload:
    prompts: int
    prompt_tokens: float
    """Mean prompt length in tokens."""
    new_tokens: int
    lengths: tuple[int, ...] = ()
    """Each prompt's tokens, in the order batches take them (empty: every prompt `prompt_tokens` long). A
    prefill pass pads its prompts to the longest, and padding costs as much as a real token."""

    def batches(self, size: int) -> list[list[float]]:
        """The prompt lengths of each batch of `size` prompts, in order."""
        lengths = list(self.lengths) or [self.prompt_tokens] * self.prompts
        return [lengths[i:i + size] for i in range(0, len(lengths), size)]


@dataclass(frozen=True)
class ModelFacts:
    """What the roofline needs of a model and its store."""

    layers: int
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    expert_bytes: int
    """Bytes one expert takes in memory (the store's slot size)."""
    dense_bytes: int
    compute_dtype: str
    kv_bytes_per_token: int
    cache_experts: int
    """Experts the compute tier holds (device_cache / expert bytes)."""
    popularity: np.ndarray = field(repr=False)
    """[L, E] probability that one token routes to each expert (rows sum to top_k)."""
    read_bytes: int = 0
    """Bytes one expert read moves from the drive and checks (a coded store's: about 3/4 of
    `expert_bytes`); 0: `expert_bytes`."""

    @property
    def bytes_per_read(self) -> int:
        return self.read_bytes or self.expert_bytes


@dataclass(frozen=True)
class Plan:
    batch_size: int
    pipeline: bool
    kernel: str
    predicted_tokens_per_s: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)
    fits: bool = True
    prefetch: str = "hybrid"
    """The prefetch policy a pipelined plan runs (the configured one)."""
    expert_bytes: int = 0
    join: int = 0
    """Prompts per prefill pass (0: the whole batch). A pass pads its prompts to the longest of them and
    padding costs as much as a real token (smaller passes pad less); each pass reads the experts it routes
    to again (a prefill of a few prompts routes to most experts of every layer)."""

    @property
    def join_rows(self) -> int:
        return self.join or self.batch_size

    def apply(self, config: Any) -> Any:
        """`config` (an OffloadConfig) with this plan's knobs."""
        return dataclasses.replace(
            config, prefetch=self.prefetch if self.pipeline else "none",
            stack_expert_max_bytes=self.expert_bytes if self.kernel == "grouped" else 0)


def facts(model_dir: Path, config: Any) -> ModelFacts:
    """ModelFacts of `model_dir` and its store (packed already) under `config`."""
    from transformers import AutoConfig

    from moeinf.builder import budget_of, store_plan
    from moeinf.store.index import StoreIndex

    store_dir, _quant = store_plan(model_dir, config)
    index = StoreIndex.load(store_dir)
    budget = budget_of(config, index)  # a percentage of the store's expert bytes, as the runtime reads it
    slot = budget.slot_bytes
    hf = AutoConfig.from_pretrained(str(model_dir))
    hidden = int(getattr(hf, "hidden_size", 0) or hf.d_model)
    tensors = index.experts[0].tensors
    down = tensors.get("down_proj") or next(iter(tensors.values()))
    intermediate = int(min(down.shape[-2:])) if len(down.shape) >= 2 else hidden
    dtype = config.dtype if config.dtype != "auto" else index.dtype
    dtype = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    dense = store_dir / index.dense
    popularity = _popularity(config, index.num_layers, index.num_experts, index.top_k)
    return ModelFacts(
        layers=index.num_layers, experts=index.num_experts, top_k=index.top_k, hidden=hidden,
        intermediate=intermediate, expert_bytes=slot,
        read_bytes=round(sum(e.size for e in index.experts) / len(index.experts)),
        dense_bytes=dense.stat().st_size if dense.is_file() else 0,
        compute_dtype=dtype, kv_bytes_per_token=_kv_bytes(hf, dtype),
        cache_experts=budget.slots, popularity=popularity)


def _kv_bytes(hf: Any, dtype: str) -> int:
    layers = int(getattr(hf, "num_hidden_layers", 0) or getattr(hf, "num_layers", 1))
    heads = int(getattr(hf, "num_attention_heads", 0) or getattr(hf, "num_heads", 1))
    kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
    hidden = int(getattr(hf, "hidden_size", 0) or getattr(hf, "d_model", 0))
    key = int(getattr(hf, "qk_head_dim", None) or getattr(hf, "head_dim", None) or hidden // heads)
    value = int(getattr(hf, "v_head_dim", None) or key)
    size = 4 if dtype == "float32" else 2
    return layers * kv_heads * (key + value) * size


def _popularity(config: Any, layers: int, experts: int, top_k: int) -> np.ndarray:
    if config.eamc:
        from moeinf.trace.eamc import EAMC

        eams = EAMC.load(config.eamc).eams.astype(np.float64)  # [P, L, E]
        if eams.shape[1:] == (layers, experts):
            counts = eams.sum(axis=0) + 1e-3  # [L, E]
            return top_k * counts / counts.sum(axis=1, keepdims=True)
    return np.full((layers, experts), top_k / experts)


def _touched(q: np.ndarray, tokens: float) -> np.ndarray:
    """[L, E] probability that an expert is needed by `tokens` tokens (independent routing)."""
    return 1.0 - np.power(1.0 - np.clip(q, 0.0, 1.0), tokens)


def _hits(f: ModelFacts, touched: np.ndarray, pipeline: bool = False) -> np.ndarray:
    """[L] expected experts of a pass found resident, per layer. While a layer computes, the cache holds
    its touched experts (with the pipeline, the next layer's prefetched experts too); the slots left keep
    the most popular experts across passes (what the frequency-aware eviction keeps), and the slots the
    misses take turn over every pass, holding experts of other layers at random."""
    per_layer = touched.sum(axis=1)
    layers, experts = touched.shape
    busy = math.ceil(float(per_layer.max(initial=0.0))) * (2 if pipeline else 1)
    keep = int(max(f.cache_experts - busy, 0))
    churn = f.cache_experts - keep
    order = np.argsort(-f.popularity.ravel(), kind="stable")
    kept = np.zeros(layers * experts, dtype=bool)
    kept[order[:keep]] = True
    kept = kept.reshape(layers, experts)
    others = layers * experts - keep
    share = min(churn / others, 1.0) if others else 0.0
    return (touched * kept).sum(axis=1) + (touched * ~kept).sum(axis=1) * share


def pass_seconds(f: ModelFacts, rates: roofline.Rates, table: kernels.KernelTable, tokens: float,
                 context: float, rows: int, plan: Plan) -> dict[str, float]:
    """The roofline of one forward pass of `tokens` tokens over `rows` rows at `context` positions.

    Per MoE layer l: `io_l` (its misses read at the drive's rate), `experts_l` (its touched experts
    computed, each at its tokens per expert, from the kernel table), `verify_l` (the reader's checksums
    of those reads: CPU the compute thread loses where they share a core) and the dense share. The
    reader overlaps the drive with the CPU; the CPU work does not overlap itself (one compute thread).
    Without the pipeline a layer's reads start when the layer does (demand reads, whose experts compute
    in waves as they land): `dense_l + max(io_l + one expert, experts_l + verify_l)` per layer. With it
    the reads of later layers run while earlier layers compute: `max(io, cpu)` for the pass."""
    touched = _touched(f.popularity, tokens)  # [L, E]
    per_layer = touched.sum(axis=1)  # [L]
    misses = np.maximum(per_layer - _hits(f, touched, plan.pipeline), 0.0)  # [L]
    io = misses * f.bytes_per_read / rates.drive_bps
    verify = misses * f.bytes_per_read / rates.verify_bps
    experts = np.array([d * table.seconds(tokens * f.top_k / d, plan.kernel) if d > 0 else 0.0
                        for d in per_layer])
    one = np.array([table.seconds(tokens * f.top_k / d, plan.kernel) if d > 0 else 0.0 for d in per_layer])
    dense_flops = 2 * f.dense_bytes / (4 if f.compute_dtype == "float32" else 2)
    if tokens > rows and rates.prefill_token_s is not None:  # a prefill pass, with its measured rate
        t_dense = tokens * rates.prefill_token_s
    else:
        t_dense = (f.dense_bytes / rates.memory_bps + tokens * dense_flops / rates.matmul_flops
                   + rows * context * f.kv_bytes_per_token / rates.memory_bps)
    cpu = float(experts.sum() + verify.sum()) + t_dense
    if plan.pipeline:
        total = max(float(io.sum()), cpu)
    else:
        total = t_dense + float(np.maximum(io + np.where(misses > 0, one, 0.0), experts + verify).sum())
    return {"io_s": float(io.sum()), "experts_s": float(experts.sum()), "verify_s": float(verify.sum()),
            "dense_s": t_dense, "seconds": total, "misses": float(misses.sum()),
            "touched_per_layer": float(per_layer.mean())}


def batch_seconds(f: ModelFacts, rates: roofline.Rates, table: kernels.KernelTable, w: Workload,
                  lengths: Sequence[float], plan: Plan) -> dict[str, float]:
    """One batch of prompts of `lengths` tokens: prefill passes of `plan.join_rows` prompts each, padded
    to their longest (each yields its rows' first tokens), then new_tokens - 1 decode steps of all the
    rows at a context growing from the prompt."""
    rows = len(lengths)
    per_join = plan.join_rows
    prefill_s = 0.0
    for first in range(0, rows, per_join):
        group = lengths[first:first + per_join]
        width = max(group)
        prefill_s += pass_seconds(f, rates, table, len(group) * width, width, len(group), plan)["seconds"]
    prompt = sum(lengths) / rows
    step = pass_seconds(f, rates, table, rows, prompt + w.new_tokens / 2, rows, plan)
    steps = max(w.new_tokens - 1, 0)
    return {"prefill_s": prefill_s, "step_s": step["seconds"], "step_io_s": step["io_s"],
            "step_experts_s": step["experts_s"], "step_verify_s": step["verify_s"],
            "step_dense_s": step["dense_s"], "step_misses": step["misses"],
            "step_touched_per_layer": step["touched_per_layer"],
            "seconds": prefill_s + steps * step["seconds"]}


def predict(f: ModelFacts, rates: roofline.Rates, table: kernels.KernelTable, w: Workload,
            plan: Plan, kv_budget: float) -> Plan:
    """`plan` with its predicted tokens/s, breakdown and whether its KV cache fits in `kv_budget` bytes."""
    b = min(plan.batch_size, w.prompts)
    parts = [batch_seconds(f, rates, table, w, lengths, plan) for lengths in w.batches(b)]
    seconds = sum(p["seconds"] for p in parts)
    one = parts[0]
    kv = b * (w.prompt_tokens * 1.5 + w.new_tokens) * f.kv_bytes_per_token  # 1.5: padding to the longest
    breakdown = {**{k: round(v, 6) for k, v in one.items()}, "kv_bytes": kv,
                 "job_prefill_s": round(sum(p["prefill_s"] for p in parts), 3),
                 "job_decode_s": round(sum(p["seconds"] - p["prefill_s"] for p in parts), 3)}
    return dataclasses.replace(plan, predicted_tokens_per_s=w.prompts * w.new_tokens / seconds,
                               breakdown=breakdown, fits=kv <= kv_budget, expert_bytes=f.expert_bytes)


def candidates(f: ModelFacts, table: kernels.KernelTable, w: Workload, prefetch: str) -> list[Plan]:
    """Every batch size up to the job's prompts, with and without the pipeline; the kernel the table
    prefers at each batch size's tokens per expert in a decode step."""
    sizes = sorted({b for b in BATCH_SIZES if b <= w.prompts} | {min(w.prompts, BATCH_SIZES[-1])})
    plans = []
    for b in sizes:
        touched = float(_touched(f.popularity, b).sum(axis=1).mean())
        kernel = table.best(b * f.top_k / max(touched, 1e-9))
        for pipeline in (True, False):
            for join in sorted({0, b // 4} - {b} if b >= 4 else {0}):
                plans.append(Plan(b, pipeline, kernel, prefetch=prefetch if prefetch != "none" else "hybrid",
                                  join=join))
    return plans


def best_of(plans: Sequence[Plan], batch_size: int, pipeline: bool) -> Plan | None:
    """The fastest predicted of `plans` with this batch size and pipeline (over their joins)."""
    same = [p for p in plans if p.batch_size == batch_size and p.pipeline == pipeline]
    return max(same, key=lambda p: p.predicted_tokens_per_s) if same else None


def kv_budget(f: ModelFacts) -> float:
    import psutil

    available = psutil.virtual_memory().available
    return MEMORY_SHARE * max(available - f.cache_experts * f.expert_bytes - f.dense_bytes, 0)


@dataclass(frozen=True)
class Choice:
    """The chosen plan and every candidate, predicted."""

    plan: Plan
    plans: list[Plan]
    rates: roofline.Rates
    facts: ModelFacts
    table: kernels.KernelTable
    kv_budget: float

    def predict(self, w: Workload, plan: Plan) -> Plan:
        """`plan` predicted for another workload (e.g. the subset a benchmark measured)."""
        return predict(self.facts, self.rates, self.table, w, plan, self.kv_budget)

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def predicted_tokens_per_s(self) -> float:
        return self.plan.predicted_tokens_per_s

    def apply(self, config: Any) -> Any:
        return self.plan.apply(config)


PROBE_ROWS = 16
"""Prompts of the prefill probe."""
PROBE_REPEATS = 2
"""Timed passes of the prefill probe; the least is kept."""


def probe_prefill(moe: Any, rows: Sequence[Sequence[int]], pad_id: int, f: ModelFacts,
                  table: kernels.KernelTable, rates: roofline.Rates) -> tuple[float, np.ndarray]:
    """CPU seconds per token of a prefill pass besides its expert products and checksums: a padded
    prefill of `rows` (token lists) through `moe` (a `moeinf.MoE`, on the calling thread), timed, less
    the seconds it waited for reads (`stall_s`), the kernel table's seconds for the experts it computed
    (its `accesses`, at its tokens per expert) and the checksums of what it read; the least of
    `PROBE_REPEATS` passes (the least disturbed by other load on a shared machine). A two-row pass runs
    first, untimed (compiled kernels load on first use). The runtime's counters are reset after. Also
    returns the first pass's routing [L, E] (expert counts of its tokens): the job's measured popularity."""
    from moeinf.trace.router import RouterTracer

    from .runner import pad_batch

    best, routing = math.inf, None
    with torch.inference_mode():
        ids, mask = pad_batch(rows[:2], pad_id)
        moe(ids, attention_mask=mask, use_cache=True)
        ids, mask = pad_batch(rows, pad_id)
        tokens = ids.numel()
        for _ in range(PROBE_REPEATS):
            moe.reset_stats()
            with RouterTracer(moe.model) as tracer:
                tracer.reset()
                start = time.perf_counter()
                moe(ids, attention_mask=mask, use_cache=True)
                seconds = time.perf_counter() - start
                if routing is None:
                    routing = tracer.eams().sum(axis=0)
            stats = moe.stats()
            touched = float(stats["accesses"]) / f.layers  # experts computed per layer
            experts = f.layers * touched * table.seconds(tokens * f.top_k / max(touched, 1.0), "per_expert")
            verify = float(stats["bytes_read"]) / rates.verify_bps
            cpu = seconds - float(stats["stall_s"])
            best = min(best, max(cpu - experts - verify, 0.0) / tokens)
    moe.reset_stats()
    return best, routing


def choose(model_dir: str | Path, config: Any, w: Workload, *, batch_size: int | None = None,
           moe: Any = None, probe_rows: Sequence[Sequence[int]] = (), pad_id: int = 0) -> Choice:
    """Measure (first time) or load the machine's rates, predict every candidate and pick the fastest that
    fits; `batch_size` restricts the candidates to that size. The store must be packed. With `moe` (the
    loaded model) and `probe_rows` (token lists, `PROBE_ROWS` of the job's prompts), a prefill pass of
    them measures the prefill's own CPU rate (`probe_prefill`) on the model thread."""
    model_dir = Path(model_dir)
    f = facts(model_dir, config)
    from moeinf.builder import store_plan

    store_dir, _ = store_plan(model_dir, config)
    from .runner import on_model_thread

    directory = roofline.cache_dir()
    # measured where the runner computes: on a thread of its own (where torch's OpenMP threads spin, the
    # main thread ran torch's products markedly slower; with passive waits the two are alike)
    rates = on_model_thread(lambda: roofline.rates(
        store_dir, f.hidden, f.compute_dtype, directory, io_threads=config.io_threads,
        direct_io=config.direct_io, verify=config.verify_checksums))
    table = on_model_thread(lambda: kernels.lookup(f.hidden, f.intermediate, f.compute_dtype, directory))
    assert table is not None
    if moe is not None and probe_rows:
        rows = list(probe_rows)[:PROBE_ROWS]
        per_token, routing = on_model_thread(lambda: probe_prefill(moe, rows, pad_id, f, table, rates))
        rates = dataclasses.replace(rates, prefill_token_s=per_token)
        if not config.eamc and routing.shape == f.popularity.shape and routing.sum() > 0:
            counts = routing.astype(np.float64) + 1e-3  # the probe's routing stands for the job's
            f = dataclasses.replace(f, popularity=f.top_k * counts / counts.sum(axis=1, keepdims=True))
    budget = kv_budget(f)
    plans = [predict(f, rates, table, w, p, budget) for p in candidates(f, table, w, config.prefetch)]
    if batch_size is not None:
        b = min(batch_size, w.prompts)
        plans = [p for p in plans if p.batch_size == b] or [
            predict(f, rates, table, w, Plan(b, pipeline, table.best(b * f.top_k), prefetch=config.prefetch,
                                             join=join), budget)
            for pipeline in (True, False) for join in sorted({0, b // 4} - {b} if b >= 4 else {0})]
        plans = [dataclasses.replace(p, fits=True) for p in plans]  # the user's choice
    fitting = [p for p in plans if p.fits] or plans[:1]
    best = max(fitting, key=lambda p: p.predicted_tokens_per_s)
    return Choice(best, plans, rates, f, table, budget)


def summary(choice: Choice | Plan) -> str:
    p = choice.plan if isinstance(choice, Choice) else choice
    prefetch = p.prefetch if p.pipeline else "none"
    return (f"batch {p.batch_size}, prefill {p.join_rows} prompts per pass, pipeline "
            f"{'on' if p.pipeline else 'off'} ({prefetch}), {p.kernel} expert products, predicted "
            f"{p.predicted_tokens_per_s:.1f} tok/s")


def describe(choice: Choice) -> str:
    """The rates, the chosen plan and every candidate, as `--plan` prints them."""
    r, f = choice.rates, choice.facts
    lines = [
        f"machine: drive {r.drive_bps / 1e9:.2f} GB/s, memory {r.memory_bps / 1e9:.1f} GB/s, "
        f"matmul {r.matmul_flops / 1e9:.1f} GFLOP/s, checksums {r.verify_bps / 1e9:.1f} GB/s, prefill "
        + ("estimated" if r.prefill_token_s is None else f"{1e3 * r.prefill_token_s:.2f} ms/token measured")
        + f" ({roofline.cache_dir()})",
        f"model: {f.layers} MoE layers x {f.experts} experts (top {f.top_k}), "
        f"{f.expert_bytes / 2**20:.1f} MiB per expert, cache holds {f.cache_experts} of "
        f"{f.layers * f.experts}",
        f"chosen: {summary(choice.plan)}",
        "| batch | prefill prompts per pass | pipeline | kernel | predicted tok/s | prefill s | step ms "
        "(io / experts / checksums / dense) | fits memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in sorted(choice.plans, key=lambda p: (p.batch_size, not p.pipeline, p.join_rows)):
        b = p.breakdown
        lines.append(f"| {p.batch_size} | {p.join_rows} | {'on' if p.pipeline else 'off'} | {p.kernel} | "
                     f"{p.predicted_tokens_per_s:.1f} | {b['job_prefill_s']:.1f} | {1e3 * b['step_s']:.1f} "
                     f"({1e3 * b['step_io_s']:.1f} / "
                     f"{1e3 * b['step_experts_s']:.1f} / {1e3 * b['step_verify_s']:.1f} / "
                     f"{1e3 * b['step_dense_s']:.1f}) | "
                     f"{'yes' if p.fits else 'no'} |")
    return "\n".join(lines)


def to_json(choice: Choice) -> str:
    return json.dumps({"rates": roofline.as_dict(choice.rates),
                       "plan": {k: v for k, v in dataclasses.asdict(choice.plan).items()}})
