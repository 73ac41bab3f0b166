"""Per-token decode time of one offloaded model, and where it goes: reads, expert compute, runtime, the rest.

The offloaded experts modules of the measured `MoE` instance get timing wrappers (on that instance only):
each expert kernel call is timed, and so is the offloader's whole MoE-layer call. At the end of every forward
pass a hook on the model snapshots those clocks and the runtime's read stall, so each decoded token (the gap
between the ends of consecutive passes: `generate`'s loop and one decode step) splits into

- reads: time the layer computation waited for expert reads (`stall_s`),
- expert compute: inside the expert kernels,
- runtime: the rest of the MoE-layer calls (grouping tokens by expert, EAMs, prefetch planning, cache),
- dense and framework: everything outside the MoE-layer calls (attention, norms, router, shared experts,
  the LM head, HF's module calls and `generate` loop).

Prefill is excluded: the steps measured are the gaps between consecutive decode steps. Each input decodes
exactly the tokens asked for, as llama.cpp's loop in `bench llamacpp` does: `generate` runs without an
end-of-sequence id rather than with `min_new_tokens`, and the clock is a forward hook rather than a logits
processor, so the loop runs no logits processor a user's greedy decode would not run (the two cost ~0.3-0.9
ms per token, `LogitsProcessorList` inspecting each processor's signature at every step).

Each part is also clocked in CPU time of the decoding thread (`time.thread_time`; torch runs its ops on
that thread at one intra-op thread): `cpu_parts_ms` (expert compute, runtime, dense and framework; a
read stall costs no CPU). On a shared machine wall time stretches with the load while CPU time stays
near the work done, so the CPU split is where the time goes, and the wall split what a user waited for.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.moe import ExpertKernel
from ..runtime.experts import OffloadedExperts

PARTS = ("reads", "expert_compute", "runtime", "dense_and_framework")
CPU_PARTS = ("expert_compute", "runtime", "dense_and_framework")


@dataclass
class Clocks:
    """Seconds (wall and CPU time of the calling thread) accumulated inside expert kernels and inside
    MoE-layer calls."""

    kernel_s: float = 0.0
    layer_s: float = 0.0
    kernel_cpu_s: float = 0.0
    layer_cpu_s: float = 0.0


@dataclass(frozen=True)
class TimedKernel(ExpertKernel):
    """An expert kernel whose calls add their duration to `clocks.kernel_s`."""

    inner: ExpertKernel
    clocks: Clocks

    @property
    def stable(self) -> bool:  # type: ignore[override]
        return self.inner.stable

    def __call__(self, x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        start, cpu = time.perf_counter(), time.thread_time()
        out = self.inner(x, tensors)
        self._count(start, cpu)
        return out

    # The inner kernel's several-experts calls, timed too: without them the runtime would take the
    # one-expert-at-a-time path, and the benchmark would measure what no user runs.
    def many(self, x: torch.Tensor, tensors: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor | None:
        start, cpu = time.perf_counter(), time.thread_time()
        out = self.inner.many(x, tensors)
        self._count(start, cpu)
        return out

    def rows_into(self, x: torch.Tensor, tensors: Sequence[dict[str, torch.Tensor]], slots: Sequence[int],
                  weights: torch.Tensor, buffer: Callable[[torch.dtype, int], torch.Tensor]) -> bool:
        start, cpu = time.perf_counter(), time.thread_time()
        done = self.inner.rows_into(x, tensors, slots, weights, buffer)
        self._count(start, cpu)
        return done

    def _count(self, start: float, cpu: float) -> None:
        self.clocks.kernel_s += time.perf_counter() - start
        self.clocks.kernel_cpu_s += time.thread_time() - cpu


class TimedLayer:
    """Wraps an offloader's `run_layer` (set on that offloader instance) to add to `clocks.layer_s`."""

    def __init__(self, inner: Callable[..., torch.Tensor], clocks: Clocks) -> None:
        self.inner = inner
        self.clocks = clocks

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        start, cpu = time.perf_counter(), time.thread_time()
        out = self.inner(*args, **kwargs)
        self.clocks.layer_s += time.perf_counter() - start
        self.clocks.layer_cpu_s += time.thread_time() - cpu
        return out


