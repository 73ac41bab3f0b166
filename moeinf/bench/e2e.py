"""End-to-end decode latency of every prefetch configuration on a model with real routing and big experts.

The model is the trained zoo model inflated to Qwen3-30B-A3B's expert geometry (hidden 2048, expert
intermediate 768: 9.4 MB per expert in bf16; `moeinf zoo inflate`, moeinf/zoo/inflate.py), built once
under --model-dir: its routing, hidden states and tokens are the trained model's own, while every expert
read and expert GEMV costs what a 30B-A3B expert costs. Any other checkpoint can be given.

One run measures, per --cache size (device_cache, a share of the expert bytes), each prefetch
configuration: on-demand LRU (prefetch none, eviction lru: the baseline), every prefetch policy of the
installed OffloadConfig (activation-aware, topk, traced-topk, and the look-ahead ones where present) with
its default eviction, the default OffloadConfig, and the default prefetch with the eviction fitted to
the traced routing ("fitted eviction"). Also in the same run:

- compute time: the same model all in RAM, as HF (transformers, unmodified) and as moeinf with every
  expert resident (device_cache 100%, warmed);
- the raw O_DIRECT bandwidth of the store's drive (random whole-expert reads, the engine's access pattern,
  and sequential reads of the store's files);
- the greedy tokens of every configuration against the unmodified HF model's (`tokens_match`).

Per configuration (medians over the decode steps of --prompts held-out prompts x --new-tokens tokens;
prefill excluded): ms/token, bytes read/token, hit ratio, prefetch precision/recall, and
`vs_bound` = ms/token / max(I/O time, compute time), with I/O time = its bytes read per token / raw
bandwidth and compute time = the faster all-in-RAM run (with --rounds, of the same round). The bytes
read per token count every pass, the prompt passes included (a prompt touches most experts);
`decode_bytes_per_token` and `vs_bound_decode` count only the decode steps that ms/token is the median
of, and `decode_stall_ms_per_token` is the time those steps waited for reads. The EAMC (and the learned
look-ahead predictor where the runtime has one) come from `moeinf trace`-style tracing of --eamc-prompts
other held-out prompts on the same model. The store is read with O_DIRECT, so the page cache does not
flatter offloading.

  moeinf bench e2e --cache 10%,25%,50% --prompts 4 --new-tokens 32 --out e2e.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moeinf.bench.common import machine, median_round, offload_settings
from moeinf.config import ConfigError, parse_size

DEFAULT_MODEL_NAME = "e2e-zoo-full-2048x768"
"""The inflated model's directory under $MOEINF_CACHE/bench when --model-dir is not given."""
GEOMETRY = {"hidden": 2048, "moe_intermediate": 768}
PROMPT_FILES = ("mt_bench.jsonl", "gsm8k_test.jsonl", "mmlu_dev.jsonl", "self_instruct_seed.jsonl")
BASELINE = "on-demand-lru"
FITTED = "fitted eviction"
"""The default prefetch with `eviction="fitted"` (its fit traced with the EAMC), against the fixed score."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", default=None,
                        help="checkpoint; when missing, the zoo model --zoo-variant (or --source) "
                             "inflated to hidden 2048 x expert intermediate 768 is built there (default: "
                             f"$MOEINF_CACHE/bench/{DEFAULT_MODEL_NAME})")
    parser.add_argument("--zoo-variant", default="full", help="zoo model to inflate when building")
    parser.add_argument("--source", default=None, help="zoo checkpoint directory to inflate (default: the "
                        "cached --zoo-variant)")
    parser.add_argument("--cache", default="25%",
                        help="device_cache of the offloaded runs; a comma-separated list runs each size")
    parser.add_argument("--prompts", type=int, default=4, help="measured held-out prompts per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="prompts decoded first, unmeasured")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=64)
    parser.add_argument("--eamc-prompts", type=int, default=40,
                        help="other held-out prompts traced for the EAMC and look-ahead predictor")
    parser.add_argument("--eamc-new-tokens", type=int, default=32, help="tokens generated per traced prompt")
    parser.add_argument("--eamc", default=None, help="reuse this EAMC (and the look-ahead predictor beside "
                        "it) instead of tracing; default: trace into <model-dir>.eamc")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a busy 2-core machine, 2 are often slower)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated configuration names to run (default: all; see the output)")
    parser.add_argument("--skip-hf", action="store_true", help="skip the all-in-RAM HF run (and the token "
                        "check against it)")
    parser.add_argument("--skip-resident", action="store_true", help="skip moeinf with every expert resident "
                        "(compute time is then HF's alone)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every offloaded configuration this many times in turn (all of them, then "
                             "all again, the baseline first and the others rotated one place each round); "
                             "each row's ms/token is the median of its rounds' and each ratio to "
                             "LRU the median of the rounds' ratios (each round against its own LRU run), so "
                             "that a machine whose speed drifts weighs on every configuration alike; each "
                             "round after the first re-measures moeinf all resident, and its rows' bound "
                             "uses that round's compute time; the JSON lines keep every round (default: 1)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                        help="an extra configuration NAME: the default one with these OffloadConfig settings "
                             "(values read as JSON where they parse), measured beside the others, e.g. "
                             "mp5:prefetch_min_probability=0.5 (repeatable; always run, whatever --configs)")
    parser.add_argument("--out", default=None, help="append JSON lines here (default: stdout only)")
    parser.add_argument("--seed", type=int, default=0)


def ensure_model(model_dir: Path, args: argparse.Namespace) -> None:
    """Build the inflated zoo model in `model_dir` when it holds no checkpoint.

    `moeinf zoo inflate` runs as its own process: the allocator keeps much of what inflation freed (seen:
    5.7 GB resident after writing 4.8 GB), which the benchmark's models would then sit on top of.
    """
    if (model_dir / "config.json").is_file():
        return
    from moeinf.zoo import get_model

    source = Path(args.source) if args.source else get_model(args.zoo_variant)
    print(f"inflating {source} to {model_dir} (hidden {GEOMETRY['hidden']}, expert intermediate "
          f"{GEOMETRY['moe_intermediate']}, bf16)...", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "moeinf.cli", "zoo", "inflate", str(source), str(model_dir),
               "--hidden", str(GEOMETRY["hidden"]), "--moe-intermediate", str(GEOMETRY["moe_intermediate"])]
    if subprocess.run(command, stdout=subprocess.DEVNULL).returncode != 0:
        raise ValueError(f"inflating {source} into {model_dir} failed (see above)")


def load_prompts(count: int) -> list[str]:
    """`count` prompts interleaved over PROMPT_FILES (the accelerate baseline's prompts)."""
    root = Path(__file__).resolve().parent.parent / "data" / "prompts"
    texts: list[str] = []
    for name in PROMPT_FILES:
        with open(root / name) as f:
            texts.extend(json.loads(line)["prompt"] for line in f if line.strip())
    per_file = len(texts) // len(PROMPT_FILES)
    return [texts[(i % len(PROMPT_FILES)) * per_file + i // len(PROMPT_FILES)] for i in range(count)]


def heldout_texts(count: int, seed: int) -> list[str]:
    """`count` held-out prompts of the zoo corpus (never trained on), in a seeded order mixing tasks."""
    from moeinf.zoo.corpus import heldout_prompts

    texts = [ex.prompt for ex in heldout_prompts()]
    random.Random(seed).shuffle(texts)
    if count > len(texts):
        raise ValueError(f"asked for {count} held-out prompts, there are {len(texts)}")
    return texts[:count]


Probe = Callable[[], tuple[float, ...]]
"""Counters sampled at every decode step (e.g. bytes read, seconds stalled); their growth between the
first and the last step is what the decode steps alone added."""


class StepClock:
    """A logits processor that timestamps every decode step, and samples `probe` there (it changes no
    score)."""

    def __init__(self, probe: Probe | None = None) -> None:
        self.stamps: list[float] = []
        self.probe = probe
        self.samples: list[tuple[float, ...]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        if self.probe is not None:
            self.samples.append(self.probe())
        return scores

    def token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]

    def decode_growth(self) -> tuple[float, ...]:
        """How much each probed counter grew over the decode steps (from the first stamp to the last)."""
        if len(self.samples) < 2:
            return tuple(0.0 for _ in self.samples[0]) if self.samples else ()
        return tuple(b - a for a, b in zip(self.samples[0], self.samples[-1], strict=True))


@dataclass(frozen=True)
class Workload:
    """The prompts every configuration decodes, as chat-formatted ids [1, P]."""

    model_dir: Path
    warm: list[torch.Tensor]
    inputs: list[torch.Tensor]
    new_tokens: int

    def decode(self, generate: Any, inputs: Sequence[torch.Tensor]) -> tuple[list[float], list[list[int]]]:
        """Per-token decode latencies and the generated ids of each input."""
        latencies, tokens, _ = self.decode_probed(generate, inputs)
        return latencies, tokens

    def decode_probed(self, generate: Any, inputs: Sequence[torch.Tensor], probe: Probe | None = None
                      ) -> tuple[list[float], list[list[int]], list[float]]:
        """`decode`, plus the growth of each `probe` counter over the decode steps (prompt passes
        excluded), summed over the inputs."""
        from transformers import LogitsProcessorList

        latencies: list[float] = []
        tokens: list[list[int]] = []
        growth: list[float] = []
        for ids in inputs:
            clock = StepClock(probe)
            out = generate(ids, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                           do_sample=False, logits_processor=LogitsProcessorList([clock]))
            latencies.extend(clock.token_latencies())
            tokens.append(out[0, ids.shape[1]:].tolist())
            added = clock.decode_growth()
            growth = [a + b for a, b in zip(growth, added, strict=True)] if growth else list(added)
        return latencies, tokens, growth


def build_workload(model_dir: Path, args: argparse.Namespace) -> tuple[Workload, list[str]]:
    """The measured workload and the texts of the other prompts to trace."""
    from moeinf.bench.replay_routing import zoo_prompt_ids
    from moeinf.hf.tokenizer import load_tokenizer

    tokenizer, _ = load_tokenizer(model_dir)
    count = args.warmup + args.prompts
    texts = heldout_texts(count + args.eamc_prompts, args.seed)
    encoded = [torch.tensor([zoo_prompt_ids(tokenizer, t, args.max_prompt_tokens)]) for t in texts[:count]]
    return Workload(model_dir, encoded[: args.warmup], encoded[args.warmup:], args.new_tokens), texts[count:]


def trace_source(model_dir: Path) -> Path:
    """The checkpoint to trace for `model_dir`'s EAMC: the small model it was inflated from when present
    (the same routing at a fraction of the cost), else itself."""
    from moeinf.zoo.inflate import META_FILE

    meta = model_dir / META_FILE
    if meta.is_file():
        source = Path(json.loads(meta.read_text())["source"])
        if (source / "config.json").is_file():
            return source
    return model_dir


def trace_predictors(model_dir: Path, texts: list[str], args: argparse.Namespace, out: Path) -> Path:
    """Trace `texts` (as `moeinf trace` does) into an EAMC at `out` for `model_dir`, with the learned
    look-ahead predictor beside it when the runtime has one. Returns the EAMC path.

    An inflated model is traced through its source: the routing is the same, and the learned maps, fit on
    the source's router inputs, get zero weights for the padded coordinates (which are zero at run time),
    so they predict exactly what they would on the small model.
    """
    return save_predictors(trace(trace_source(model_dir), texts, args), model_dir, out, args)


def trace(source: Path, texts: list[str], args: argparse.Namespace) -> Any:
    """`moeinf.trace.collect.collect` of the chat-formatted `texts` on `source`, with router inputs."""
    from moeinf.trace.collect import Prompt, collect
    from moeinf.zoo.tokenizer import chat_text

    prompts = [Prompt(f"heldout-{i}", "heldout", chat_text(t), "zoo-heldout") for i, t in enumerate(texts)]
    print(f"tracing {len(prompts)} other held-out prompts on {source} for the EAMC...", file=sys.stderr,
          flush=True)
    return collect(source, prompts, max_new_tokens=args.eamc_new_tokens,
                   max_prompt_tokens=args.max_prompt_tokens, seed=args.seed, progress=True, raw=True,
                   **({"hidden": True} if lookahead_fit_available() else {}))


def save_predictors(collected: Any, model_dir: Path, out: Path, args: argparse.Namespace) -> Path:
    """Save the EAMC of a trace, the eviction policy fitted to its routing (`moeinf trace`'s
    `X.eviction.json`, for the fitted-eviction row) and the learned look-ahead maps (padded to
    `model_dir`'s hidden size) beside it."""
    from moeinf.policy.fitted import fit_eviction, fit_path
    from moeinf.store.fingerprint import fingerprint
    from moeinf.trace.collect import build_eamc

    meta = {"fingerprint": fingerprint(model_dir), "model": model_dir.name,
            "max_new_tokens": args.eamc_new_tokens, "sample": False}
    build_eamc(collected, capacity=min(len(collected.prompts), 300), seed=args.seed, meta=meta).save(out)
    if collected.raw:  # as `moeinf trace` fits it
        fit_eviction([t.step_counts() for t in collected.raw], top_k=collected.top_k,
                     seed=args.seed).save(fit_path(out))
    if getattr(collected, "hidden", None) is not None:
        from moeinf.config import OffloadConfig
        from moeinf.trace import lookahead_fit

        depth = int(getattr(OffloadConfig(), "lookahead_depth", 2))
        print(f"fitting the look-ahead predictor on {len(collected.hidden.ids)} traced tokens (a few "
              "CPU-minutes)...", file=sys.stderr, flush=True)
        maps = lookahead_fit.fit(collected.hidden, collected.num_experts, depth, seed=args.seed)
        hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
        lookahead_fit.save(maps.padded(hidden), lookahead_fit.predictor_path(out),
                           {"fingerprint": meta["fingerprint"]})
    return out


def lookahead_fit_available() -> bool:
    try:
        from moeinf.trace import lookahead_fit  # noqa: F401
    except ImportError:
        return False
    return True


def configurations(eamc: Path) -> dict[str, dict[str, Any]]:
    """name -> OffloadConfig knobs (besides device_cache): the baseline, then each prefetch policy with its
    default eviction; the policy that OffloadConfig uses by default is named "<policy> (default)". Last,
    the default prefetch with the eviction fitted to the traced routing (`FITTED`), beside the fixed score."""
    from moeinf.config import PREFETCH_POLICIES, OffloadConfig

    default = OffloadConfig().prefetch
    configs: dict[str, dict[str, Any]] = {BASELINE: {"prefetch": "none", "eviction": "lru"}}
    for policy in PREFETCH_POLICIES:
        if policy != "none":
            configs[f"{policy} (default)" if policy == default else policy] = {"prefetch": policy,
                                                                               "eamc": str(eamc)}
    configs[FITTED] = {"prefetch": default, "eviction": "fitted", "eamc": str(eamc)}
    return configs


def variant_settings(specs: list[str]) -> dict[str, dict[str, Any]]:
    """--variant NAME:KEY=VALUE[,KEY=VALUE] -> {NAME: OffloadConfig settings}; ValueError naming the bad
    one."""
    variants: dict[str, dict[str, Any]] = {}
    for spec in specs:
        name, sep, pairs = spec.partition(":")
        name = name.strip()
        if not sep or not name or " " in name or name in variants:
            raise ValueError(f"{spec!r}: give NAME:KEY=VALUE[,KEY=VALUE] with a new NAME without spaces")
        variants[name] = offload_settings([pair.strip() for pair in pairs.split(",") if pair.strip()])
    return variants


def run_offloaded(workload: Workload, name: str, cache: str, knobs: dict[str, Any], store: Path, *,
                  warm_all: bool = False) -> dict[str, Any]:
    """Decode the warm-up prompts (with `warm_all`, the measured ones too), reset the counters, then
    measure the prompts."""
    from moeinf import MoE, OffloadConfig

    config = OffloadConfig(device_cache=cache, offload_dir=str(store), **knobs)
    started = time.perf_counter()
    with MoE(workload.model_dir, config) as moe:
        workload.decode(moe.generate, [*workload.warm, *workload.inputs] if warm_all else workload.warm)
        moe.reset_stats()

        def probe() -> tuple[float, float]:
            counters = moe.stats()
            return float(counters["bytes_read"]), float(counters["stall_s"])

        latencies, tokens, growth = workload.decode_probed(moe.generate, workload.inputs, probe)
        decode_bytes, decode_stall = growth
        stats = moe.stats()
    decoded = len(latencies)
    return {"config": name, "cache": cache, "knobs": {"device_cache": cache, **knobs},
            "median_s": statistics.median(latencies), "latencies": latencies, "tokens": tokens,
            "bytes_read_per_token": stats["bytes_read"] / max(stats["tokens"], 1),
            "decode_bytes_per_token": decode_bytes / max(decoded, 1),
            "decode_stall_ms_per_token": decode_stall / max(decoded, 1) * 1e3,
            "hit_ratio": stats["hit_rate"], "prefetch_precision": stats["prefetch_precision"],
            "prefetch_recall": stats["prefetch_recall"], "decode_steps": decoded, "stats": stats,
            "seconds": round(time.perf_counter() - started, 1)}


def run_hf(workload: Workload) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(workload.model_dir).eval()
    with torch.inference_mode():
        workload.decode(model.generate, workload.warm)
        latencies, tokens = workload.decode(model.generate, workload.inputs)
    del model
    return {"config": "hf-all-in-ram", "cache": None, "median_s": statistics.median(latencies),
            "latencies": latencies, "tokens": tokens}


def raw_bandwidth(store: Path, seed: int, sample_bytes: float = 2e9) -> dict[str, Any]:
    """Raw O_DIRECT reads of the store: whole experts in a random order (up to `sample_bytes`), and each
    file's expert extent sequentially, in bytes/s."""
    from moeinf.bench.io import load_blobs, raw_phase
    from moeinf.engine import raw_read_ranges

    files, blobs = load_blobs(store)
    order = random.Random(seed).sample(blobs, len(blobs))
    picked, total = [], 0
    for blob in order:
        if total >= sample_bytes:
            break
        picked.append(blob)
        total += blob.size
    seconds = 0.0
    for index, path in enumerate(files):
        ranges = [(b.offset, b.size) for b in picked if b.file == index]
        if ranges:
            seconds += raw_read_ranges(path, ranges)["seconds"]
    sequential = raw_phase(files, blobs, 2 << 20)
    return {"random_bps": total / seconds, "random_bytes": total,
            "sequential_bps": sequential["raw_gbps"] * 1e9, "direct_io": sequential["raw_direct_io"]}


@dataclass
class Reference:
    """What every offloaded row is compared with, all measured in the same run."""

    tokens: list[list[int]] | None
    """The unmodified HF model's greedy tokens (None with --skip-hf)."""
    compute_s: float
    """Per-token time of the faster all-in-RAM run."""
    raw_bps: float
    """Raw O_DIRECT bandwidth: the better of random whole-expert and sequential reads."""
    lru: dict[str, dict[str, Any]] = field(default_factory=dict)
    """cache size -> the on-demand LRU row."""

    def annotate(self, row: dict[str, Any]) -> None:
        """Add the token check and, for an offloaded row, the ratios to LRU and to the bound, in place."""
        row["tokens_match"] = None if self.tokens is None else row["tokens"] == self.tokens
        if row["cache"] is None:
            return
        if row["config"] == BASELINE:
            self.lru[row["cache"]] = row
        io_s = row["bytes_read_per_token"] / self.raw_bps
        lru = self.lru.get(row["cache"])
        io_decode_s = row["decode_bytes_per_token"] / self.raw_bps
        row.update(io_s=io_s, compute_s=self.compute_s, bound_s=max(io_s, self.compute_s),
                   vs_bound=row["median_s"] / max(io_s, self.compute_s), io_decode_s=io_decode_s,
                   vs_bound_decode=row["median_s"] / max(io_decode_s, self.compute_s),
                   speedup_vs_lru=lru["median_s"] / row["median_s"] if lru else None,
                   bytes_vs_lru=(row["bytes_read_per_token"] / lru["bytes_read_per_token"]
                                 if lru and lru["bytes_read_per_token"] else None))


def run(args: argparse.Namespace) -> int:
    caches = [c.strip() for c in args.cache.split(",") if c.strip()]
    if not caches:
        print("moeinf bench e2e: error: --cache names no size", file=sys.stderr)
        return 2
    for cache in caches:  # refused before the minutes of building, packing and fitting, not after them
        try:
            parse_size(cache, field="--cache")
        except ConfigError as exc:
            print(f"moeinf bench e2e: error: {exc}", file=sys.stderr)
            return 2
    counts = (args.prompts, args.new_tokens, args.eamc_prompts, args.threads, args.rounds)
    if min(counts) < 1 or args.warmup < 0:
        print("moeinf bench e2e: error: --prompts, --new-tokens, --eamc-prompts, --threads and --rounds must "
              "be >= 1", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    from moeinf.zoo import cache_root

    model_dir = Path(args.model_dir) if args.model_dir else cache_root() / "bench" / DEFAULT_MODEL_NAME
    store = model_dir.with_name(model_dir.name + ".moeinf")
    started = time.perf_counter()
    try:
        ensure_model(model_dir, args)
        workload, trace_texts = build_workload(model_dir, args)
        if args.eamc and not Path(args.eamc).is_file():
            raise ValueError(f"--eamc {args.eamc}: no such file")
    except ValueError as exc:
        print(f"moeinf bench e2e: error: {exc}", file=sys.stderr)
        return 2
    try:
        variants = variant_settings(args.variant)
    except ValueError as exc:
        print(f"moeinf bench e2e: error: --variant {exc}", file=sys.stderr)
        return 2
    configs = configurations(Path(args.eamc or "eamc"))
    if args.configs:
        wanted = [c.strip() for c in args.configs.split(",")]
        unknown = [c for c in wanted if not any(name.split(" ")[0] == c for name in configs)]
        if unknown:
            print(f"moeinf bench e2e: error: unknown --configs {unknown}; choose from {list(configs)}",
                  file=sys.stderr)
            return 2
    eamc = (Path(args.eamc) if args.eamc else
            trace_predictors(model_dir, trace_texts, args, model_dir.with_name(model_dir.name + ".eamc")))
    configs = configurations(eamc)
    default = configs[next(name for name in configs if name.endswith(" (default)"))]
    if args.configs:
        configs = {name: knobs for name, knobs in configs.items() if name.split(" ")[0] in wanted}
    configs.update({name: {**default, **knobs} for name, knobs in variants.items()})
    # The baseline first at every size: the other rows' ratios need it.
    configs = {name: configs[name] for name in sorted(configs, key=lambda n: n != BASELINE)}

    if args.skip_hf and args.skip_resident:
        print("moeinf bench e2e: error: --skip-hf and --skip-resident leave no compute time", file=sys.stderr)
        return 2
    measured = [] if args.skip_hf else [run_hf(workload)]
    hf_s = math.inf if args.skip_hf else measured[0]["median_s"]
    per_round = args.rounds > 1 and not args.skip_resident

    def all_resident(turn: int) -> dict[str, Any]:
        row = dict(run_offloaded(workload, "moeinf-all-resident", "100%", {"prefetch": "none"}, store,
                                 warm_all=True), cache=None)
        return dict(row, round=turn) if per_round else row

    if not args.skip_resident:
        measured.append(all_resident(1))
    rounds = [round_order(caches, configs, turn) for turn in range(1, args.rounds + 1)]
    if args.skip_resident:  # the first offloaded run packs the store that the bandwidth is measured on
        cache, name, knobs = rounds[0].pop(0)
        measured.append(dict(run_offloaded(workload, name, cache, knobs, store), round=1))
    bandwidth = raw_bandwidth(store, args.seed)
    print(f"raw O_DIRECT: {bandwidth['random_bps'] / 1e9:.2f} GB/s random experts, "
          f"{bandwidth['sequential_bps'] / 1e9:.2f} GB/s sequential", file=sys.stderr, flush=True)
    reference = Reference(None if args.skip_hf else measured[0]["tokens"],
                          min(r["median_s"] for r in measured if r["cache"] is None),
                          max(bandwidth["random_bps"], bandwidth["sequential_bps"]))
    header = {"bench": "e2e", "model_dir": str(model_dir), "store": str(store), "prompts": args.prompts,
              "warmup": args.warmup, "new_tokens": args.new_tokens, "eamc": str(eamc),
              "eamc_prompts": args.eamc_prompts, "threads": args.threads, "raw_bandwidth": bandwidth,
              "machine": machine(), "config_defaults": dataclasses.asdict(_default_config())}
    results: list[dict[str, Any]] = []

    def write(row: dict[str, Any]) -> None:
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({**header, **row, "elapsed_s": round(time.perf_counter() - started, 1)})
                        + "\n")

    def record(row: dict[str, Any]) -> None:
        # Written as soon as measured, so a run cut short keeps what it finished.
        reference.annotate(row)
        results.append(row)
        write(row)
        if row["cache"] is not None:
            turn = f" (round {row['round']} of {args.rounds})" if args.rounds > 1 else ""
            print(f"  {row['config']} @ {row['cache']}{turn}: {row['median_s'] * 1e3:.1f} ms/token, "
                  f"x{row['speedup_vs_lru']:.2f} of LRU ({row['seconds']} s)", file=sys.stderr, flush=True)

    for row in measured:
        record(row)
    for turn, planned in enumerate(rounds, start=1):
        if per_round and turn > 1:
            # The machine's speed drifts between rounds: each round's bound is its own all-in-RAM time
            # (moeinf all resident, re-measured; HF's, measured once, where that is faster).
            resident = all_resident(turn)
            reference.compute_s = min(hf_s, resident["median_s"])
            record(resident)
        for cache, name, knobs in planned:
            record(dict(run_offloaded(workload, name, cache, knobs, store), round=turn))
    if args.rounds > 1:
        medians = over_rounds([r for r in results if r.get("round") is not None])
        for row in medians:
            write(row)
        results = [r for r in results if r.get("round") is None] + medians
    print(table(results, bandwidth))
    return 0


def round_order(caches: Sequence[str], configs: dict[str, dict[str, Any]],
                turn: int) -> list[tuple[str, str, dict[str, Any]]]:
    """The runs of round `turn` (from 1): per cache the baseline first (the other rows' ratios need it),
    then the other configurations rotated by `turn - 1`, so that none always runs in the same place (a
    machine that slows down or warms up within a round weighs on each configuration in turn)."""
    names = [name for name in configs if name != BASELINE]
    shift = (turn - 1) % len(names) if names else 0
    order = ([BASELINE] if BASELINE in configs else []) + names[shift:] + names[:shift]
    return [(cache, name, configs[name]) for cache in caches for name in order]


def over_rounds(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (cache, config) from its rounds: ms/token the median of the rounds' medians, each ratio
    (to LRU, to the bound) the median of the rounds' ratios; the other fields are those of the round whose
    ms/token is the median. Marked `round: "median"`."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        grouped.setdefault((row["cache"], row["config"]), []).append(row)
    out = []
    for group in grouped.values():
        row = dict(median_round(group, "median_s"), round="median", rounds=len(group),
                   median_s=statistics.median(r["median_s"] for r in group),
                   round_median_s=[r["median_s"] for r in group])
        for ratio in ("speedup_vs_lru", "bytes_vs_lru", "vs_bound", "vs_bound_decode"):
            values = [r[ratio] for r in group if r.get(ratio) is not None]
            row[ratio] = statistics.median(values) if values else None
            row[f"round_{ratio}"] = [r.get(ratio) for r in group]
        matches = [r.get("tokens_match") for r in group]  # None without the HF run (--skip-hf)
        row["tokens_match"] = None if all(m is None for m in matches) else all(m is True for m in matches)
        out.append(row)
    return out


def _default_config() -> Any:
    from moeinf.config import OffloadConfig

    return OffloadConfig()


def table(results: Sequence[dict[str, Any]], bandwidth: dict[str, Any]) -> str:
    """One row per configuration: ms/token and its ratios, bytes, hits, prefetch quality, token check."""
    lines = [f"raw O_DIRECT {bandwidth['random_bps'] / 1e9:.2f} GB/s (random experts), "
             f"{bandwidth['sequential_bps'] / 1e9:.2f} GB/s (sequential)",
             f"{'config':>34} {'cache':>5} {'ms/tok':>7} {'x LRU':>6} {'/bound':>6} {'MB/tok':>7} "
             f"{'xbytes':>6} {'hit':>5} {'prec':>5} {'recall':>6} {'tokens':>6} {'dMB/tk':>6} {'/bnd-d':>6} "
             f"{'dstall':>6}"]

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in results:
        lines.append(f"{r['config']:>34} {r['cache'] or 'RAM':>5} {r['median_s'] * 1e3:7.1f} "
                     f"{fmt(r.get('speedup_vs_lru'), '6.2f')} {fmt(r.get('vs_bound'), '6.2f')} "
                     f"{fmt(r.get('bytes_read_per_token', 0) / 1e6, '7.1f')} "
                     f"{fmt(r.get('bytes_vs_lru'), '6.2f')} "
                     f"{fmt(r.get('hit_ratio'), '5.2f')} {fmt(r.get('prefetch_precision'), '5.2f')} "
                     f"{fmt(r.get('prefetch_recall'), '6.2f')} {str(r.get('tokens_match')):>6} "
                     f"{fmt(r.get('decode_bytes_per_token', 0) / 1e6, '6.1f')} "
                     f"{fmt(r.get('vs_bound_decode'), '6.2f')} "
                     f"{fmt(r.get('decode_stall_ms_per_token'), '6.1f')}")
    return "\n".join(lines)
