"""The learned look-ahead predictor: per (layer l, depth d) a linear map from layer l's router input to
the chance that each expert of layer l+d serves the same token, fit with a BCE loss on traced tokens.

`moeinf trace` records, for every real token, the router input (the hidden state the MoE block hands its
experts) and the experts chosen at every MoE layer (`HiddenRecords`). `fit` trains the maps on the CPU in
seconds (full-batch Adam; a linear model needs nothing more), `save`/`load` keep them in safetensors
beside the EAMC (`predictor_path`), and `slot_quality` measures them, or the routers of later layers run
on the same hidden states, on held-out prompts as slot recall and precision.

File: tensors "weight.{l}.{d}" [E, H] and "bias.{l}.{d}" [E] (float32), JSON metadata under "moeinf":
format, version, fingerprint, num_layers, num_experts, top_k, hidden_size, depth, tokens, threshold.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

FORMAT = "moeinf-lookahead"
VERSION = 1


@dataclass
class HiddenRecords:
    """Traced tokens: router inputs `hidden` [N, L, H] float32, chosen experts `ids` [N, L, k] (-1 = none)
    and the prompt each token belongs to, `sequence` [N] (held-out splits are by prompt)."""

    hidden: np.ndarray
    ids: np.ndarray
    sequence: np.ndarray

    def __post_init__(self) -> None:
        n, layers = self.hidden.shape[:2]
        if self.ids.shape[:2] != (n, layers) or self.sequence.shape != (n,):
            raise ValueError(f"hidden records disagree: hidden {self.hidden.shape}, ids {self.ids.shape}, "
                             f"sequence {self.sequence.shape}")

    def split(self, held_out: float, seed: int = 0) -> tuple[HiddenRecords, HiddenRecords]:
        """(train, test): a `held_out` share of the prompts (at least one) goes to test."""
        prompts = np.unique(self.sequence)
        if len(prompts) < 2:
            raise ValueError("a held-out split needs at least two traced prompts")
        rng = np.random.default_rng(seed)
        count = min(max(1, round(held_out * len(prompts))), len(prompts) - 1)
        test = np.isin(self.sequence, rng.choice(prompts, count, replace=False))
        return self.take(~test), self.take(test)

    def take(self, rows: np.ndarray) -> HiddenRecords:
        return HiddenRecords(self.hidden[rows], self.ids[rows], self.sequence[rows])


def multi_hot(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, E] float32, 1 where the expert is among a token's `ids` [N, k] (entries outside [0, E) skipped)."""
    out = np.zeros((ids.shape[0], num_experts), dtype=np.float32)
    rows, slots = np.nonzero((ids >= 0) & (ids < num_experts))
    out[rows, ids[rows, slots]] = 1.0
    return out


