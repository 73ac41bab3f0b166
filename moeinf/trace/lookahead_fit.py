"""The learned look-ahead predictor: per layer l, a small MLP from layer l's router input and the experts
layer l routed the token to, to the chance that each expert of layers l+1..l+D serves the same token, fit
with a BCE loss on traced tokens.

`moeinf trace` records, for every real token, the router input (the hidden state the MoE block hands its
experts) and the experts chosen at every MoE layer (`HiddenRecords`). `fit` trains the maps on the CPU in
seconds (minibatch AdamW), `save`/`load` keep them in safetensors
beside the EAMC (`predictor_path`), and `slot_quality` measures them, or the routers of later layers run
on the same hidden states, on held-out prompts as slot recall and precision.

File (version 2): tensors "first.{l}.weight" [U, H + E], "first.{l}.bias" [U], "second.{l}.weight"
[D*E, U], "second.{l}.bias" [D*E] (float32), JSON metadata under "moeinf": format, version, fingerprint,
num_layers, num_experts, top_k, hidden_size, hidden_units, depth, tokens, threshold. Version 1 files
(linear maps of the router input alone) are refused with a message to re-run `moeinf trace`.

On the shipped full zoo model (`moeinf bench prefetch --model`, held-out prompts, threshold 0.3) the
linear maps of version 1 recalled 0.75 of the next layer's slots at precision 0.72; standardised inputs,
the layer's own routing and one hidden layer of 256 raise both (docs/benchmarks.md).
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
VERSION = 2


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


def features(hidden: torch.Tensor, routed: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """[T, H + E] float32 on the CPU: layer l's router input and its own routing (multi-hot of `routed`
    [T, k]; zeros when unknown)."""
    x = hidden.to("cpu", torch.float32)
    hot = torch.zeros((x.shape[0], num_experts), dtype=torch.float32)
    if routed is not None:
        index = routed.to("cpu", torch.int64)
        valid = (index >= 0) & (index < num_experts)
        hot.scatter_(1, index.clamp(0, num_experts - 1), valid.to(torch.float32))
    return torch.cat([x, hot], dim=1)


@dataclass
class LearnedMaps:
    """The fitted predictor: per source layer l, one small MLP from layer l's router input and routing
    (`features`) to the logits of layers l+1..l+D (D = min(depth, layers after l)), one GELU hidden layer:
    `first[l]` = (weight [U, H + E], bias [U]) with the input standardisation folded in, `second[l]` =
    (weight [D*E, U], bias [D*E]). `chances` gives [D, T, E] for all depths in two matmuls."""

    first: dict[int, tuple[torch.Tensor, torch.Tensor]]
    second: dict[int, tuple[torch.Tensor, torch.Tensor]]
    meta: dict[str, Any]

    @property
    def depth(self) -> int:
        return int(self.meta["depth"])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def wraps(self) -> bool:
        """Depths past the last layer predict the next token's first layers (`fit(wrap=True)`)."""
        return bool(self.meta.get("wraps", False))

    def chances(self, layer: int, hidden: torch.Tensor, routed: torch.Tensor | None) -> torch.Tensor | None:
        """Chances [D, T, E] of layers layer+1..layer+D from layer `layer`'s router input [T, H] and its
        routed experts [T, k] (None: no map from this layer); with `wraps`, a layer past the last is the
        next token's layer (layer + d - L)."""
        if layer not in self.first:
            return None
        (w1, b1), (w2, b2) = self.first[layer], self.second[layer]
        x = features(hidden, routed, self.num_experts)  # the maps stay on the CPU
        logits = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1)),
                                            w2, b2)  # [T, D*E]
        return torch.sigmoid(logits).view(x.shape[0], -1, self.num_experts).transpose(0, 1)

    def predict(self, layer: int, depth: int, hidden: torch.Tensor,
                routed: torch.Tensor | None = None) -> torch.Tensor | None:
        """Chances [T, E] of layer `layer + depth` (None: no map)."""
        chances = self.chances(layer, hidden, routed)
        if chances is None or depth > chances.shape[0]:
            return None
        return chances[depth - 1]

    def padded(self, hidden_size: int) -> LearnedMaps:
        """The same predictor for a model whose router input has `hidden_size` >= H coordinates, the
        extra ones always zero (a zoo model inflated by zero padding, `moeinf.zoo.inflate`)."""
        old = int(self.meta["hidden_size"])
        if hidden_size < old:
            raise ValueError(f"cannot pad a look-ahead predictor of hidden size {old} to {hidden_size}")
        first = {}
        for layer, (w1, b1) in self.first.items():
            zeros = w1.new_zeros((w1.shape[0], hidden_size - old))
            first[layer] = (torch.cat([w1[:, :old], zeros, w1[:, old:]], dim=1), b1)
        return LearnedMaps(first, dict(self.second), dict(self.meta, hidden_size=hidden_size))


