"""Assemble one offloaded model: store, engine, tiers, policies, EAMC and the HF model.

Every refusal happens here, before any thread starts, and names the `OffloadConfig` field to change.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import models
from .config import Budget, ConfigError, OffloadConfig, parse_size
from .engine import Engine
from .hf.integrate import ExpertsSite
from .hf.model import build_offloaded_model
from .kernels.moe import ExpertKernel, GatedKernel
from .kernels.quant_experts import quantised_kernel
from .policy import make_eviction, make_prefetch, popularity
from .policy.fitted import load_fit_beside
from .runtime.cache import ExpertCache
from .runtime.device import DeviceTier
from .runtime.experts import OffloadedExperts, OffloadedSwitchExperts
from .runtime.lookahead import FirstLayerGuess, make_lookahead
from .runtime.offloader import Offloader
from .runtime.stats import RuntimeStats
from .runtime.tiers import HostTier, Tier
from .spec import ArchSpec, spec_for
from .store import Store, StoreError, pack
from .store.index import StoreIndex
from .store.quant import Quantization, check_runtime
from .store.quant import requested as requested_quantization
from .trace.eamc import EAMC
from .trace.online import OnlineEAMC

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """The parts of one offloaded model; `MoE` drives it under its lock."""

    model: nn.Module
    store: Store
    offloader: Offloader
    cache: ExpertCache
    stats: RuntimeStats
    seq2seq: bool
    hook: Any
    _base_reads: tuple[int, int] = (0, 0)
    next_token_hook: Any = None
    patches: tuple[str, ...] = ()
    """The model patches applied, in order (`moeinf.models`)."""
    """The output embeddings' forward hook that reads the next pass's first-layer experts (or None)."""

    def stats_dict(self) -> dict[str, object]:
        self.offloader.settle()
        out = self.stats.as_dict()
        tier = self.cache.tier
        if isinstance(tier, DeviceTier):
            # Two tiers: disk reads are the host tier's; the device tier counts copies.
            reads, read_bytes = self._base_reads
            out.update(reads=tier.disk_reads - reads, bytes_read=tier.bytes_read - read_bytes)
        if self.offloader.remote is not None:
            out["ep"] = self.offloader.remote.stats()
        return out

    def reset_stats(self) -> None:
        self.offloader.settle()
        if self.offloader.remote is not None:
            self.offloader.remote.reset()
        tier = self.cache.tier
        if isinstance(tier, DeviceTier):
            self._base_reads = (tier.disk_reads, tier.bytes_read)
        fresh = RuntimeStats()
        for name in vars(fresh):
            setattr(self.stats, name, getattr(fresh, name))

    def close(self) -> None:
        try:
            self.offloader.close()
        finally:
            self._close_rest()

    def _close_rest(self) -> None:
        if self.offloader.remote is not None:
            self.offloader.remote.close()
        self.hook.remove()
        if self.next_token_hook is not None:
            self.next_token_hook.remove()
        self.cache.clear()
        self.cache.tier.close()


def default_offload_dir(model_dir: Path, quant: str = "auto") -> Path:
    suffix = f"-{quant}" if quant in ("int8", "int4") else ""
    return model_dir.parent / f"{model_dir.name}.moeinf{suffix}"


def store_plan(model_dir: Path, config: OffloadConfig) -> tuple[Path, Quantization | None]:
    """Where the store of `model_dir` is, and how it is (to be) packed, per `offload_dir` and `quant`."""
    store_dir = (Path(config.offload_dir) if config.offload_dir
                 else default_offload_dir(model_dir, config.quant))
    return store_dir, requested_quantization(config.quant, store_dir)


def budget_of(config: OffloadConfig, store: Store | StoreIndex) -> Budget:
    """`config`'s memory sizes resolved against a store (or its index) by `Budget.resolve`: a percentage is
    a share of the store's expert bytes (`Store.expert_bytes`), a slot its largest blob."""
    index = store.index if isinstance(store, Store) else store
    sizes = [e.memory_size for e in index.experts]
    return Budget.resolve(config, expert_bytes=sum(sizes), slot_bytes=max(sizes), experts=len(sizes),
                          top_k=index.top_k)


