"""Bit-exactness against the unmodified HuggingFace model: every family x dtype x cache x policy pair.

For each tiny model routed with its real top-k (`moeinf.hf.tiny.REAL_TOP_K`) and each dtype, one store is
packed and one `from_pretrained` reference is loaded; then for every `device_cache` and every prefetch x
eviction pair an offloaded model computes the logits of a batch of two prompts of unequal length
(left-padded, with their attention mask) and generates greedily. A row is equal when the logits are
`torch.equal` and the tokens identical; otherwise it records the largest logit difference.

    moeinf bench exact                          # the whole cross product, table on stdout
    moeinf bench exact --models qwen3_moe-top8 --pairs default --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import EVICTION_POLICIES, PREFETCH_POLICIES, ConfigError, OffloadConfig
from ..hf.tiny import REAL_TOP_K, VOCAB_SIZE, save_tiny
from ..runtime import shared

log = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float32")
CACHES = ("min", "50%", "100%")
"""`min` is 10% of the experts, or top_k experts when 10% holds fewer."""


@dataclass
class Case:
    """One (model, dtype): its checkpoint, packed store, HF reference and the reference's outputs."""

    name: str
    dtype: str
    model_dir: Path
    store_dir: Path
    eamc: Path
    reference: Any
    seq2seq: bool
    inputs: dict[str, torch.Tensor]
    logits: torch.Tensor
    tokens: torch.Tensor


def batch_inputs(seq2seq: bool, lengths: tuple[int, int] = (11, 6), seed: int = 0) -> dict[str, torch.Tensor]:
    """Two prompts of unequal length, padded (left for decoders, right for Switch's encoder) with a mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)  # pad id 0
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        cols = slice(0, n) if seq2seq else slice(width - n, width)
        ids[row, cols] = torch.randint(3, VOCAB_SIZE, (n,), generator=gen)
        mask[row, cols] = 1
    return {"input_ids": ids, "attention_mask": mask}


def forward_logits(model: Any, inputs: dict[str, torch.Tensor], seq2seq: bool) -> torch.Tensor:
    extra = {"decoder_input_ids": torch.zeros((inputs["input_ids"].shape[0], 3), dtype=torch.long)} \
        if seq2seq else {}
    with torch.inference_mode():
        return model(**inputs, **extra).logits


def greedy(generate: Any, inputs: dict[str, torch.Tensor], new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        return generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def reference_model(model_dir: Path, dtype: str, seq2seq: bool) -> Any:
    """The unmodified `from_pretrained` model, with transformers' default experts implementation (its
    family's auto class: causal LM, seq2seq or multimodal LM)."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from ..spec import spec_for

    model_type = AutoConfig.from_pretrained(model_dir).model_type
    auto = AutoModelForSeq2SeqLM if seq2seq else spec_for(model_type).auto_class()
    return auto.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


def random_eamc(store_dir: Path, path: Path, entries: int = 6) -> Path:
    """An EAMC of random counts for the store's model (prefetch policies need one to plan from)."""
    from ..store import Store
    from ..trace.eamc import EAMC

    store = Store(store_dir)
    rng = np.random.default_rng(0)
    eams = rng.integers(0, 3, size=(entries, store.index.num_layers, store.index.num_experts))
    return EAMC(eams.astype(np.float32)).save(path, {"fingerprint": store.fingerprint})


def prepare(name: str, dtype: str, root: Path, new_tokens: int, sizes: dict[str, Any] | None = None) -> Case:
    """Build, pack and run the reference once for (model `name`, `dtype`); `sizes`: config fields that
    override the tiny model's (wider layers)."""
    from ..store import pack

    family, overrides = REAL_TOP_K[name]
    model_dir = save_tiny(family, root / f"{name}-{dtype}" / "model", dtype=dtype,
                          **{**overrides, **(sizes or {})})
    store_dir = model_dir.parent / "store"
    pack(model_dir, store_dir, progress=False)
    seq2seq = family == "switch_transformers"
    reference = reference_model(model_dir, dtype, seq2seq)
    inputs = batch_inputs(seq2seq)
    eamc = random_eamc(store_dir, model_dir.parent / "eamc.safetensors")
    return Case(name, dtype, model_dir, store_dir, eamc, reference, seq2seq, inputs,
                forward_logits(reference, inputs, seq2seq), greedy(reference.generate, inputs, new_tokens))


def cache_size(case: Case, cache: str) -> int | str:
    """`device_cache` for `cache`: "min" is 10% of the experts in bytes, at least top_k experts."""
    if cache != "min":
        return cache
    from ..store import Store

    store = Store(case.store_dir)
    slots = max(math.ceil(0.1 * len(store.index.experts)), store.index.top_k)
    return slots * store.max_blob_size