@dataclass
class LearnedMaps:
    """The fitted maps: `weight[(l, d)]` [E, H], `bias[(l, d)]` [E]; `predict` gives chances [T, E]."""

    weight: dict[tuple[int, int], torch.Tensor]
    bias: dict[tuple[int, int], torch.Tensor]
    meta: dict[str, Any]

    @property
    def depth(self) -> int:
        return int(self.meta["depth"])

    def predict(self, layer: int, depth: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """Chances [T, E] of layer `layer + depth` from layer `layer`'s router input [T, H] (None: no map)."""
        weight = self.weight.get((layer, depth))
        if weight is None:
            return None
        x = hidden.to("cpu", torch.float32)  # the maps stay on the CPU
        logits = torch.nn.functional.linear(x, weight, self.bias[(layer, depth)])
        return torch.sigmoid(logits)  # [T, E]


def fit(records: HiddenRecords, num_experts: int, depth: int, *, steps: int = 200, lr: float = 0.02,
        weight_decay: float = 1e-4, max_tokens: int = 20000, seed: int = 0) -> LearnedMaps:
    """Linear maps for every (layer, depth <= `depth`), fit by full-batch Adam on the BCE loss.

    The maps of one source layer are trained as one `Linear(H, D * E)` (one GEMM per step for all its
    depths); at most `max_tokens` tokens, drawn at random, are used: more adds seconds, not recall.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    n, layers, hidden_size = records.hidden.shape
    if n == 0:
        raise ValueError("no traced token to fit the look-ahead predictor on")
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n, generator=generator)[:max_tokens].sort().values.numpy()
    weights: dict[tuple[int, int], torch.Tensor] = {}
    biases: dict[tuple[int, int], torch.Tensor] = {}
    for layer in range(layers - 1):
        depths = range(1, min(depth, layers - 1 - layer) + 1)
        x = torch.from_numpy(np.ascontiguousarray(records.hidden[rows, layer], dtype=np.float32))  # [N, H]
        y = torch.from_numpy(np.concatenate([multi_hot(records.ids[rows, layer + d], num_experts)
                                             for d in depths], axis=1))  # [N, D*E]
        linear = torch.nn.Linear(hidden_size, y.shape[1])
        with torch.no_grad():
            linear.weight.normal_(0.0, hidden_size ** -0.5, generator=generator)
            linear.bias.zero_()
        optimizer = torch.optim.Adam(linear.parameters(), lr=lr, weight_decay=weight_decay)
        for _ in range(steps):
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(linear(x), y)
            loss.backward()
            optimizer.step()
        log.debug("look-ahead maps of layer %d: BCE %.4f", layer, loss.item())
        for i, d in enumerate(depths):
            rows_of_d = slice(i * num_experts, (i + 1) * num_experts)
            weights[(layer, d)] = linear.weight.detach()[rows_of_d].clone()
            biases[(layer, d)] = linear.bias.detach()[rows_of_d].clone()
    meta = {"num_layers": layers, "num_experts": num_experts, "hidden_size": hidden_size, "depth": depth,
            "tokens": len(rows), "top_k": int(records.ids.shape[2])}
    return LearnedMaps(weights, biases, meta)


def predictor_path(eamc_path: str | Path) -> Path:
    """Where the learned predictor of an EAMC file lives: `X.eamc` -> `X.lookahead.safetensors`."""
    path = Path(eamc_path)
    return path.with_name(path.stem + ".lookahead.safetensors")


def save(maps: LearnedMaps, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
    from safetensors.torch import save_file

    full = dict(maps.meta, **(meta or {}), format=FORMAT, version=VERSION)
    tensors = {f"weight.{layer}.{d}": w.contiguous() for (layer, d), w in maps.weight.items()}
    tensors.update({f"bias.{layer}.{d}": b.contiguous() for (layer, d), b in maps.bias.items()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"moeinf": json.dumps(full)})
    tmp.replace(path)
    return path


def load(path: str | Path, fingerprint: str | None = None) -> LearnedMaps:
    """Read a predictor file; with `fingerprint`, refuse one traced on another model."""
    from safetensors import safe_open

    path = Path(path)
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("moeinf")
        meta = json.loads(raw) if raw else {}
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{path} is not a moeinf look-ahead predictor (format {FORMAT!r} version "
                             f"{VERSION}); re-run `moeinf trace` to write one")
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise ValueError(f"{path} was fit on model fingerprint {meta.get('fingerprint')!r}, but the model in "
                         f"use has {fingerprint!r}; re-run `moeinf trace` on this model")
    weight, bias = {}, {}
    for name, tensor in tensors.items():
        kind, layer, depth = name.split(".")
        (weight if kind == "weight" else bias)[(int(layer), int(depth))] = tensor.to(torch.float32)
    return LearnedMaps(weight, bias, meta)


Predict = Callable[[int, int, torch.Tensor], "torch.Tensor | None"]
"""(layer, depth, hidden [T, H]) -> chances [T, E] for layer + depth (None when it cannot predict)."""


def slot_quality(predict: Predict, records: HiddenRecords, num_experts: int, depth: int,
                 threshold: float) -> dict[int, dict[str, float]]:
    """Per depth: slot recall (routed slots predicted) and precision (predicted experts routed), per token.

    A token's predicted set at layer l+d is the experts whose chance reaches `threshold`, plus its most
    likely expert so that every token predicts something.
    """
    out: dict[int, dict[str, float]] = {}
    layers = records.hidden.shape[1]
    for d in range(1, depth + 1):
        hit = routed = predicted = 0.0
        for layer in range(layers - d):
            chances = predict(layer, d, torch.from_numpy(np.ascontiguousarray(records.hidden[:, layer])))
            if chances is None:
                continue
            p = chances.to(torch.float32).numpy()  # [N, E]
            chosen = p >= threshold
            chosen[np.arange(p.shape[0]), p.argmax(axis=1)] = True
            truth = multi_hot(records.ids[:, layer + d], num_experts) > 0
            hit += float((chosen & truth).sum())
            routed += float(truth.sum())
            predicted += float(chosen.sum())
        if routed:
            out[d] = {"recall": hit / routed, "precision": hit / predicted if predicted else 0.0}
    return out
