"""Slot recall and precision of every prefetch predictor, measured live on a model (`bench prefetch --model`).

The model generates greedily on two disjoint sets of the zoo's held-out prompts (never trained on), traced
as `moeinf trace` does with every token's router input (`moeinf.trace.collect`, `hidden=True`): the
*train* set builds what predictors learn from (the EAMC, the popularity prior, the learned look-ahead
maps), the *test* set is measured. For each token, MoE layer l and depth d (1..--depth), a predictor names
the experts it expects at layer l+d for that token: the experts whose predicted chance reaches
--threshold, plus its most likely one (`moeinf.trace.lookahead_fit.slot_quality`). Slot recall = routed
slots named / routed slots; precision = named experts routed / named experts.

Predictors (a predictor is `(layer, depth, hidden [N, H], routed [N, k]) -> chances [N, E]`, from layer l's
router input and the experts layer l routed each token to: adding one is one entry in `predictors`):

- none: names nothing (recall 0);
- topk: the sequence's own experts so far, chance = top_k x the expert's share of layer l+d in the
  EAM of the tokens before this one;
- traced-topk: the same share in the popularity of the train set;
- activation-aware: the same share in the EAM that the EAMC (built on the train set) matches to the
  sequence's EAM so far (Eq. 1, every layer observed);
- lookahead-router: layer l+d's own router run on layer l's router input (no training);
- lookahead-learned: the learned predictor (`moeinf.trace.lookahead_fit`: an MLP per layer over the layer's
  router input and its routing) fit on the train set, as `moeinf trace` and `moeinf bench e2e` fit it;
- router+learned: the higher of the two chances (the router's top-k, and the learned map's);
- hybrid: the learned maps up to the runtime's look-ahead depth, deeper layers from the mean share in
  the sequence EAM, the matched EAM and the prior (`moeinf.policy.lookahead`);
- next token: lookahead-learned / traced-topk: judged only where l+d lies past the last layer, against the
  NEXT token's layer l+d-L (learned maps fit to wrap, `lookahead_fit.fit(wrap=True)`, which the runtime
  does not use by default): how well the last layers of a decode step name the next step's first reads,
  against popularity (a sequence's last token has no next token and is left out).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

NEXT_TOKEN = "next token: "
"""Prefix of the rows judged on the depths past the last layer (the next token's first layers)."""

Predict = Callable[[int, int, torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]


def traced(model_dir: Path, texts: list[str], new_tokens: int, max_prompt_tokens: int, seed: int) -> Any:
    """`moeinf.trace.collect.collect` of the chat-formatted `texts`, with router inputs."""
    from moeinf.trace.collect import Prompt, collect
    from moeinf.zoo.tokenizer import chat_text

    prompts = [Prompt(f"p{i}", "heldout", chat_text(t), "zoo-heldout") for i, t in enumerate(texts)]
    return collect(model_dir, prompts, max_new_tokens=new_tokens, max_prompt_tokens=max_prompt_tokens,
                   seed=seed, progress=False, hidden=True)


def prefix_counts(ids: np.ndarray, sequence: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, L, E]: per token, the routed-slot counts of the earlier tokens of its sequence (its EAM so far).

    `ids` [N, L, k] in each sequence's token order; `sequence` [N]."""
    from moeinf.trace.lookahead_fit import multi_hot

    n, layers, _ = ids.shape
    hot = np.stack([multi_hot(ids[:, layer], num_experts) for layer in range(layers)], axis=1)  # [N, L, E]
    out = np.zeros_like(hot)
    for seq in np.unique(sequence):
        rows = np.flatnonzero(sequence == seq)
        running = np.cumsum(hot[rows], axis=0)
        out[rows[1:]] = running[:-1]
    return out


def shares(counts: np.ndarray, top_k: int) -> np.ndarray:
    """min(top_k x share of each expert in its layer, 1) over the last axis."""
    sums = counts.sum(axis=-1, keepdims=True)
    share = np.divide(counts, sums, out=np.zeros(counts.shape, dtype=np.float64), where=sums > 0)
    return np.minimum(top_k * share, 1.0)


def per_layer(chances: np.ndarray) -> Predict:
    """A predictor from precomputed chances [N, L, E] of the test tokens (independent of the source layer)."""
    return lambda layer, depth, hidden, routed: torch.from_numpy(chances[:, layer + depth].astype(np.float32))


def predictors(model_dir: Path, train: Any, test: Any, *, depth: int, hybrid_depth: int,
               seed: int) -> dict[str, Predict]:
    """name -> predictor of the test tokens' experts, each built from the train trace only."""
    from moeinf.trace import lookahead_fit
    from moeinf.trace.collect import build_eamc

    top_k, experts = test.top_k, test.num_experts
    records = test.hidden
    so_far = prefix_counts(records.ids, records.sequence, experts)  # [N, L, E]
    eamc = build_eamc(train, capacity=min(len(train.prompts), 300), seed=seed)
    matched = np.stack([eamc.match(partial)[1] for partial in so_far])  # [N, L, E]
    prior = train.eams.sum(axis=0)  # [L, E]
    maps = lookahead_fit.fit(train.hidden, experts, max(depth, hybrid_depth), seed=seed)
    wrapping = lookahead_fit.fit(train.hidden, experts, depth, seed=seed, wrap=True)

    def hybrid(layer: int, d: int, hidden: torch.Tensor, routed: torch.Tensor | None) -> torch.Tensor | None:
        if d <= hybrid_depth:
            return maps.predict(layer, d, hidden, routed)
        sources = [shares(so_far[:, layer + d], 1), shares(matched[:, layer + d], 1),
                   np.broadcast_to(shares(prior[layer + d], 1), so_far[:, 0].shape)]
        return torch.from_numpy(np.minimum(top_k * np.mean(sources, axis=0), 1.0).astype(np.float32))

    router = router_predictor(model_dir, experts)
    layers = prior.shape[0]
    popular = shares(prior, top_k)  # [L, E]
    return {
        "none": lambda layer, d, hidden, routed: torch.zeros((hidden.shape[0], experts)),
        "topk": per_layer(shares(so_far, top_k)),
        "traced-topk": per_layer(np.broadcast_to(shares(prior, top_k), so_far.shape)),
        "activation-aware": per_layer(shares(matched, top_k)),
        "lookahead-router": router,
        "lookahead-learned": maps.predict,
        "router+learned": lambda layer, d, hidden, routed: both(router(layer, d, hidden, routed),
                                                                maps.predict(layer, d, hidden, routed)),
        "hybrid": hybrid,
        # the depths that wrap past the last layer: the NEXT token's first layers, from this token's last
        # layers (`slot_quality(wrap=True)`), against what the runtime had there before: popularity
        NEXT_TOKEN + "lookahead-learned": wrapping.predict,
        NEXT_TOKEN + "traced-topk": lambda layer, d, hidden, routed: torch.from_numpy(np.ascontiguousarray(
            np.broadcast_to(popular[(layer + d) % layers], (hidden.shape[0], experts)), dtype=np.float32)),
    }


def both(*chances: torch.Tensor | None) -> torch.Tensor | None:
    """The higher chance of the predictors that predict (None when none does)."""
    present = [c.float() for c in chances if c is not None]
    return torch.stack(present).amax(dim=0) if present else None


def router_predictor(model_dir: Path, num_experts: int) -> Predict:
    """The model's own routers of later layers, run on the current layer's router input."""
    from moeinf.runtime.lookahead import RouterPredictor, find_routers
    from moeinf.spec import spec_for
    from moeinf.trace.collect import load_model

    model = load_model(model_dir)
    spec = spec_for(model.config.model_type)
    import re

    pattern = re.compile(spec.experts_module)
    names = [name for name, _ in model.named_modules() if pattern.fullmatch(name)]
    routers = find_routers(model, spec, names)
    if routers is None:
        raise ValueError(f"{model_dir}: the routers of this family cannot be run alone")
    dtype = next(model.parameters()).dtype
    predict = RouterPredictor(routers, num_experts)
    return lambda layer, d, hidden, routed: predict(layer, d, hidden.to(dtype))


def measure(model_dir: Path, *, train_prompts: int, test_prompts: int, new_tokens: int, depth: int,
            threshold: float, max_prompt_tokens: int,
            seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows (predictor, depth, recall, precision) and a header describing the run."""
    from moeinf.bench.e2e import heldout_texts
    from moeinf.config import OffloadConfig
    from moeinf.trace.lookahead_fit import slot_quality

    started = time.perf_counter()
    texts = heldout_texts(train_prompts + test_prompts, seed)
    train = traced(model_dir, texts[test_prompts:], new_tokens, max_prompt_tokens, seed)
    test = traced(model_dir, texts[:test_prompts], new_tokens, max_prompt_tokens, seed)
    hybrid_depth = int(getattr(OffloadConfig(), "lookahead_depth", 1))
    rows = []
    for name, predict in predictors(model_dir, train, test, depth=depth, hybrid_depth=hybrid_depth,
                                    seed=seed).items():
        if name == "none":
            rows.extend({"predictor": name, "depth": d, "recall": 0.0, "precision": None}
                        for d in range(1, depth + 1))
            continue
        quality = slot_quality(predict, test.hidden, test.num_experts, depth, threshold,
                               wrap=name.startswith(NEXT_TOKEN))
        rows.extend({"predictor": name, "depth": d, "recall": round(q["recall"], 4),
                     "precision": round(q["precision"], 4)} for d, q in sorted(quality.items()))
        log.info("%s: %s", name, quality)
    header = {"bench": "prefetch", "mode": "live", "model_dir": str(model_dir), "threshold": threshold,
              "train_prompts": train_prompts, "test_prompts": test_prompts, "new_tokens": new_tokens,
              "train_tokens": int(len(train.hidden.ids)), "test_tokens": int(len(test.hidden.ids)),
              "num_layers": test.num_layers, "num_experts": test.num_experts, "top_k": test.top_k,
              "hybrid_depth": hybrid_depth, "seconds": round(time.perf_counter() - started, 1)}
    return rows, header


def cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return f"{'':>16}"
    precision = "-" if row["precision"] is None else format(row["precision"], ".3f")
    return f"{row['recall']:>8.3f} / {precision:>5}"


def table(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """Recall / precision per predictor (rows) and depth (columns)."""
    depths = sorted({r["depth"] for r in rows})
    names = list(dict.fromkeys(r["predictor"] for r in rows))
    width = max(map(len, names + ["predictor"]))
    lines = [f"slot recall / precision on {header['test_tokens']} tokens of {header['test_prompts']} "
             f"held-out prompts ({header['model_dir']}, threshold {header['threshold']})",
             f"{'predictor':>{width}}" + "".join(f"{'depth ' + str(d):>16}" for d in depths)]
    for name in names:
        cells = {r["depth"]: r for r in rows if r["predictor"] == name}
        lines.append(f"{name:>{width}}" + "".join(cell(cells.get(d)) for d in depths))
    return "\n".join(lines)


def plot(path: Path, rows: list[dict[str, Any]], header: dict[str, Any]) -> None:
    """Recall and precision against depth, one line per predictor."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    figure = Figure(figsize=(11, 4))
    for axes, key in zip(figure.subplots(1, 2), ("recall", "precision"), strict=True):
        for name in dict.fromkeys(r["predictor"] for r in rows):
            points = [r for r in rows if r["predictor"] == name and r[key] is not None]
            if points:
                axes.plot([r["depth"] for r in points], [r[key] for r in points], marker="o", label=name)
        axes.set_xlabel("look-ahead depth (layers)")
        axes.set_ylabel(f"slot {key}")
        axes.set_ylim(0, 1)
        axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.suptitle(f"prefetch predictors on {Path(header['model_dir']).name}, held-out prompts")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train-prompts", type=int, default=80,
                        help="with --model: prompts traced to build the predictors")
    parser.add_argument("--test-prompts", type=int, default=40,
                        help="with --model: held-out prompts measured")
    parser.add_argument("--new-tokens", type=int, default=32,
                        help="with --model: tokens generated per prompt")
    parser.add_argument("--depth", type=int, default=3, help="with --model: look-ahead depths 1..DEPTH")
    parser.add_argument("--threads", type=int, default=1,
                        help="with --model: torch threads (default 1: 2 are slower on a busy 2-core machine)")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="with --model: a predictor names the experts whose chance reaches this")
