"""Every knob of moeinf in one frozen, validated dataclass.

The CLI and the server turn flags and JSON into an `OffloadConfig` at the edge; components receive it
through their constructors. Its fields are flat (`OffloadConfig(device_cache="25%", eamc=...)`) and each
belongs to one section of `SECTIONS` (cache, prefetch, io, kernels, parallel).

Sizes are given as bytes (int), strings such as "4GiB" / "512MB", percentages ("25%") or fractions (a
float in [0, 1]). A percentage or fraction is a share of the store's expert bytes (`Store.expert_bytes`:
every expert blob as packed, so a quantised store's quantised bytes), the same in the API, every command
and every benchmark. `Budget.resolve` turns the memory sizes into slots once the store is known; nothing
else resolves them.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PREFETCH_POLICIES = ("hybrid", "lookahead", "activation-aware", "topk", "traced-topk", "none")
EVICTION_POLICIES = ("activation-aware", "fitted", "lru", "lfu", "neighbor")
DEVICES = ("cpu", "cuda")
QUANT_SETTINGS = ("auto", "none", "int8", "int4")
QUANT_DENSE = ("none", "shared-experts", "shared-experts+lm-head")
ATTENTION_LINEARS = ("auto", "model", "float32", "int8")
QUANT_DENSE_KERNELS = ("auto", "weight-only", "int8", "dynamic-int8")
QUANT_EXPERT_KERNELS = ("auto", "weight-only", "dynamic-int8", "prepacked-int8", "gemv")
QUANT_ACTIVATIONS = ("auto", "float", "int8")
EP_PLACEMENTS = ("balanced", "round-robin")

Size = int | float | str

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and how to fix it."""


