"""Quantised expert stores: which kernel computes one expert fastest, and what quantisation costs in quality.

Kernels: one expert's forward (gate/up projection, SiLU gate, down projection) at Qwen3-30B-A3B expert
geometry (hidden 2048, expert intermediate 768, bf16 activations), for 1 and 8 routed tokens, with every
candidate for each format: bf16 `F.linear` (the exact store), int8 `_weight_int8pack_mm` or dequantise
to bf16 + `F.linear`, int4 `_weight_int4pack_mm_for_cpu` or dequantise + `F.linear`, and moeinf's own
GEMV (`moeinf.kernels.gemv`, where the CPU runs it), and on a CPU with AVX512_BF16 the exact store's bf16
kernel (`moeinf.kernels.bf16_rows`: F.linear's bits where verified, one row only). Candidates run
interleaved round by round (the machine is shared), each round on another of 24 experts so that weights
come from DRAM as a decoded token's do; medians reported.

Quality: the trained zoo model (bf16) on held-out prompts with their reference answers (never trained
on), chat-formatted: perplexity of the whole text, the share of positions whose top-1 token agrees with
the unquantised model's (teacher-forced), and greedy generation from the prompt: the share of generated
tokens equal to the unquantised model's at the same position, and the mean length of the common prefix.
The unquantised reference is the HF model itself (the exact store computes it bit for bit); the
quantised runs are moeinf with all experts resident (`device_cache` 100%).

  moeinf bench quant --model full --examples 20 --new-tokens 32
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..config import OffloadConfig
from ..kernels import bf16_rows, gemv
from .common import machine, median_round, refuse_counts, write_jsonl

HIDDEN, INTERMEDIATE = 2048, 768


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="full",
                        help="zoo variant (full, quick...) or a checkpoint directory (default: full)")
    parser.add_argument("--examples", type=int, default=20, help="held-out examples per held-out file")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens of each example scored")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    parser.add_argument("--group-size", type=int, default=32, help="int4 group size")
    parser.add_argument("--rounds", type=int, default=40, help="kernel timing rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--skip-kernels", action="store_true", help="only the quality part")
    parser.add_argument("--skip-quality", action="store_true", help="only the kernel part")
    parser.add_argument("--speed-model", default=None, metavar="DIR",
                        help="also decode this checkpoint offloaded from the exact, int8 and int4 stores at "
                             "the same DRAM budget (--cache of the exact store's expert bytes)")
    parser.add_argument("--cache", default="25%", help="with --speed-model: the DRAM budget, a share of the "
                                                       "exact store's expert bytes")
    parser.add_argument("--store-root", default=None,
                        help="with --speed-model: where the three stores live (default: next to the model)")
    parser.add_argument("--prompts", type=int, default=3, help="with --speed-model: measured prompts")
    parser.add_argument("--warmup", type=int, default=2, help="with --speed-model: warm-up prompts")
    parser.add_argument("--speed-tokens", type=int, default=16, help="with --speed-model: tokens per prompt")
    parser.add_argument("--speed-rounds", type=int, default=1,
                        help="with --speed-model: decode the three stores in turn this many times (exact, "
                             "int8, int4, exact, ...); each store's ms/token is the median of its rounds' "
                             "medians and each ratio the median of the rounds' ratios, so that a machine "
                             "whose speed drifts during the run weighs on every store alike (default: 1)")
    parser.add_argument("--quant-dense", default=OffloadConfig.quant_dense,
                        help="OffloadConfig.quant_dense of the quantised runs; a comma-separated list runs "
                             "each in the quality part (the speed part takes the first)")
    parser.add_argument("--quant-dense-kernel", default=OffloadConfig.quant_dense_kernel,
                        help="OffloadConfig.quant_dense_kernel of the quantised runs; a comma-separated "
                             "list runs each (quality part)")
    parser.add_argument("--quant-expert-kernel", default=OffloadConfig.quant_expert_kernel,
                        help="OffloadConfig.quant_expert_kernel of the quantised runs; a comma-separated "
                             "list runs each (quality part)")
    parser.add_argument("--quant-activations", default=OffloadConfig.quant_activations,
                        help="OffloadConfig.quant_activations of the quantised runs (float or int8 rows in "
                             "the experts' GEMV); a comma-separated list runs each (quality part)")
    parser.add_argument("--attention-linears", default=OffloadConfig.attention_linears,
                        help="OffloadConfig.attention_linears of the quantised runs; a comma-separated list "
                             "runs each (with each --quant-dense) in the quality part (the speed part takes "
                             "the first)")
    parser.add_argument("--out", default=None, help="also write the JSON lines to this file")
    parser.add_argument("--seed", type=int, default=0)


# --- kernels -----------------------------------------------------------------------------------------
def _expert(up: Callable[[torch.Tensor], torch.Tensor],
            down: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, value = up(x).chunk(2, dim=-1)
        return down(F.silu(gate) * value)

    return forward


def kernel_candidates(group: int, seed: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """One expert's forward for each candidate kernel, over the same random bf16 expert."""
    from moeinf.store.quant import Quantization, quantise

    gen = torch.Generator().manual_seed(seed)
    w_up = (torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.02).bfloat16()  # [2I, H]
    w_down = (torch.randn(HIDDEN, INTERMEDIATE, generator=gen) * 0.02).bfloat16()  # [H, I]
    int8, int4 = Quantization.of("int8"), Quantization.of("int4", group)
    q8 = {name: quantise(w, int8) for name, w in (("up", w_up), ("down", w_down))}
    q4 = {name: quantise(w, int4) for name, w in (("up", w_up), ("down", w_down))}
    # int4 values unpacked for the dequantising candidate: [N, K] in 0..15 with [N, K/G] scale and zero
    raw4 = {name: _unpacked_int4(w, group) for name, w in (("up", w_up), ("down", w_down))}

    def int8_mm(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, q8[name]["qweight"], q8[name]["scales"])

    def int8_dequant(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        q, s = q8[name]["qweight"], q8[name]["scales"]
        return lambda x: F.linear(x, q.to(torch.bfloat16) * s[:, None])

    def int4_mm(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        q, s = q4[name]["qweight"], q4[name]["scales"]
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, group, s)

    def int4_dequant(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        q, scale, zero = raw4[name]
        rows, cols = q.shape

        def linear(x: torch.Tensor) -> torch.Tensor:
            w = q.view(rows, cols // group, group).to(torch.bfloat16) - 8
            return F.linear(x, (w * scale[..., None] + zero[..., None]).view(rows, cols))

        return linear

    candidates = {
        "bf16 F.linear": _expert(lambda x: F.linear(x, w_up), lambda x: F.linear(x, w_down)),
        "int8 _weight_int8pack_mm": _expert(int8_mm("up"), int8_mm("down")),
        "int8 dequantise + F.linear": _expert(int8_dequant("up"), int8_dequant("down")),
        f"int4 _weight_int4pack_mm_for_cpu (group {group})": _expert(int4_mm("up"), int4_mm("down")),
        f"int4 dequantise + F.linear (group {group})": _expert(int4_dequant("up"), int4_dequant("down")),
    }
    if bf16_rows.available():  # the exact store's product where verified (torch's bits), else F.linear
        candidates["bf16 moeinf kernel (F.linear's bits)"] = _expert(
            lambda x: bf16_rows.linear(x, w_up, split=True),
            lambda x: bf16_rows.linear(x, w_down, split=True))
    for rows, label in ((False, ""), (True, ", int8 rows")):
        if gemv.available():
            candidates[f"int8 moeinf gemv{label}"] = _expert(
                *(partial(_int8_gemv, q8[name], rows) for name in ("up", "down")))
        if gemv.available() and gemv.int4_layout_matches():
            candidates[f"int4 moeinf gemv (group {group}){label}"] = _expert(
                *(partial(_int4_gemv, q4[name], group, rows) for name in ("up", "down")))
    return candidates


def _int8_gemv(parts: dict[str, torch.Tensor], int8_activations: bool, x: torch.Tensor) -> torch.Tensor:
    return gemv.int8_gemv(x, parts["qweight"], parts["scales"], int8_activations=int8_activations)


def _int4_gemv(parts: dict[str, torch.Tensor], group: int, int8_activations: bool,
               x: torch.Tensor) -> torch.Tensor:
    return gemv.int4_gemv(x, parts["qweight"], parts["scales"], group, int8_activations=int8_activations)


def _unpacked_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    grouped = weight.float().view(rows, cols // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    zero = low + 8 * scale
    q = torch.round((grouped - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.uint8)
    return q.view(rows, cols), scale.bfloat16(), zero.bfloat16()


def time_kernels(group: int, rounds: int, seed: int, experts: int = 24) -> list[dict[str, Any]]:
    """Each candidate's median time for one expert's forward, round after round on the next of `experts`
    different experts (24 bf16 experts are 226 MB): a decoded token's experts come from DRAM, not from a
    cache that has just read them."""
    sets = [kernel_candidates(group, seed + i) for i in range(experts)]
    results = []
    with torch.inference_mode():
        for tokens in (1, 8):
            x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).bfloat16()
            times: dict[str, list[float]] = {name: [] for name in sets[0]}
            for candidates in sets[:3]:
                for f in candidates.values():
                    f(x)
            for round_ in range(rounds):
                for name, f in sets[round_ % experts].items():
                    start = time.perf_counter()
                    f(x)
                    times[name].append(time.perf_counter() - start)
            base = statistics.median(times["bf16 F.linear"])
            for name, values in times.items():
                median = statistics.median(values)
                results.append({"bench": "quant-kernel", "kernel": name, "tokens": tokens,
                                "median_ms": median * 1e3, "vs_bf16": median / base,
                                "hidden": HIDDEN, "intermediate": INTERMEDIATE})
    return results


# --- quality -----------------------------------------------------------------------------------------
def heldout_texts(per_file: int, seed: int) -> list[tuple[str, str]]:
    """(prompt text, prompt + reference answer text) of held-out examples that have a reference answer."""
    from moeinf.zoo.corpus import heldout_prompts
    from moeinf.zoo.tokenizer import chat_text

    examples = [ex for ex in heldout_prompts(None, seed=seed) if ex.answer]
    by_task: dict[str, list[Any]] = {}
    for ex in examples:
        by_task.setdefault(ex.task, []).append(ex)
    chosen = [ex for group in by_task.values() for ex in group[:per_file]]
    return [(chat_text(ex.prompt), chat_text(ex.prompt, ex.answer)) for ex in chosen]


def score(forward: Callable[[torch.Tensor], torch.Tensor], generate: Callable[..., torch.Tensor],
          encoded: list[tuple[torch.Tensor, torch.Tensor]], new_tokens: int) -> dict[str, Any]:
    """NLL sum, token count, per-example top-1 tokens and greedy continuations of one model."""
    nll, count, top1, greedy = 0.0, 0, [], []
    with torch.inference_mode():
        for prompt, full in encoded:
            logits = forward(full).float()[0, :-1]  # [T-1, V]
            targets = full[0, 1:]
            nll += F.cross_entropy(logits, targets, reduction="sum").item()
            count += targets.numel()
            top1.append(logits.argmax(-1))
            out = generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False)
            greedy.append(out[0, prompt.shape[1]:])
    return {"nll": nll, "tokens": count, "top1": top1, "greedy": greedy}


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    agree = sum(int((a == b).sum()) for a, b in zip(run["top1"], ref["top1"], strict=True))
    total = sum(a.numel() for a in ref["top1"])
    same = sum(int((a == b).sum()) for a, b in zip(run["greedy"], ref["greedy"], strict=True))
    generated = sum(a.numel() for a in ref["greedy"])
    prefixes = []
    for a, b in zip(run["greedy"], ref["greedy"], strict=True):
        diff = (a != b).nonzero()
        prefixes.append(int(diff[0]) if len(diff) else a.numel())
    ppl = math.exp(run["nll"] / run["tokens"])
    return {"perplexity": ppl, "ppl_ratio": ppl / math.exp(ref["nll"] / ref["tokens"]),
            "top1_agreement": agree / total, "greedy_token_agreement": same / generated,
            "greedy_common_prefix": statistics.mean(prefixes)}


def quality(model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moeinf import MoE, OffloadConfig
    from moeinf.store import Store

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    texts = heldout_texts(args.examples, args.seed)
    encoded = [(tokenizer(p, add_special_tokens=False, return_tensors="pt").input_ids,
                tokenizer(f, add_special_tokens=False, return_tensors="pt").input_ids[:, : args.max_tokens])
               for p, f in texts]
    print(f"scoring {len(encoded)} held-out examples ({sum(f.shape[1] for _, f in encoded)} tokens)...",
          file=sys.stderr, flush=True)
    ref_model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    ref = score(lambda ids: ref_model(ids).logits, ref_model.generate, encoded, args.new_tokens)
    dtype = str(next(ref_model.parameters()).dtype).removeprefix("torch.")
    rows = [{"bench": "quant-quality", "store": "exact (HF)", "dtype": dtype,
             "perplexity": math.exp(ref["nll"] / ref["tokens"]), "ppl_ratio": 1.0, "top1_agreement": 1.0,
             "greedy_token_agreement": 1.0, "greedy_common_prefix": float(args.new_tokens)}]
    with tempfile.TemporaryDirectory(prefix="moeinf-quant-") as scratch:
        for scheme in ("int8", "int4"):
            store_dir = Path(scratch) / scheme
            if scheme == "int4":
                from moeinf.store import pack
                from moeinf.store.quant import Quantization

                pack(model_dir, store_dir, quant=Quantization.of("int4", args.group_size), progress=False)
            for dense, kernel, experts, wide, rows_in in itertools.product(settings(args.quant_dense),
                                                                           settings(args.quant_dense_kernel),
                                                                           settings(args.quant_expert_kernel),
                                                                           settings(args.attention_linears),
                                                                           settings(args.quant_activations)):
                if scheme == "int4" and experts in ("dynamic-int8", "prepacked-int8"):
                    continue  # int8-only kernels
                config = OffloadConfig(offload_dir=str(store_dir), quant=scheme, quant_dense=dense,
                                       quant_dense_kernel=kernel, quant_expert_kernel=experts,
                                       attention_linears=wide, quant_activations=rows_in, device_cache=1.0)
                with MoE(model_dir, config) as moe:
                    run = score(lambda ids, moe=moe: moe(ids).logits, moe.generate, encoded, args.new_tokens)
                    store = Store(store_dir)
                    rows.append({"bench": "quant-quality", "store": store.index.quant["scheme"],
                                 "group_size": store.index.quant["group_size"], "quant_dense": dense,
                                 "quant_dense_kernel": kernel, "quant_expert_kernel": experts,
                                 "attention_linears": wide, "quant_activations": rows_in,
                                 "dtype": dtype, "expert_bytes": store.expert_bytes, **compare(run, ref)})
    for row in rows:
        row.update(model=str(model_dir), examples=len(encoded), tokens=ref["tokens"],
                   new_tokens=args.new_tokens)
    return rows


def settings(text: str) -> list[str]:
    """The values of a comma-separated option."""
    return [d.strip() for d in text.split(",") if d.strip()]


# --- speed ---------------------------------------------------------------------------------------------
def speed_inputs(model_dir: Path, count: int, max_tokens: int = 64) -> list[torch.Tensor]:
    """[1, P] ids of `count` benchmark prompts, by the model's tokenizer (byte fallback without one)."""
    from moeinf.hf.tokenizer import load_tokenizer

    from .e2e import load_prompts

    tokenizer, _ = load_tokenizer(model_dir)
    return [torch.tensor([tokenizer.encode(text)[:max_tokens]]) for text in load_prompts(count)]


def speed(model_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Decode from the exact, int8 and int4 stores with the same DRAM budget in bytes."""
    from moeinf.builder import default_offload_dir
    from moeinf.config import resolve_bytes
    from moeinf.store import Store, pack
    from moeinf.store.quant import Quantization

    from .decode_profile import profile_decode

    root = Path(args.store_root) if args.store_root else model_dir.parent
    stores = {"exact": None, "int8": Quantization.of("int8"),
              "int4": Quantization.of("int4", args.group_size)}
    # The runtime's default store names, so that an exact store packed by `moeinf bench e2e` is shared.
    dirs = {name: root / default_offload_dir(model_dir, "none" if quant is None else quant.scheme).name
            for name, quant in stores.items()}
    for name, quant in stores.items():
        print(f"packing the {name} store of {model_dir}...", file=sys.stderr, flush=True)
        pack(model_dir, dirs[name], quant=quant, progress=sys.stderr.isatty())
    budget = resolve_bytes(args.cache, Store(dirs["exact"]).expert_bytes, field="--cache")
    inputs = speed_inputs(model_dir, args.warmup + args.prompts)
    rounds = args.speed_rounds
    configs = {name: speed_config(args, dirs[name], budget) for name in stores}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in stores}
    for turn in range(rounds):
        for name, config in configs.items():
            of = f" (round {turn + 1} of {rounds})" if rounds > 1 else ""
            print(f"decoding from the {name} store with {budget} bytes of experts{of}...", file=sys.stderr,
                  flush=True)
            results[name].append(profile_decode(model_dir, config, inputs[: args.warmup],
                                                inputs[args.warmup:], args.speed_tokens))
    rows = []
    for name, runs in results.items():
        config = configs[name]
        medians = [run["median_ms"] for run in runs]
        ratios = [exact["median_ms"] / run["median_ms"]
                  for exact, run in zip(results["exact"], runs, strict=True)]
        # the details (parts, stats, tokens) are those of the round whose median is the median
        middle = median_round(runs, "median_ms")
        rows.append({"bench": "quant-speed", "store": name, "cache": args.cache, "budget_bytes": budget,
                     "quant_dense": None if stores[name] is None else config.quant_dense,
                     "attention_linears": config.attention_linears,
                     "quant_activations": None if stores[name] is None else config.quant_activations,
                     "slots": budget // middle["slot_bytes"], "model": str(model_dir),
                     "prompts": args.prompts, "new_tokens": args.speed_tokens, **middle,
                     "median_ms": statistics.median(medians), "rounds": rounds, "round_median_ms": medians,
                     "round_speedups": ratios, "speedup": statistics.median(ratios)})
    return rows


def speed_config(args: argparse.Namespace, store_dir: Path, budget: int) -> Any:
    """The `OffloadConfig` of one store's speed run (the first value of each comma-separated option)."""
    from moeinf import OffloadConfig

    return OffloadConfig(offload_dir=str(store_dir), device_cache=budget,
                         quant_dense=settings(args.quant_dense)[0],
                         quant_dense_kernel=settings(args.quant_dense_kernel)[0],
                         quant_expert_kernel=settings(args.quant_expert_kernel)[0],
                         attention_linears=settings(args.attention_linears)[0],
                         quant_activations=settings(args.quant_activations)[0])


def run(args: argparse.Namespace) -> int:
    refuse_counts("quant", args, positive=("examples", "max_tokens", "new_tokens", "group_size", "rounds",
                                           "threads", "prompts", "speed_tokens", "speed_rounds"),
                  non_negative=("warmup",))
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    lines: list[dict[str, Any]] = []
    if not args.skip_kernels:
        print("timing one expert's forward per kernel...", file=sys.stderr, flush=True)
        lines += time_kernels(args.group_size, args.rounds, args.seed)
    if not args.skip_quality:
        from moeinf.hub import resolve_model

        try:
            model_dir = resolve_model(args.model).path
        except ValueError as exc:
            print(f"moeinf bench quant: error: --model: {exc}", file=sys.stderr)
            return 2
        lines += quality(model_dir, args)
    if args.speed_model:
        if args.speed_rounds < 1:
            print(f"moeinf bench quant: error: --speed-rounds must be >= 1, got {args.speed_rounds}",
                  file=sys.stderr)
            return 2
        lines += speed(Path(args.speed_model), args)
    header = {"machine": machine(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    if args.out:
        write_jsonl(Path(args.out), lines, header)
    for line in lines:
        print(json.dumps({**header, **line}))
    for line in lines:
        if line["bench"] == "quant-speed":
            parts = ", ".join(f"{k} {v:.1f}" for k, v in line["parts_ms"].items())
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in line["cpu_parts_ms"].items())
            print(f"  {line['store']:>6} @ {line['cache']} ({line['slots']} slots): "
                  f"{line['median_ms']:7.1f} ms/token (x{line['speedup']:.2f} vs exact; hit rate "
                  f"{line['stats']['hit_rate']:.2f}; mean ms: {parts}; CPU ms of the decoding thread: "
                  f"{cpu})")
        elif line["bench"] == "quant-kernel":
            print(f"  {line['tokens']} token(s) {line['kernel']:>45}: {line['median_ms']:7.3f} ms "
                  f"(x{line['vs_bf16']:.2f} of bf16)")
        else:
            dense = f" + dense {line['quant_dense']}" if "quant_dense" in line else ""
            dense += f" ({line['quant_dense_kernel']})" if "quant_dense_kernel" in line else ""
            dense += f" + experts {line['quant_expert_kernel']}" if "quant_expert_kernel" in line else ""
            dense += f" + attention {line['attention_linears']}" if "attention_linears" in line else ""
            dense += f" + rows {line['quant_activations']}" if "quant_activations" in line else ""
            print(f"  {line['store'] + dense:>40}: perplexity {line['perplexity']:.4f} "
                  f"(x{line['ppl_ratio']:.4f}), "
                  f"top-1 agreement {line['top1_agreement']:.1%}, greedy tokens "
                  f"{line['greedy_token_agreement']:.1%} (common prefix {line['greedy_common_prefix']:.1f})")
    return 0