def next_token(records: HiddenRecords) -> np.ndarray:
    """[N] the row of each traced token's next token in the same sequence, -1 for a sequence's last (the
    records hold each sequence's tokens in order, `RouterTracer.sequence_hidden`)."""
    n = len(records.sequence)
    following = np.full(n, -1, dtype=np.int64)
    same = records.sequence[1:] == records.sequence[:-1]  # [N - 1]
    following[:-1][same] = np.arange(1, n)[same]
    return following


def targets(records: HiddenRecords, rows: np.ndarray, layer: int, depths: range, num_experts: int,
            following: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The experts of layers layer+d for `rows` (multi-hot [N, D*E]) and which entries are known
    (bool [N, D*E]): a depth past the last layer wraps to the next token's first layers, unknown for a
    sequence's last token."""
    layers = records.hidden.shape[1]
    parts, known = [], []
    for d in depths:
        later = layer + d
        source = rows if later < layers else following[rows]
        has = source >= 0
        ids = records.ids[np.where(has, source, rows), later % layers]  # [N, k]
        parts.append(multi_hot(ids, num_experts))
        known.append(np.repeat(has[:, None], num_experts, axis=1))
    return np.concatenate(parts, axis=1), np.concatenate(known, axis=1)


def fit(records: HiddenRecords, num_experts: int, depth: int, *, hidden_units: int = 256, steps: int = 1500,
        batch_size: int = 1024, lr: float = 3e-3, weight_decay: float = 1e-2, max_tokens: int = 200_000,
        seed: int = 0, wrap: bool = False) -> LearnedMaps:
    """The predictor for every (layer, depth <= `depth`), fit by minibatch AdamW on the BCE loss.

    One MLP per source layer predicts all its depths (`LearnedMaps`); its inputs are standardised on the
    training tokens (folded into the first layer afterwards). At most `max_tokens` tokens, drawn at random,
    are used; the cost is `steps` minibatches whatever the number of tokens. With `wrap`, the depths past
    the last layer predict the NEXT token's first layers (`meta["wraps"]`): the last layers of a decode
    step then name the reads of the next step's first layers, which nothing else in the running pass
    predicts, a whole layer or more before the next token is known. Off by default: on the e2e model at
    25% cache the wrapping maps read more per decode token for no less stall, and decoded slower.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    n, layers, hidden_size = records.hidden.shape
    if n == 0:
        raise ValueError("no traced token to fit the look-ahead predictor on")
    depth = min(depth, layers)
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n, generator=generator)[:max_tokens].sort().values.numpy()
    following = next_token(records)
    first: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    second: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(layers if wrap else layers - 1):
        depths = range(1, (depth if wrap else min(depth, layers - 1 - layer)) + 1)
        x = features(torch.from_numpy(np.ascontiguousarray(records.hidden[rows, layer], dtype=np.float32)),
                     torch.from_numpy(records.ids[rows, layer]), num_experts)  # [N, H + E]
        hot, known = targets(records, rows, layer, depths, num_experts, following)
        y, weight = torch.from_numpy(hot), torch.from_numpy(known.astype(np.float32))  # [N, D*E] each
        mean, scale = x.mean(dim=0), x.std(dim=0, correction=0) + 1e-3  # [H + E]
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
        net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden_units), torch.nn.GELU(),
                                  torch.nn.Linear(hidden_units, y.shape[1]))
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
        standard = (x - mean) / scale
        for _ in range(steps):
            batch = torch.randint(0, len(rows), (min(batch_size, len(rows)),), generator=generator)
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                net(standard[batch]), y[batch], weight=weight[batch], reduction="sum") \
                / weight[batch].sum().clamp(min=1.0)
            loss.backward()
            optimizer.step()
        log.debug("look-ahead predictor of layer %d: BCE %.4f", layer, loss.item())
        with torch.no_grad():
            w1 = net[0].weight / scale  # [U, H + E]
            first[layer] = (w1.clone(), (net[0].bias - w1 @ mean).clone())
            second[layer] = (net[2].weight.detach().clone(), net[2].bias.detach().clone())
    meta = {"num_layers": layers, "num_experts": num_experts, "hidden_size": hidden_size, "depth": depth,
            "tokens": len(rows), "top_k": int(records.ids.shape[2]), "hidden_units": hidden_units,
            "wraps": wrap}
    return LearnedMaps(first, second, meta)


def predictor_path(eamc_path: str | Path) -> Path:
    """Where the learned predictor of an EAMC file lives: `X.eamc` -> `X.lookahead.safetensors`."""
    path = Path(eamc_path)
    return path.with_name(path.stem + ".lookahead.safetensors")


def save(maps: LearnedMaps, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
    from safetensors.torch import save_file

    full = dict(maps.meta, **(meta or {}), format=FORMAT, version=VERSION)
    tensors = {}
    for name, part in (("first", maps.first), ("second", maps.second)):
        for layer, (weight, bias) in part.items():
            tensors[f"{name}.{layer}.weight"] = weight.contiguous()
            tensors[f"{name}.{layer}.bias"] = bias.contiguous()
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
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a moeinf look-ahead predictor (format {FORMAT!r}); re-run "
                             "`moeinf trace` to write one")
        if meta.get("version") != VERSION:
            raise ValueError(f"{path} is a look-ahead predictor of format version {meta.get('version')} "
                             f"(version 1: linear maps); this moeinf reads version {VERSION} (an MLP per "
                             "layer that also sees the layer's routing): re-run `moeinf trace` to refit it")
        tensors = {name: f.get_tensor(name).to(torch.float32) for name in f.keys()}
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise ValueError(f"{path} was fit on model fingerprint {meta.get('fingerprint')!r}, but the model in "
                         f"use has {fingerprint!r}; re-run `moeinf trace` on this model")
    parts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {"first": {}, "second": {}}
    for name in tensors:
        kind, layer, field = name.split(".")
        if field == "weight":
            parts[kind][int(layer)] = (tensors[name], tensors[f"{kind}.{layer}.bias"])
    expected = int(meta["hidden_size"]) + int(meta["num_experts"])
    for layer, (w1, _) in parts["first"].items():
        (w2, _) = parts["second"].get(layer, (None, None))
        if w1.shape[1] != expected or w2 is None or w2.shape[1] != w1.shape[0] \
                or w2.shape[0] % int(meta["num_experts"]):
            raise ValueError(f"{path}: the predictor of layer {layer} has inconsistent shapes; re-run "
                             "`moeinf trace`")
    return LearnedMaps(parts["first"], parts["second"], meta)


Predict = Callable[[int, int, torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]
"""(layer, depth, hidden [T, H], routed [T, k] of layer `layer`) -> chances [T, E] for layer + depth (None
when it cannot predict)."""


def slot_quality(predict: Predict, records: HiddenRecords, num_experts: int, depth: int,
                 threshold: float, *, wrap: bool = False) -> dict[int, dict[str, float]]:
    """Per depth: slot recall (routed slots predicted) and precision (predicted experts routed), per token.

    A token's predicted set at layer l+d is the experts whose chance reaches `threshold`, plus its most
    likely expert so that every token predicts something. The predictor sees layer l's router input and
    the experts layer l routed the token to (what the runtime knows when it predicts). With `wrap`, only
    the pairs whose layer l+d lies past the last layer count, judged against the next token's layer
    l+d-L (a sequence's last token has none and is skipped).
    """
    out: dict[int, dict[str, float]] = {}
    layers = records.hidden.shape[1]
    following = next_token(records)
    rows = np.flatnonzero(following >= 0) if wrap else np.arange(len(following))
    for d in range(1, depth + 1 if len(rows) else 1):
        hit = routed = predicted = 0.0
        for layer in range(max(layers - d, 0), layers) if wrap else range(layers - d):
            chances = predict(layer, d, torch.from_numpy(np.ascontiguousarray(records.hidden[rows, layer])),
                              torch.from_numpy(np.ascontiguousarray(records.ids[rows, layer])))
            if chances is None:
                continue
            p = chances.to(torch.float32).numpy()  # [N, E]
            chosen = p >= threshold
            chosen[np.arange(p.shape[0]), p.argmax(axis=1)] = True
            later = following[rows] if wrap else rows
            truth = multi_hot(records.ids[later, (layer + d) % layers], num_experts) > 0
            hit += float((chosen & truth).sum())
            routed += float(truth.sum())
            predicted += float(chosen.sum())
        if routed:
            out[d] = {"recall": hit / routed, "precision": hit / predicted if predicted else 0.0}
    return out