def compare(case: Case, cache: str, prefetch: str, eviction: str, new_tokens: int) -> dict[str, Any]:
    """Logits and greedy tokens of one offloaded configuration against the reference's."""
    from ..api import MoE

    config = OffloadConfig(offload_dir=str(case.store_dir), device_cache=cache_size(case, cache),
                           prefetch=prefetch, eviction=eviction, eamc=str(case.eamc))
    row = {"model": case.name, "dtype": case.dtype, "cache": cache, "prefetch": prefetch,
           "eviction": eviction}
    try:
        moe = MoE(case.model_dir, config)
    except ConfigError as exc:  # a policy this family cannot run (look-ahead without a runnable router)
        return row | {"refused": str(exc), "logits_equal": None, "tokens_equal": None, "max_logit_diff": None,
                      "misses": None, "early_shared_computed": None, "early_shared_served": None}
    with moe:
        tokens = greedy(moe.generate, case.inputs, new_tokens)
        logits = forward_logits(moe, case.inputs, case.seq2seq)
        stats = moe.stats()
        early = shared.counts(moe.model)
    diff = (logits.float() - case.logits.float()).abs().max().item()
    return row | {"logits_equal": torch.equal(logits, case.logits),
            "tokens_equal": torch.equal(tokens, case.tokens), "max_logit_diff": diff,
            "misses": stats["misses"], "early_shared_computed": early[0], "early_shared_served": early[1]}


def pairs(which: str) -> list[tuple[str, str]]:
    if which == "default":
        defaults = OffloadConfig()
        return [(defaults.prefetch, defaults.eviction)]
    return list(itertools.product(PREFETCH_POLICIES, EVICTION_POLICIES))


def run_all(models: list[str], dtypes: list[str], caches: list[str], policy_pairs: list[tuple[str, str]],
            root: Path, new_tokens: int) -> Iterator[dict[str, Any]]:
    for name, dtype in itertools.product(models, dtypes):
        case = prepare(name, dtype, root, new_tokens)
        for cache, (prefetch, eviction) in itertools.product(caches, policy_pairs):
            yield compare(case, cache, prefetch, eviction, new_tokens)


def table(rows: list[dict[str, Any]]) -> str:
    """model x dtype x cache: how many policy pairs were equal, and the largest logit difference."""
    lines = ["| model | dtype | cache | pairs equal (logits and tokens) | refused | max logit diff |",
             "|---|---|---|---|---|---|"]
    cells: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["model"], row["dtype"], row["cache"]), []).append(row)
    for (model, dtype, cache), group in cells.items():
        ran = [r for r in group if "refused" not in r]
        equal = sum(bool(r["logits_equal"] and r["tokens_equal"]) for r in ran)
        diff = max((r["max_logit_diff"] for r in ran), default=float("nan"))
        lines.append(f"| {model} | {dtype} | {cache} | {equal}/{len(ran)} | {len(group) - len(ran)} | "
                     f"{diff:.3g} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=",".join(REAL_TOP_K),
                        help=f"comma-separated tiny models (default: all of {', '.join(REAL_TOP_K)})")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="comma-separated dtypes (default: %(default)s)")
    parser.add_argument("--caches", default=",".join(CACHES),
                        help="comma-separated device_cache sizes; min = 10%% of the experts or top_k "
                             "(default: %(default)s)")
    parser.add_argument("--pairs", choices=("all", "default"), default="all",
                        help="prefetch x eviction pairs: all of them, or the default pair "
                             "(default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="greedy tokens compared (default: %(default)s)")
    parser.add_argument("--out", default=None, help="directory for exact.jsonl (default: none)")


def run(args: argparse.Namespace) -> int:
    from .common import machine

    models = args.models.split(",")
    unknown = sorted(set(models) - set(REAL_TOP_K))
    if unknown:
        raise SystemExit(f"moeinf bench exact: error: unknown --models {unknown}; "
                         f"choose from {list(REAL_TOP_K)}")
    header = {"bench": "exact", "config": {"models": models, "dtypes": args.dtypes, "caches": args.caches,
                                           "pairs": args.pairs, "new_tokens": args.new_tokens},
              "machine": machine(), "torch": torch.__version__}
    rows: list[dict[str, Any]] = []
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "exact.jsonl").write_text("")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moeinf-exact-") as root:
        rows_iter = run_all(models, args.dtypes.split(","), args.caches.split(","), pairs(args.pairs),
                            Path(root), args.new_tokens)
        for row in rows_iter:
            rows.append(row)
            log.info("%s", row)
            if out is not None:  # as it goes: a long run keeps what it measured
                with (out / "exact.jsonl").open("a") as f:
                    f.write(json.dumps({**header, **row}) + "\n")
            if "refused" in row:
                status = f"refused ({row['refused']})"
            elif row["logits_equal"] and row["tokens_equal"]:
                status = "equal"
            else:
                status = f"DIFF {row['max_logit_diff']:.3g}"
            print(f"[{time.perf_counter() - start:6.0f}s] {row['model']} {row['dtype']} {row['cache']} "
                  f"{row['prefetch']}/{row['eviction']}: {status}", flush=True)
    print(table(rows))
    return 0 if all(r["logits_equal"] and r["tokens_equal"] for r in rows if "refused" not in r) else 1
