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

from .config import ConfigError, OffloadConfig, parse_size, resolve_bytes
from .hf.integrate import ExpertsSite
from .hf.model import build_offloaded_model
from .kernels.bf16_rows import RowLinear, replace_linears
from .kernels.moe import ExpertKernel, GatedKernel
from .kernels.norms import replace_norms
from .kernels.quant_experts import quantised_kernel
from .kernels.quant_linear import quantise_dense, resolve_kernel
from .models.attention_linears import replace_attention_linears
from .models.attention_linears import resolve as resolve_attention
from .models.deepseek_v3.decode_body import flatten_decode_body
from .models.deepseek_v3.decode_exact import flatten_exact_layers
from .models.deepseek_v3.decode_layer import flatten_decode_layers
from .models.deepseek_v3.mla_decode import absorb_mla
from .models.deepseek_v3.router import replace_routers
from .models.gated_mlp import concat_gated_mlps
from .models.mla_expand import keep_expanded_kv
from .policy import make_eviction, make_prefetch, popularity
from .runtime.cache import ExpertCache
from .runtime.device import DeviceTier
from .runtime.experts import OffloadedExperts, OffloadedSwitchExperts
from .runtime.lookahead import FirstLayerGuess, make_lookahead
from .runtime.offloader import Offloader
from .runtime.stats import RuntimeStats
from .runtime.tiers import HostTier, Tier
from .spec import ArchSpec, spec_for
from .store import Store, StoreError, pack
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