def load_predictor(config: OffloadConfig, store: Store) -> OnlineEAMC | None:
    """The EAMC named by `config.eamc` (refusing another model's), wrapped for online adaptation."""
    if config.eamc is None:
        return None
    eamc = EAMC.load(config.eamc, fingerprint=store.fingerprint)
    expected = (store.index.num_layers, store.index.num_experts)
    if (eamc.num_layers, eamc.num_experts) != expected:
        raise ConfigError(f"eamc: {config.eamc} holds [{eamc.num_layers}, {eamc.num_experts}] EAMs but the "
                          f"model has {expected[0]} MoE layers of {expected[1]} experts; "
                          "re-run `moeinf trace`")
    return OnlineEAMC(eamc, config.online_threshold, config.online_rebuild_after,
                      capacity=config.eamc_capacity)


def make_engine(config: OffloadConfig, store: Store, budget: Budget) -> Engine:
    chunk = parse_size(config.chunk_size, field="chunk_size")
    return Engine.from_store(store, budget.engine_slots, io_threads=config.io_threads, chunk_bytes=int(chunk),
                             direct_io=config.direct_io, verify=config.verify_checksums)


def make_tier(config: OffloadConfig, store: Store, engine: Engine, budget: Budget) -> Tier:
    """The compute tier: the engine's pool itself, or a device tier fed from it (host_cache > 0, CUDA)."""
    if budget.host_slots == 0:
        return HostTier(engine, store, budget.slots)
    device = torch.device(config.device)
    return DeviceTier(HostTier(engine, store, budget.host_slots), store, budget.slots, store.max_blob_size,
                      device)


def build_runtime(model_dir: Path, config: OffloadConfig) -> Runtime:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model_dir: {model_dir} has no config.json; pass a HuggingFace model directory")
    store_dir, quant = store_plan(model_dir, config)
    pack(model_dir, store_dir, quant=quant, progress=False)
    store = Store(store_dir)
    quant = check_runtime(store.index.quant, store_dir)
    if store.index.dtype not in ("float32", "bfloat16", "float16"):
        raise StoreError(f"{store_dir} holds experts of dtype {store.index.dtype}; re-pack (offload_dir)")
    if config.dtype not in ("auto", store.index.dtype):
        raise ConfigError(f"dtype: the store holds {store.index.dtype} experts and compute runs in their "
                          f"dtype; set dtype='auto' (or '{store.index.dtype}')")
    spec = spec_for(store.index.model_type)
    num_layers, num_experts = store.index.num_layers, store.index.num_experts
    budget = budget_of(config, store)
    predictor = load_predictor(config, store)
    stats = RuntimeStats()
    pop = popularity(predictor.current.eams) if predictor is not None else None
    prefetch = make_prefetch(config.prefetch, num_layers, num_experts, config.eps, top_k=store.index.top_k,
                             lookahead=config.prefetch_layers, popularity=pop,
                             min_probability=config.prefetch_min_probability, depth=config.lookahead_depth)
    lookahead = make_lookahead(config, store.fingerprint, num_layers, num_experts)
    fit = load_fit_beside(config.eamc, num_layers, num_experts) if config.eviction == "fitted" else None
    eviction = make_eviction(config.eviction, num_layers, num_experts, config.eps,
                             prefetching=config.prefetch != "none", fit=fit, top_k=store.index.top_k)
    engine = make_engine(config, store, budget)
    sizes = {(e.layer, e.expert): e.size for e in store.index.experts}  # the bytes a read moves (stored)
    cache = ExpertCache(make_tier(config, store, engine, budget), eviction, stats, sizes.__getitem__,
                        float(engine.MAX_PRIORITY), window=budget.window)
    offloader = Offloader(cache, prefetch, predictor, stats, store.index, config, budget, lookahead)
    try:
        # a CPU cache of every expert never refills a slot: kernels may keep state per slot
        all_resident = config.device == "cpu" and budget.holds_all
        row_kernel = config.bf16_row_kernel and config.device == "cpu"  # `bf16_rows` for exact products
        make = _experts_factory(spec, num_experts, offloader, store.index.quant if quant else None,
                                config.quant_expert_kernel, all_resident=all_resident,
                                activations=config.quant_activations,
                                row_kernel=row_kernel)
        model, sites = build_offloaded_model(store_dir, spec, store.load_dense(), make, dtype=config.dtype)
        patches = models.patches_for(store.index.model_type)
        build = models.Build(config, spec, quant, row_kernel)
        applied = models.apply(model, patches, build, "modules")
    except BaseException:
        engine.close()
        raise
    if config.device != "cpu":
        model.to(config.device)  # dense weights only: the experts modules hold no parameters
    names = [site.name for site in sites]
    if names != list(store.index.modules):
        engine.close()
        raise StoreError(f"{store_dir} indexes experts modules {store.index.modules[:3]}... but the model "
                         "has "
                         f"{names[:3]}...; delete offload_dir and re-pack")
    next_token = config.lookahead_next_token
    bound = lookahead is not None and lookahead.bind(model, spec, names, next_token=next_token)
    if lookahead is not None and not bound and not lookahead.ready:
        if config.prefetch == "lookahead":
            engine.close()
            raise ConfigError(f"prefetch: 'lookahead' needs a learned predictor or routers that run alone, "
                              f"and {spec.family} models have no such router; train one with `moeinf trace "
                              "--lookahead-depth N` (lookahead_predictor) or use prefetch='hybrid'")
        log.info("prefetch hybrid: %s routers cannot run alone and no learned predictor is given; planning "
                 "from the sequence and matched EAMs and the collection prior only", spec.family)
    applied += models.apply(model, patches, build, "forwards")  # every module final, hooks bound
    hook = model.register_forward_pre_hook(_BatchHook(offloader, spec), with_kwargs=True)
    log.info("offloading %s: %d MoE layers x %d experts, %d slots of %d bytes", model_dir, num_layers,
             num_experts, budget.slots, store.max_blob_size)
    runtime = Runtime(model, store, offloader, cache, stats, spec.task == "seq2seq-lm", hook,
                      patches=tuple(applied))
    output = model.get_output_embeddings()
    if lookahead is not None and lookahead.first_layer is not None and output is not None:
        hook_next = _NextTokenHook(offloader, lookahead.first_layer)
        runtime.next_token_hook = output.register_forward_hook(hook_next)
    return runtime