@dataclass
class StepRecorder:
    """A forward hook (it changes no output) snapshotting the clocks at the end of every forward pass."""

    clocks: Clocks
    stall: Callable[[], float]
    """The runtime's read stall so far, in seconds."""
    snapshots: list[tuple[float, ...]] = field(default_factory=list)

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        clocks = self.clocks
        self.snapshots.append((time.perf_counter(), self.stall(), clocks.kernel_s, clocks.layer_s,
                               time.thread_time(), clocks.kernel_cpu_s, clocks.layer_cpu_s))

    def steps(self) -> list[dict[str, float]]:
        """Each decode step's seconds: total and the four parts, and the CPU time of the three that use it."""
        out = []
        for before, after in zip(self.snapshots, self.snapshots[1:], strict=False):
            total, stall, kernel, layer, cpu, kernel_cpu, layer_cpu = (b - a for a, b in zip(before, after,
                                                                                              strict=True))
            out.append({"total": total, "reads": stall, "expert_compute": kernel,
                        "runtime": layer - kernel - stall, "dense_and_framework": total - layer,
                        "cpu_total": cpu, "cpu_expert_compute": kernel_cpu,
                        "cpu_runtime": layer_cpu - kernel_cpu, "cpu_dense_and_framework": cpu - layer_cpu})
        return out


def instrument(moe: Any) -> Clocks:
    """Install the timing wrappers on `moe`'s experts modules and offloader (this instance only)."""
    clocks = Clocks()
    offloaders = set()
    for module in moe.model.modules():
        if isinstance(module, OffloadedExperts):
            module.kernel = TimedKernel(module.kernel, clocks)
            offloaders.add(module.offloader)
    for offloader in offloaders:
        offloader.run_layer = TimedLayer(offloader.run_layer, clocks)
    return clocks


def decode(moe: Any, clocks: Clocks, inputs: Sequence[torch.Tensor],
           new_tokens: int) -> tuple[list[dict[str, float]], list[list[int]]]:
    """Greedy-decode each input with `moe`; every decode step's time and parts, and each input's tokens."""
    steps: list[dict[str, float]] = []
    tokens: list[list[int]] = []
    for ids in inputs:
        recorder = StepRecorder(clocks, lambda: float(moe.stats()["stall_s"]))
        handle = moe.model.register_forward_hook(recorder)
        try:
            out = moe.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               eos_token_id=None, do_sample=False)
        finally:
            handle.remove()
        steps.extend(recorder.steps())
        tokens.append(out[0, ids.shape[1]:].tolist())
    return steps, tokens


def summarize(steps: list[dict[str, float]]) -> dict[str, Any]:
    """Median ms per token, and the mean ms of each part per token (means add up to the mean total), in
    wall time and in CPU time of the decoding thread."""
    return {"median_ms": statistics.median(s["total"] for s in steps) * 1e3,
            "mean_ms": statistics.mean(s["total"] for s in steps) * 1e3,
            "parts_ms": {part: statistics.mean(s[part] for s in steps) * 1e3 for part in PARTS},
            "median_cpu_ms": statistics.median(s["cpu_total"] for s in steps) * 1e3,
            "cpu_parts_ms": {part: statistics.mean(s[f"cpu_{part}"] for s in steps) * 1e3
                             for part in CPU_PARTS},
            "steps": len(steps)}


def profile_decode(model_dir: Any, config: Any, warm: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                   new_tokens: int) -> dict[str, Any]:
    """Open `model_dir` offloaded with `config`, warm up on `warm`, then decode `inputs`: the summary, the
    runtime's stats of the measured decodes, the store's expert bytes and slot size, and the greedy tokens
    of each measured input."""
    with decoder(model_dir, config, warm, new_tokens) as measure:
        return measure(inputs)


@contextmanager
def decoder(model_dir: Any, config: Any, warm: Sequence[torch.Tensor],
            new_tokens: int) -> Iterator[Callable[[Sequence[torch.Tensor]], dict[str, Any]]]:
    """`model_dir` offloaded with `config` and warmed up on `warm`, as a function that decodes inputs and
    returns what `profile_decode` does (the stats of that call's decodes only): rounds of measurement
    interleaved with another system's share one open model."""
    from moeinf import MoE

    with MoE(model_dir, config) as moe:
        clocks = instrument(moe)
        decode(moe, clocks, warm, new_tokens)

        def measure(inputs: Sequence[torch.Tensor]) -> dict[str, Any]:
            moe.reset_stats()
            steps, tokens = decode(moe, clocks, inputs, new_tokens)
            return {**summarize(steps), "stats": moe.stats(), "expert_bytes": moe.store.expert_bytes,
                    "slot_bytes": moe.store.max_blob_size, "tokens": tokens}

        yield measure