def parse_size(value: Size, *, field: str = "size") -> int | float:
    """Parse a size: returns bytes (int) or a fraction of the total expert bytes (float in (0, 1])."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a size such as '4GiB', 1073741824 or 0.25, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field}: a size cannot be negative (got {value})")
        return value
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(
                f"{field}: a float is a fraction of the total expert bytes and must lie in [0, 1] "
                f"(got {value}); "
                "give bytes as an int or a string such as '4GiB'"
            )
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("%"):
            try:
                pct = float(text[:-1])
            except ValueError:
                raise ConfigError(f"{field}: cannot parse percentage {value!r}") from None
            if not 0.0 <= pct <= 100.0:
                raise ConfigError(f"{field}: a percentage of the expert bytes must lie in 0-100%, "
                                  f"got {value!r}")
            return parse_size(pct / 100.0, field=field)
        m = _SIZE_RE.match(text)
        if not m or m.group(2).upper() not in _UNITS:
            raise ConfigError(
                f"{field}: cannot parse size {value!r}; use e.g. '4GiB', '512MB', '25%' or 0.25"
            )
        number, unit = float(m.group(1)), m.group(2).upper()
        if unit == "" and "." in m.group(1):
            return parse_size(number, field=field)
        return int(number * _UNITS[unit])
    raise ConfigError(f"{field}: expected int, float or str, got {type(value).__name__}")


def resolve_bytes(value: Size, total: int, *, field: str = "size") -> int:
    """Resolve a size (bytes or fraction) against `total` bytes."""
    parsed = parse_size(value, field=field)
    if isinstance(parsed, float):
        return int(parsed * total)
    return parsed


@dataclass(frozen=True)
class OffloadConfig:
    """How a MoE model is offloaded: where the store lives, memory budgets, policies, I/O.

    On a CPU-only machine the compute tier ("device") is host DRAM: `device_cache` is the DRAM budget
    for resident experts and `host_cache` is an optional second (staging) tier, 0 by default.
    """

    offload_dir: str | None = None
    """Expert store directory; packed from the model on first use when empty.
    Default: `<model_dir>.moeinf`."""
    device: str = "cpu"
    device_cache: Size = 0.25
    """Budget of the compute tier (GPU memory, or DRAM on a CPU machine) for experts."""
    host_cache: Size = 0
    """Budget of the host DRAM staging tier between SSD and the device (0 on a CPU-only machine)."""
    eamc: str | None = None
    """EAMC file (from `moeinf trace`) used to predict activations; none = learn online from scratch."""
    prefetch: str = "hybrid"
    """`hybrid`: look-ahead predictions for the next `lookahead_depth` layers, the sequence EAM, the matched
    EAM and the collection prior beyond them; `lookahead`: the predictions only; `activation-aware`:
    Algorithm 1 (EAMC matching); `topk`, `traced-topk`; `none` (on demand)."""
    eviction: str = "activation-aware"
    """`activation-aware`: the fixed score; `fitted`: its constants fitted to this model per cache size, read
    from `X.eviction.json` beside `eamc` (written by `moeinf trace`), or refit online from the served
    requests when there is none; `lru`, `lfu`, `neighbor`."""
    eps: float = 1e-4
    """The epsilon of Algorithms 1 and 2: experts never seen keep a small, layer-ordered priority."""
    prefetch_layers: int = 0
    """How many MoE layers ahead prefetching looks (0 = all later layers, as in Algorithm 1)."""
    prefetch_min_probability: float = 0.3
    """Prefetch plans only experts whose predicted chance of serving a token reaches this (look-ahead:
    the predictor's chance; activation-aware: top-k x the expert's share of its layer in the matched
    EAM). 0.3 keeps most of the learned look-ahead predictor's recall at a high precision (`moeinf bench
    prefetch`; figures in docs/benchmarks.md); 0 plans every expert with any chance (Algorithm 1 for
    activation-aware)."""
    prefetch_hold_plan: bool = True
    """A layer whose experts are all resident, with no read in flight and every key the latest prefetch
    plan wanted resident, makes no new plan: the look-ahead prediction and planning (a few ms of CPU per
    token) would only re-rank what is already there. False plans at every layer."""
    prefetch_plan_thread: bool = True
    """Plan on a second thread: at a MoE layer whose experts are all resident, the look-ahead prediction,
    the plan and its submission run beside the expert compute instead of before it (the expert GEMVs
    release the GIL); a layer that waits for a read plans first, as before, its planning hidden by the
    wait. False plans on the compute thread at every layer."""
    lookahead_depth: int = 3
    """How many MoE layers ahead `lookahead`/`hybrid` predict from the current layer's router input."""
    lookahead_predictor: str = "auto"
    """`auto`: the learned predictor beside `eamc` (`X.lookahead.safetensors`, written by `moeinf trace`)
    when there is one, else the routers of the later layers run on the current router input;
    `routers`: always the routers; or the path of a learned predictor file."""
    lookahead_next_token: bool = True
    """`lookahead`/`hybrid`: when a forward pass's logits are out, start reading the experts that the next
    token (their argmax) routes to in the first MoE layer, from that layer's router run on the token's
    embedding (`moeinf.runtime.lookahead.FirstLayerGuess`); no router input of the running pass predicts
    that layer."""
    lookahead_next_token_layers: int = 3
    """How many of the next pass's first MoE layers `lookahead_next_token` guesses: the first from its
    router, the later ones (at most `lookahead_depth`) from the learned predictor's maps of the first
    layer run on the token's embedding, where there is one. They otherwise wait for the first layer's
    plan, one or two layers before they run, too late for a read of a big expert. 1: the first only."""
    lookahead_transition_layers: int = 3
    """Where expert transitions predict (beside the EAMC, `moeinf trace`; replayed routing), how many layers
    of a token they join: the current one and up to this many - 1 before it in the same pass, as far as the
    file was fit for. 1: the current layer only (the files of earlier versions)."""
    stack_expert_max_bytes: int = 1 << 20
    """Resident experts of one layer are computed in one stacked `bmm` per projection only while each
    expert's weights are at most this many bytes. Stacking copies the weights: for small experts the copy
    is cheaper than the per-expert Python and kernel launch it saves (8 decode rows of the zoo model: 1.80x
    -> 1.19x one row's step), for big ones it is not (a 9.4 MB expert of 30B-A3B geometry: all-resident
    decode 42.8 -> 58.0 ms/token with stacking, bench e2e). 0 turns stacking off."""
    early_shared_experts: bool = True
    """Where a MoE block has shared experts (DeepSeek, Qwen2-MoE, GLM-4.5, Llama-4...), compute them while
    the block's routed experts wait for a read instead of after them (`moeinf.runtime.shared`): the same
    product on the same input, earlier. False: they run where the model's forward calls them."""
    io_threads: int = 4
    """Reads in flight (each thread also checksums what it reads); moeinf.engine.DEFAULT_IO_THREADS."""
    chunk_size: Size = "2MiB"
    direct_io: bool = True
    verify_checksums: bool = True
    dtype: str = "auto"
    quant: str = "auto"
    """Expert weights of the store: "none" (exact, the default when packing), "int8" or "int4" (quantised,
    `moeinf pack --quant`); "auto" uses whatever the store at `offload_dir` holds. The default
    `offload_dir` of a quantised store is `<model_dir>.moeinf-<quant>`."""
    quant_dense: str = "shared-experts+lm-head"
    """With a quantised store, which dense weights also compute quantised (with the store's scheme, at
    load time; the dense file stays exact): "none", "shared-experts" (DeepSeek/Qwen2-MoE shared experts,
    as large as a routed expert and run by every token), "shared-experts+lm-head" (the default: a bf16 LM
    head is a large share of a quantised token's bytes; llama.cpp's Q4_0/Q8_0 files quantise it too).
    `moeinf bench quant` measures the quality of the defaults (perplexity and greedy agreement against bf16;
    docs/benchmarks.md); "shared-experts" keeps more greedy tokens equal to bf16's. Exact stores ignore it."""
    attention_linears: str = "auto"
    """How the attention projections compute (`moeinf.models.attention_linears`): "model" (as the model
    holds them: HF's result bit for bit), "float32" (a float32 copy: torch's bf16 GEMV at one decoded row is
    a slow path on CPU, float32 is not; not bit-equal), "int8" (per-row int8, a quarter of float32's
    bytes). "auto": "int8" for a quantised store (approximate already; llama.cpp's Q8_0/Q4_0 files
    quantise attention too), "model" for an exact store. float32 models are left as they are."""
    eamc_capacity: int = 300
    """Entries of the runtime's EAMC: finished sequences join it until it holds this many; after that
    poorly predicted ones are kept for rebuilds of this size."""
    online_threshold: float = 0.5
    """A sequence whose prediction accuracy falls below this is kept for the next EAMC rebuild."""
    online_rebuild_after: int = 16
    """Rebuild the EAMC in the background after this many poorly predicted sequences (0 disables)."""

    ep_placement: str = "balanced"
    """Expert parallelism (`torchrun ... -m moeinf`): which rank owns which expert. `balanced` evens the
    traced load of the EAMC's sequences over the ranks (round-robin without an EAMC); `round-robin`."""
    ep_timeout: float = 300.0
    """Seconds an expert-parallel exchange may wait for a rank before failing (a dead rank fails at once)."""
    quant_dense_kernel: str = "auto"
    """How the `quant_dense` linears compute (`moeinf.kernels.quant_linear`): "weight-only" (the store's
    scheme and group size, torch's weight-only int8/int4 kernels, a decoded row in moeinf's own GEMV where
    it runs), "int8" (the same with per-row int8 weights whatever the store's scheme), "dynamic-int8"
    (per-row int8 weights, activations rounded to 8 bits per call, fbgemm's `quantized::linear_dynamic`:
    faster than torch's weight-only int8 GEMV at one decoded row). "auto": "int8" where moeinf's own GEMV
    computes its decoded rows (x86 with AVX2, where it is faster than fbgemm), else "dynamic-int8" where
    torch has fbgemm (x86), else "weight-only"."""
    fast_dense_modules: bool = True
    """Replace dense modules by shorter computations: routers that keep every group of a group-limited
    top-k skip the group mask (`moeinf.models.deepseek_v3.router`, bit-equal: every store); an exact store's
    gated MLPs (shared experts, dense layers) take a decoded row's gate and up products as one on CPU
    (`moeinf.models.gated_mlp`, bit-equal, checked per module); a quantised store's gated
    shared experts compute gate and up in one kernel call (`quant_dense`) and its Llama-form RMSNorms run in
    moeinf's kernels (`moeinf.kernels.norms`); an exact store's Llama-form RMSNorms run in torch's
    `rms_norm` on CPU, whose ops are HF's (bit-equal, checked at load); a quantised store's DeepSeek-V3
    layers decode a row as one flat function (`moeinf.models.deepseek_v3.decode_layer`); a DeepSeek-V3
    body's one-row decode steps skip building the causal mask that SDPA does not need there
    (`moeinf.models.deepseek_v3.decode_body`, bit-equal: every store). False keeps the model's own."""
    bf16_row_kernel: bool = True
    """An exact bf16 store on CPU: a decoded row's products (experts, shared experts, attention projections,
    LM head) run in moeinf's kernel where the CPU has AVX512_BF16 and torch's `F.linear` runs oneDNN's
    matmul there, whose order of sums the kernel repeats (`moeinf.kernels.bf16_rows`): the same bits,
    checked per shape at its first use, ~1.5-2.5x faster per product. False keeps torch's products."""
    one_thread_steps: bool = True
    """With `bf16_row_kernel`: a DeepSeek-V3 layer's decoded row runs in `moeinf.kernels.gemv.kernel_step`,
    its products in moeinf's kernel at torch's thread count and torch's own ops between them at one
    intra-op thread (on a small machine the kernel's helper threads and OpenMP's otherwise wait for each
    other). This sets torch's process-wide thread count to 1 while the row decodes and restores it after:
    other threads' torch ops run at one thread meanwhile. False never changes torch's thread count (the
    kernel's one-row products then run on the calling thread alone); the result is the same bits."""
    quant_expert_kernel: str = "auto"
    """How a quantised store's routed experts compute one decoded row (`moeinf.kernels.quant_experts`):
    "weight-only" (torch's int8/int4 weight-only kernels), "dynamic-int8" (int8 stores: the row rounded to
    int8 and an integer GEMV, `torch._int_mm`; ~0.85x the time at one row; calls of more rows stay
    weight-only), "prepacked-int8" (int8 stores whose every expert the cache holds, on CPU: each expert's
    weights prepacked for fbgemm's `quantized::linear_dynamic` at its first one-row call, ~8.5 ms per
    matrix once and a second copy of the expert bytes, then ~half of dynamic-int8's time; more rows stay
    weight-only), "gemv" (moeinf's own int8/int4 GEMV on the store's layouts, x86 with AVX2: no prepack,
    ~0.55x the int8 and ~0.7x the int4 weight-only time at one row; more rows stay weight-only). "auto":
    "gemv" where it runs, else "prepacked-int8" for an int8 store the cache holds whole where torch has
    fbgemm, else "dynamic-int8" for an int8 store where the CPU has AVX512-VNNI (`_int_mm` is 9x slower
    without), "weight-only" otherwise."""
    quant_activations: str = "auto"
    """What a decoded row of a quantised store's routed experts multiplies by in moeinf's own GEMV
    (`quant_expert_kernel` "gemv"): "float" (the activations as they are, widened to float32), "int8"
    (each row rounded to int8 in blocks of 32 values with a float32 scale each, llama.cpp's Q8_0 for
    activations, and byte-by-byte integer products; matrices whose inputs or int4 groups are not a multiple
    of 32 stay float). "auto": "int8" for int4 experts (less time per expert read from DRAM, for slightly
    fewer greedy tokens equal to bf16's), "float" for int8 experts (no faster from DRAM: one core's
    bandwidth bounds them already). The dense linears a quantised store quantises beside its experts
    (`quant_dense`) follow the same rule for their own scheme: the default "int8" kernel keeps them float,
    "weight-only" on an int4 store rounds them. Exact stores never round anything."""
    mla_absorb: bool = True
    """A quantised store's DeepSeek-V3 (MLA) attention computes one-row decode steps on the latent cache with
    `kv_b_proj` absorbed into the query and output (`moeinf.models.deepseek_v3.mla_decode`): no expansion of
    the whole cache through `kv_b_proj` at every step and ~half the small ops; float32 sums in another order,
    not bit-equal (exact stores never do this). False keeps the model's attention."""
    mla_expanded_max_bytes: int = 1 << 30
    """MLA attentions (DeepSeek-V2/V3 and their copies) that compute as the model does keep the keys and
    values their `expand_kv` made from the latent cache and, at the next step, run `kv_b_proj` on the new
    rows only (`moeinf.models.mla_expand`): bit-equal where torch's CPU bf16/fp16 GEMM computes each row
    alone, or, at one intra-op thread, the same in every call of two rows or more (a new row is then
    computed beside the one before it; checked per layer), instead of a GEMM over the whole cache per layer
    and token. The most bytes
    those kept tensors take, shared equally by the layers; a layer whose share would be passed expands the
    whole cache as the model does. 0 turns it off."""

    prefetch_window: float = 0.25
    """The most prefetched experts that may wait unused for a layer ahead of the computation, as a share of
    the compute tier's slots (at least one expert): a plan deeper than this waits for its layer."""
    pace_smoothing: float = 0.2
    """Weight of the newest measurement in the running averages of read bandwidth and layer compute time
    that decide how far ahead of their layer prefetches are issued (`moeinf.runtime.lookahead.Pace`)."""

    def __post_init__(self) -> None:
        self._check_types()
        if self.device not in DEVICES:
            raise ConfigError(f"device: must be one of {DEVICES}, got {self.device!r}")
        if self.prefetch not in PREFETCH_POLICIES:
            raise ConfigError(f"prefetch: must be one of {PREFETCH_POLICIES}, got {self.prefetch!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"eviction: must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        parse_size(self.device_cache, field="device_cache")
        parse_size(self.host_cache, field="host_cache")
        chunk = parse_size(self.chunk_size, field="chunk_size")
        if not isinstance(chunk, int) or chunk < 4096 or chunk % 4096:
            raise ConfigError(f"chunk_size: must be a multiple of 4KiB such as '2MiB', "
                              f"got {self.chunk_size!r}")
        if self.io_threads < 1:
            raise ConfigError(f"io_threads: must be >= 1, got {self.io_threads}")
        if not self.eps > 0:
            raise ConfigError(f"eps: must be > 0, got {self.eps}")
        if self.prefetch_layers < 0:
            raise ConfigError(f"prefetch_layers: must be >= 0, got {self.prefetch_layers}")
        if self.mla_expanded_max_bytes < 0:
            raise ConfigError(f"mla_expanded_max_bytes: must be >= 0 (0 turns keeping off), "
                              f"got {self.mla_expanded_max_bytes}")
        if self.stack_expert_max_bytes < 0:
            raise ConfigError(f"stack_expert_max_bytes: must be >= 0 (0 turns stacking off), "
                              f"got {self.stack_expert_max_bytes}")
        if self.lookahead_depth < 1:
            raise ConfigError(f"lookahead_depth: must be >= 1, got {self.lookahead_depth}")
        if self.lookahead_transition_layers < 1:
            raise ConfigError(f"lookahead_transition_layers: must be >= 1, "
                              f"got {self.lookahead_transition_layers}")
        if self.lookahead_next_token_layers < 1:
            raise ConfigError(f"lookahead_next_token_layers: must be >= 1, "
                              f"got {self.lookahead_next_token_layers}")
        if not self.lookahead_predictor:
            raise ConfigError("lookahead_predictor: give 'auto', 'routers' or the path of a "
                              "`.lookahead.safetensors` file from `moeinf trace`")
        if not 0.0 <= self.prefetch_min_probability <= 1.0:
            raise ConfigError(f"prefetch_min_probability: must lie in [0, 1], "
                              f"got {self.prefetch_min_probability}")
        if self.eamc_capacity < 1:
            raise ConfigError(f"eamc_capacity: must be >= 1, got {self.eamc_capacity}")
        if not 0.0 <= self.online_threshold <= 1.0:
            raise ConfigError(f"online_threshold: must lie in [0, 1], got {self.online_threshold}")
        if self.online_rebuild_after < 0:
            raise ConfigError(f"online_rebuild_after: must be >= 0, got {self.online_rebuild_after}")
        if self.ep_placement not in EP_PLACEMENTS:
            raise ConfigError(f"ep_placement: must be one of {EP_PLACEMENTS}, got {self.ep_placement!r}")
        if not self.ep_timeout > 0:
            raise ConfigError(f"ep_timeout: must be > 0 seconds, got {self.ep_timeout}")
        if self.quant not in QUANT_SETTINGS:
            raise ConfigError(f"quant: must be one of {QUANT_SETTINGS}, got {self.quant!r}")
        if self.quant_dense not in QUANT_DENSE:
            raise ConfigError(f"quant_dense: must be one of {QUANT_DENSE}, got {self.quant_dense!r}")
        if self.quant_dense_kernel not in QUANT_DENSE_KERNELS:
            raise ConfigError(f"quant_dense_kernel: must be one of {QUANT_DENSE_KERNELS}, "
                              f"got {self.quant_dense_kernel!r}")
        if self.quant_expert_kernel not in QUANT_EXPERT_KERNELS:
            raise ConfigError(f"quant_expert_kernel: must be one of {QUANT_EXPERT_KERNELS}, "
                              f"got {self.quant_expert_kernel!r}")
        if self.quant_activations not in QUANT_ACTIVATIONS:
            raise ConfigError(f"quant_activations: must be one of {QUANT_ACTIVATIONS}, "
                              f"got {self.quant_activations!r}")
        if self.attention_linears not in ATTENTION_LINEARS:
            raise ConfigError(f"attention_linears: must be one of {ATTENTION_LINEARS}, "
                              f"got {self.attention_linears!r}")
        if not 0.0 < self.prefetch_window <= 1.0:
            raise ConfigError(f"prefetch_window: a share of the compute tier's slots in (0, 1], "
                              f"got {self.prefetch_window}")
        if not 0.0 < self.pace_smoothing <= 1.0:
            raise ConfigError(f"pace_smoothing: must lie in (0, 1], got {self.pace_smoothing}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype: must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    def _check_types(self) -> None:
        """The int, float and bool fields hold what they say (a JSON config can give "2" for 2): one clear
        error here instead of a comparison failing deep inside a check or the runtime."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if f.type == "int" and not (number and isinstance(value, int)):
                raise ConfigError(f"{f.name}: must be an integer, got {value!r}")
            if f.type == "float" and not number:
                raise ConfigError(f"{f.name}: must be a number, got {value!r}")
            if f.type == "bool" and not isinstance(value, bool):
                raise ConfigError(f"{f.name}: must be true or false, got {value!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> OffloadConfig:
        """Build from a mapping (JSON, CLI); unknown keys are an error, never ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            close = {name: difflib.get_close_matches(name, known, n=1) for name in unknown}
            hints = [f"{name!r} (did you mean {match[0]!r}?)" for name, match in close.items() if match]
            hint = f"; {', '.join(hints)}" if hints else ""
            raise ConfigError(f"unknown OffloadConfig field(s) {unknown}{hint}; known fields: "
                              f"{sorted(known)}")
        return cls(**dict(values))

    @classmethod
    def coerce(cls, value: OffloadConfig | Mapping[str, Any] | None) -> OffloadConfig:
        if value is None:
            return cls()
        if isinstance(value, OffloadConfig):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ConfigError(f"expected an OffloadConfig or a dict, got {type(value).__name__}")

    def replace(self, **changes: Any) -> OffloadConfig:
        return dataclasses.replace(self, **changes)

    def section(self, name: str) -> dict[str, Any]:
        """The fields of one section of `SECTIONS` and their values."""
        if name not in SECTIONS:
            raise ConfigError(f"no configuration section {name!r}; sections: {sorted(SECTIONS)}")
        return {field: getattr(self, field) for field in SECTIONS[name]}


SECTIONS: dict[str, tuple[str, ...]] = {
    "cache": ("device", "device_cache", "host_cache", "eviction", "eps", "prefetch_window"),
    "prefetch": ("prefetch", "prefetch_layers", "prefetch_min_probability", "prefetch_hold_plan",
                 "prefetch_plan_thread", "lookahead_depth", "lookahead_predictor", "lookahead_next_token",
                 "lookahead_next_token_layers", "lookahead_transition_layers", "pace_smoothing", "eamc",
                 "eamc_capacity", "online_threshold", "online_rebuild_after"),
    "io": ("offload_dir", "quant", "io_threads", "chunk_size", "direct_io", "verify_checksums"),
    "kernels": ("dtype", "quant_dense", "quant_dense_kernel", "quant_expert_kernel", "quant_activations",
                "attention_linears", "fast_dense_modules", "bf16_row_kernel", "one_thread_steps",
                "mla_absorb", "mla_expanded_max_bytes", "stack_expert_max_bytes", "early_shared_experts"),
    "parallel": ("ep_placement", "ep_timeout"),
}
"""Every `OffloadConfig` field in exactly one section: where the experts live and how many (cache), what
is read ahead (prefetch), how the store is read (io), how the model computes (kernels), and expert
parallelism (parallel)."""


@dataclass(frozen=True)
class Budget:
    """The expert memory of one offloaded model, resolved once from its `OffloadConfig` and its store, and
    handed to the engine (its pool's slots), the cache and the offloader (slots, window, `holds_all`) and
    the kernel choice (`holds_all`). Tiers hold whole experts, in slots of the store's largest blob."""

    expert_bytes: int
    """The base of a percentage: the store's expert bytes."""
    slot_bytes: int
    """The store's largest expert blob: one slot."""
    experts: int
    device_bytes: int
    """`device_cache` in bytes."""
    host_bytes: int
    """`host_cache` in bytes."""
    slots: int
    """Experts the compute tier holds."""
    host_slots: int
    """Experts the host staging tier holds; 0: there is none, the compute tier is the engine's pool."""
    window: int
    """The most prefetched experts that may wait unused ahead of the computation (`prefetch_window`)."""

    @property
    def holds_all(self) -> bool:
        """The compute tier holds every expert: once each is read, nothing is read again."""
        return self.slots == self.experts

    @property
    def engine_slots(self) -> int:
        """Slots of the engine's pool: the host staging tier's, or the compute tier's without one."""
        return self.host_slots or self.slots

    @classmethod
    def resolve(cls, config: OffloadConfig, *, expert_bytes: int, slot_bytes: int, experts: int,
                top_k: int) -> Budget:
        """The budget of a store of `experts` blobs of at most `slot_bytes` (`expert_bytes` in all), whose
        tokens each need `top_k` experts of a layer resident together. Refuses, naming the field, a compute
        tier of fewer than `top_k` experts and a host tier of none."""
        device_bytes = resolve_bytes(config.device_cache, expert_bytes, field="device_cache")
        slots = min(device_bytes // slot_bytes, experts)
        if slots < top_k:
            need = top_k * slot_bytes
            raise ConfigError(
                f"device_cache: {device_bytes} bytes hold {slots} experts of {slot_bytes} bytes, but one "
                f"token of one MoE layer needs its top_k={top_k} experts resident together; set "
                f"device_cache >= {need} bytes (e.g. device_cache={need} or '{need / expert_bytes:.1%}' "
                f"of {expert_bytes} expert bytes)")
        host_bytes = resolve_bytes(config.host_cache, expert_bytes, field="host_cache")
        host_slots = 0
        if host_bytes > 0 or config.device != "cpu":
            host_slots = min(host_bytes // slot_bytes, experts)
            if host_slots < 1:
                raise ConfigError(f"host_cache: {host_bytes} bytes hold no expert of {slot_bytes} bytes; a "
                                  f"device tier is fed through the host tier: set host_cache >= {slot_bytes}")
        return cls(expert_bytes=expert_bytes, slot_bytes=slot_bytes, experts=experts,
                   device_bytes=device_bytes, host_bytes=host_bytes, slots=slots, host_slots=host_slots,
                   window=max(1, int(slots * config.prefetch_window)))