def _experts_factory(spec: ArchSpec, num_experts: int, offloader: Offloader, quant: dict[str, Any] | None,
                     expert_kernel: str = "weight-only", *, all_resident: bool = False,
                     activations: str = "auto", row_kernel: bool = False):
    """`quant`: the store's quantisation record (None: exact experts); `expert_kernel`:
    `OffloadConfig.quant_expert_kernel`; `all_resident`: the CPU cache holds every expert; `activations`:
    `OffloadConfig.quant_activations`; `row_kernel`: exact gated experts' one-row products by `bf16_rows`."""
    cls = OffloadedSwitchExperts if spec.adapter == "switch" else OffloadedExperts

    def make(site: ExpertsSite, kernel: ExpertKernel) -> nn.Module:
        if quant is not None:
            kernel = quantised_kernel(kernel, Quantization.from_json(quant), quant["shapes"], expert_kernel,
                                      all_resident=all_resident, activations=activations)
        elif row_kernel and isinstance(kernel, GatedKernel):
            kernel = dataclasses.replace(kernel, row_kernel=True)
        return cls(site.layer, num_experts, kernel, offloader)

    return make


class _BatchHook:
    """Forward pre-hook of the model instance: tells the offloader which tokens of each pass are padding."""

    def __init__(self, offloader: Offloader, spec: ArchSpec) -> None:
        self.offloader = offloader
        self.causal = spec.task != "seq2seq-lm"

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.offloader.stats.forward_passes += 1
        mask = kwargs.get("attention_mask") if self.causal else None
        self.offloader.set_token_mask(mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None)


class _NextTokenHook:
    """Forward hook of the model instance's output embeddings: the logits name the next token, whose
    experts in the first MoE layers the offloader starts reading before the next forward pass begins."""

    def __init__(self, offloader: Offloader, guess: FirstLayerGuess) -> None:
        self.offloader = offloader
        self.guess = guess

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if isinstance(output, torch.Tensor) and output.dim() == 3 and self.offloader.takes_guesses():
            self.offloader.guess_next_pass(self.guess.layers(output.detach()))