def compute_slots(config: OffloadConfig, store: Store) -> int:
    """Slots of the compute tier from `device_cache`; refuses fewer than top_k experts."""
    slot = store.max_blob_size
    total = len(store.index.experts)
    budget = resolve_bytes(config.device_cache, store.expert_bytes, field="device_cache")
    slots = min(budget // slot, total)
    top_k = store.index.top_k
    if slots < top_k:
        need = top_k * slot
        raise ConfigError(
            f"device_cache: {budget} bytes hold {slots} experts of {slot} bytes, but one token of one "
            "MoE layer "
            f"needs its top_k={top_k} experts resident together; set device_cache >= {need} bytes "
            f"(e.g. device_cache={need} or '{need / store.expert_bytes:.1%}' of "
            f"{store.expert_bytes} expert bytes)"
        )
    return slots


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


def make_engine(config: OffloadConfig, store: Store, slots: int) -> Any:
    from .engine import Engine

    chunk = parse_size(config.chunk_size, field="chunk_size")
    engine = Engine([str(store.path(i)) for i in range(len(store.index.files))], store.max_blob_size, slots,
                    io_threads=config.io_threads, chunk_bytes=int(chunk), direct_io=config.direct_io,
                    verify=config.verify_checksums)
    for e in store.index.experts:
        engine.add(e.layer, e.expert, e.file, e.offset, e.size, e.checksum)
    return engine


def make_tier(config: OffloadConfig, store: Store, engine: Any, slots: int) -> Tier:
    """The compute tier: the engine's pool itself, or a device tier fed from it (host_cache > 0, CUDA)."""
    host_slots = host_tier_slots(config, store)
    if host_slots == 0:
        return HostTier(engine, store, slots)
    device = torch.device(config.device)
    return DeviceTier(HostTier(engine, store, host_slots), store, slots, store.max_blob_size, device)


def host_tier_slots(config: OffloadConfig, store: Store) -> int:
    """Slots of the host staging tier (0 = none: the compute tier is the engine's pool)."""
    budget = resolve_bytes(config.host_cache, store.expert_bytes, field="host_cache")
    if budget == 0 and config.device == "cpu":
        return 0
    slots = min(budget // store.max_blob_size, len(store.index.experts))
    if slots < 1:
        raise ConfigError(f"host_cache: {budget} bytes hold no expert of {store.max_blob_size} bytes; "
                          "a device tier is fed through the host tier: "
                          f"set host_cache >= {store.max_blob_size}")
    return slots


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
    slots = compute_slots(config, store)
    predictor = load_predictor(config, store)
    stats = RuntimeStats()
    pop = popularity(predictor.current.eams) if predictor is not None else None
    prefetch = make_prefetch(config.prefetch, num_layers, num_experts, config.eps, top_k=store.index.top_k,
                             lookahead=config.prefetch_layers, popularity=pop,
                             min_probability=config.prefetch_min_probability, depth=config.lookahead_depth)
    lookahead = make_lookahead(config, store.fingerprint, num_layers, num_experts)
    eviction = make_eviction(config.eviction, num_layers, num_experts, config.eps,
                             prefetching=config.prefetch != "none")
    host_slots = host_tier_slots(config, store)
    engine = make_engine(config, store, host_slots or slots)
    sizes = {(e.layer, e.expert): e.size for e in store.index.experts}
    cache = ExpertCache(make_tier(config, store, engine, slots), eviction, stats, sizes.__getitem__,
                        float(engine.MAX_PRIORITY))
    offloader = Offloader(cache, prefetch, predictor, num_layers, num_experts, stats, top_k=store.index.top_k,
                          online_capacity=config.eamc_capacity, online_threshold=config.online_threshold,
                          online_rebuild_after=config.online_rebuild_after, lookahead=lookahead,
                          stack_max_bytes=config.stack_expert_max_bytes, hold_plan=config.prefetch_hold_plan,
                          plan_thread=config.prefetch_plan_thread)
    try:
        # a CPU cache of every expert never refills a slot: kernels may keep state per slot
        all_resident = config.device == "cpu" and slots == len(store.index.experts)
        row_kernel = config.bf16_row_kernel and config.device == "cpu"  # `bf16_rows` for exact products
        make = _experts_factory(spec, num_experts, offloader, store.index.quant if quant else None,
                                config.quant_expert_kernel, all_resident=all_resident,
                                activations=config.quant_activations,
                                row_kernel=row_kernel)
        model, sites = build_offloaded_model(store_dir, spec, store.load_dense(), make, dtype=config.dtype)
        if quant is not None:
            kernel = resolve_kernel(config.quant_dense_kernel)
            quantise_dense(model, spec.shared_experts_module, quant, config.quant_dense, kernel,
                           fuse=config.fast_dense_modules, activations=config.quant_activations)
        if config.fast_dense_modules:
            replace_routers(model, one_row_kernel=quant is not None)
            if quant is None and config.device == "cpu":
                concat_gated_mlps(model, row_kernel=row_kernel)
            if quant is not None or config.device == "cpu":
                replace_norms(model, exact=quant is None)  # exact: torch's rms_norm sums as HF on CPU
        if quant is not None and config.mla_absorb:
            absorb_mla(model)  # before the attention linears change: it copies kv_b_proj's exact weight
        replace_attention_linears(model, resolve_attention(config.attention_linears,
                                                           quantised=quant is not None))
        if quant is None or not config.mla_absorb:
            keep_expanded_kv(model, config.mla_expanded_max_bytes)  # absorbed decode steps expand nothing
        # one-row bf16 products at memory speed, torch's bits
        row_linears = quant is None and row_kernel and bool(replace_linears(model))
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
    if quant is not None and config.mla_absorb and config.fast_dense_modules:
        flatten_decode_layers(model)  # each layer binds its parts as they are at its first decoded row
    if quant is None and config.fast_dense_modules:
        flattened = flatten_exact_layers(model, kernel_step=row_linears)  # HF's ops, no module calls
        output = model.get_output_embeddings()
        if flattened and row_linears and isinstance(output, RowLinear):
            # between kernel steps a decoded row runs no torch op that opens an OpenMP region
            output.split_outside_step = True
    if config.fast_dense_modules:
        flatten_decode_body(model)
    hook = model.register_forward_pre_hook(_BatchHook(offloader, spec), with_kwargs=True)
    log.info("offloading %s: %d MoE layers x %d experts, %d slots of %d bytes", model_dir, num_layers,
             num_experts, slots, store.max_blob_size)
    runtime = Runtime(model, store, offloader, cache, stats, spec.task == "seq2seq-lm", hook)
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
        self.causal = spec.task == "causal-lm"

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
