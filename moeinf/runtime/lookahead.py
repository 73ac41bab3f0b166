"""The torch side of look-ahead prefetching: predict the experts of layers l+1..l+d from layer l's router
input, and measure online how many reads the drive delivers per layer of compute.

Predictors (both `(layer, depth, hidden [T, H], routed [T, k]) -> chances [T, E]` for layer `layer + depth`,
from layer `layer`'s router input and the experts it routed each token to):

- `RouterPredictor` runs the model's own router modules of the later layers on layer l's router input:
  the family's exact router math (softmax or sigmoid, DeepSeek's group-limited top-k with its score
  correction bias, norm_topk) comes with the module, so nothing about a family is repeated here. The
  router's top-k is the prediction (chance 1, others 0).
- `moeinf.trace.lookahead_fit.LearnedMaps` (a fitted MLP per layer over the router input and the layer's
  routing, sigmoid chances for every depth at once).
- `moeinf.policy.lookahead.Transitions` (counts of which experts follow which from one layer to the next
  in traced routing): from the routing alone, where neither of the others predicts (routers that cannot
  run alone, or replayed routing that the model's own routers do not produce). Written beside the EAMC
  (`transitions_path`), it is loaded with it.

`FirstLayerGuess` covers what no router input of the running pass can predict: the first MoE layer of the
next token. Its router run on each vocabulary entry's (normed) embedding names that token's experts, and a
hook on the output embeddings reads the next token off the logits (their argmax), so the first layer's
reads start before the next forward pass does.

`Pace` measures the bandwidth the reads achieve and the compute time of a layer, so the planner issues
only the reads the drive can start before their layer begins (`moeinf.policy.lookahead.deliverable`).
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..config import ConfigError, OffloadConfig
from ..policy.lookahead import LOOKAHEAD_POLICIES, Transitions, any_token_chance
from ..spec import ArchSpec
from ..trace.lookahead_fit import LearnedMaps, predictor_path
from ..trace.lookahead_fit import load as load_learned

log = logging.getLogger(__name__)


def find_routers(model: nn.Module, spec: ArchSpec, experts_names: list[str]) -> list[nn.Module] | None:
    """The router module of each MoE layer, or None when the family has none that can be run alone.

    A router is the sibling of the experts module that owns the tensors `spec.router` names (the MoE
    block's `gate` or `router`) and returns `(logits, top_k_weights, top_k_index)`, as transformers'
    routers of the experts interface do. Switch Transformers' router sits one module deeper and returns
    a dispatch mask: it is not supported.
    """
    pattern = re.compile(spec.router)
    owners = {name.rsplit(".", 1)[0] for name, _ in [*model.named_parameters(), *model.named_buffers()]
              if pattern.search(name)}
    modules = dict(model.named_modules())
    routers = []
    for experts in experts_names:
        block = experts.rsplit(".", 1)[0]
        found = [name for name in owners if name.rsplit(".", 1)[0] == block]
        if len(found) != 1 or spec.adapter != "experts-interface" or not _runs_alone(modules[found[0]]):
            return None
        routers.append(modules[found[0]])
    return routers


def _runs_alone(router: nn.Module) -> bool:
    """Whether `router(hidden)` is a whole call returning (logits, weights, index): HY-V3's router also
    takes its block's correction bias, LFM2-MoE's and Inkling's need state of their block or return
    otherwise. Probed once on one zero row, as the runtime would call it."""
    required = [p for p in inspect.signature(router.forward).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    weight = getattr(router, "weight", None)
    if len(required) != 1 or not isinstance(weight, torch.Tensor) or weight.is_meta:
        return False
    try:
        with torch.no_grad():
            out = router(torch.zeros((1, weight.shape[-1]), dtype=weight.dtype, device=weight.device))
    except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
        log.info("router %s cannot run alone (%s): no router look-ahead", type(router).__name__, exc)
        return False
    return isinstance(out, tuple) and len(out) == 3


class RouterPredictor:
    """Later layers' routers run on the current layer's router input (no training, exact router math)."""

    def __init__(self, routers: list[nn.Module], num_experts: int) -> None:
        self.routers = routers
        self.num_experts = num_experts

    def __call__(self, layer: int, depth: int, hidden: torch.Tensor,
                 routed: torch.Tensor | None = None) -> torch.Tensor | None:
        later = layer + depth
        if later >= len(self.routers):
            return None
        with torch.no_grad():
            _, _, index = self.routers[later](hidden)  # index [T, k]
        chances = torch.zeros((hidden.shape[0], self.num_experts), dtype=torch.float32)  # [T, E]
        return chances.scatter_(1, index.to(torch.int64).cpu(), 1.0)


class FirstLayerGuess:
    """The next token's experts in the first MoE layers, per token id, read off a pass's logits.

    `table` [V, k]: the first MoE layer's router run on every token's embedding after the norm in front of
    the MoE block (the attention's contribution of the first layer is left out, so this is a guess, right
    for most of the next token's layer-0 slots on the shipped full zoo model). `later` [V, G, k] (None
    without a learned predictor): layers 1..G, the top-k of the learned look-ahead maps of the first layer
    run on the same normed embedding and its `table` routing (most of the next token's layer-1 and
    layer-2 slots on the e2e model, where a later layer's own router on the embedding names few).

    `layers(logits)` takes the logits [B, S, V] of a forward pass and returns, per guessed layer, the
    experts its next tokens (the argmax of each row's last position) route to there."""

    def __init__(self, table: torch.Tensor, later: torch.Tensor | None = None) -> None:
        self.table = table  # [V, k] int64
        self.later = later  # [V, G, k] int64

    @classmethod
    def build(cls, model: nn.Module, experts_name: str, router: nn.Module, rows_per_step: int = 4096, *,
              learned: LearnedMaps | None = None, layers: int = 1) -> FirstLayerGuess | None:
        """The guess for the MoE block of `experts_name` (the first one) and, with `learned` maps from it,
        for the `layers - 1` MoE layers after it; None when that block is not in the model's first
        decoder layer (dense layers before it change the token's hidden state) or the layer has no
        `post_attention_layernorm` in front of it."""
        block = experts_name.rsplit(".", 1)[0]
        layer_name = block.rsplit(".", 1)[0]
        modules = dict(model.named_modules())
        norm = modules.get(f"{layer_name}.post_attention_layernorm")
        embeddings = model.get_input_embeddings()
        if norm is None or not layer_name.endswith(".0") or embeddings is None:
            return None
        weight = embeddings.weight  # [V, H]
        parts, deeper = [], []
        with torch.no_grad():
            for start in range(0, weight.shape[0], rows_per_step):
                normed = norm(weight[start:start + rows_per_step])  # [n, H]
                _, _, index = router(normed)  # index [n, k]
                parts.append(index.to(torch.int64).cpu())
                chances = learned.chances(0, normed, index) if learned is not None and layers > 1 else None
                if chances is not None:  # [D, n, E] -> the top-k of layers 1..G: [n, G, k]
                    top = chances[:layers - 1].topk(index.shape[1], dim=-1).indices
                    deeper.append(top.transpose(0, 1).to(torch.int64))
        return cls(torch.cat(parts), torch.cat(deeper) if deeper else None)

    def layers(self, logits: torch.Tensor) -> list[list[int]]:
        """Per guessed MoE layer (the first, then `later`'s), the experts of the next token of every row
        of `logits` [B, S, V]."""
        tokens = logits[:, -1].argmax(dim=-1).cpu()  # [B]
        tokens = tokens[tokens < self.table.shape[0]]
        guessed = [self.table[tokens]]  # [B, k]
        if self.later is not None:
            guessed.extend(self.later[tokens].unbind(dim=1))  # G x [B, k]
        return [sorted(set(experts.reshape(-1).tolist())) for experts in guessed]


class Pace:
    """Online estimates of the reads' bandwidth (bytes/s) and a layer's compute time (s), as EMAs.

    `layer_started` is called when each MoE layer's experts are called. The time since the previous
    layer of the same pass, less the seconds compute stalled on reads meanwhile, is one layer of compute
    (attention, router and experts). Bandwidth is the bytes that landed over an interval during which
    reads were in flight at both ends, i.e. the drive had work throughout.
    """

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.layer_seconds: float | None = None
        self.bandwidth: float | None = None
        self._last: tuple[int, float, float, int, bool] | None = None

    def layer_started(self, layer: int, stall_s: float, bytes_read: int, reading: bool) -> None:
        """Observe the start of `layer`'s experts: the stall seconds and bytes read so far, and whether
        reads are in flight now."""
        now = time.perf_counter()
        if self._last is not None:
            last_layer, last_time, last_stall, last_bytes, was_reading = self._last
            elapsed = now - last_time
            if layer == last_layer + 1:
                self.layer_seconds = self._ema(self.layer_seconds, max(elapsed - (stall_s - last_stall), 0.0))
            if was_reading and reading and elapsed > 0 and bytes_read > last_bytes:
                self.bandwidth = self._ema(self.bandwidth, (bytes_read - last_bytes) / elapsed)
        self._last = (layer, now, stall_s, bytes_read, reading)

    def reads_per_layer(self, read_bytes: int) -> float | None:
        """Reads of `read_bytes` the drive completes during one layer of compute (None until measured)."""
        if self.layer_seconds is None or self.bandwidth is None or read_bytes <= 0:
            return None
        return self.bandwidth * self.layer_seconds / read_bytes

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new


class Lookahead:
    """The look-ahead predictor of one offloaded model and how deep it looks.

    `learned` (a fitted `LearnedMaps`) predicts where it has a map; the routers, once `bind` found
    them, predict the rest (or everything, without a learned file). `chances` gives the planner, per
    layer ahead, each expert's chance of serving at least one real token of the batch.
    """

    def __init__(self, depth: int, num_experts: int, learned: LearnedMaps | None = None,
                 guess_layers: int = 1, transition_layers: int = 1) -> None:
        self.depth = depth
        self.transition_layers = transition_layers
        """The most layers of a token the transitions join (`OffloadConfig.lookahead_transition_layers`)."""
        self.guess_layers = guess_layers
        self.num_experts = num_experts
        self.learned = learned
        self.routers: RouterPredictor | None = None
        self.first_layer: FirstLayerGuess | None = None
        self.transitions: Transitions | None = None
        """Predicts from the routing alone where the learned maps and the routers do not."""
        self._pass = 0
        self._last_layer = -1
        self._routed: dict[int, tuple[int, torch.Tensor]] = {}
        """Each MoE layer's routing [T, k] of the latest pass that reached it, with that pass's number
        (`note`), for transitions that join a token's earlier layers."""

    def note(self, layer: int, routed: torch.Tensor) -> None:
        """Layer `layer` of the running pass routed its tokens to `routed` [T, k] (every MoE layer, in order;
        a layer at or before the previous one starts a new pass). Kept only where the transitions use it."""
        if self.transitions is None or self._joined() < 2:
            return
        if layer <= self._last_layer:
            self._pass += 1
        self._last_layer = layer
        self._routed[layer] = (self._pass, routed)

    def _joined(self) -> int:
        return 1 if self.transitions is None else min(self.transition_layers, self.transitions.sources)

    def _earlier(self, layer: int, keep: torch.Tensor | None) -> list[np.ndarray]:
        """This pass's routing of layers layer-1, layer-2, ... (as deep as the transitions join, stopping at
        a layer this pass did not note), filtered by `keep` as the current layer's is."""
        out: list[np.ndarray] = []
        if self._last_layer != layer:  # this layer was not noted: which pass is running is unknown
            return out
        for before in range(layer - 1, max(layer - self._joined(), -1), -1):
            noted = self._routed.get(before)
            if noted is None or noted[0] != self._pass:
                break
            routed = noted[1]
            if keep is not None:
                if keep.shape[0] != routed.shape[0]:
                    break
                routed = routed[keep.to(routed.device)]
            out.append(routed.detach().cpu().numpy())
        return out

    def bind(self, model: nn.Module, spec: ArchSpec, experts_names: list[str], *,
             next_token: bool = True) -> bool:
        """Find the model's routers (the model is built after the offloader) and, with `next_token`, the
        first MoE layer's guess from the next token; False if the model has no routers that run alone."""
        routers = find_routers(model, spec, experts_names)
        self.routers = None if routers is None else RouterPredictor(routers, self.num_experts)
        if next_token and routers:
            # layers past the first are guessed only as deep as the look-ahead predicts, within the pass
            layers = min(self.guess_layers, self.depth + 1, len(experts_names))
            self.first_layer = FirstLayerGuess.build(model, experts_names[0], routers[0],
                                                     learned=self.learned, layers=layers)
        return self.routers is not None

    @property
    def ready(self) -> bool:
        return self.learned is not None or self.routers is not None or self.transitions is not None

    def chances(self, layer: int, hidden: torch.Tensor, real: torch.Tensor | None,
                routed: torch.Tensor | None = None) -> np.ndarray | None:
        """[d, E] for layers layer+1..layer+d (d <= depth; None if nothing is predicted).

        `hidden` [T, H] is layer `layer`'s router input and `routed` [T, k] the experts it routed each
        token to (None: unknown, the learned predictor then sees no routing); `real` [T] bool marks the
        tokens that are not padding (None = all)."""
        keep = None
        if real is not None:
            keep = real.to(hidden.device)
            hidden = hidden[keep]
            routed = None if routed is None else routed[keep.to(routed.device)]
        if hidden.shape[0] == 0:
            return None
        # the learned predictor gives every depth at once: [D, T, E]
        learned = self.learned.chances(layer, hidden, routed) if self.learned is not None else None
        following = None  # the transitions' [D, T, E], made at the first depth that needs them
        rows = []
        for depth in range(1, self.depth + 1):
            chances = learned[depth - 1] if learned is not None and depth <= learned.shape[0] else None
            if chances is None and self.routers is not None:
                chances = self.routers(layer, depth, hidden)
            if chances is not None:
                rows.append(any_token_chance(chances.detach().cpu().numpy()))
                continue
            if following is None and self.transitions is not None and routed is not None:
                following = self.transitions.chances(layer, routed.detach().cpu().numpy(),
                                                     self._earlier(layer, keep), ahead=self.depth)
            if following is None or depth > following.shape[0]:
                break
            rows.append(any_token_chance(following[depth - 1]))
        return np.stack(rows) if rows else None


def make_lookahead(config: OffloadConfig, fingerprint: str, num_layers: int,
                   num_experts: int) -> Lookahead | None:
    """The `Lookahead` that `config` asks for (None unless prefetch is lookahead or hybrid).

    The learned predictor is `lookahead_predictor` when it names a file, else (`auto`) the file beside
    the EAMC when one exists; it must have been fit on this model and its layout.
    """
    if config.prefetch not in LOOKAHEAD_POLICIES:
        return None
    path: Path | None = None
    if config.lookahead_predictor not in ("auto", "routers"):
        path = Path(config.lookahead_predictor)
        if not path.is_file():
            raise ConfigError(f"lookahead_predictor: {path} does not exist; give 'auto', 'routers' or a "
                              "file written by `moeinf trace --lookahead-depth N`")
    elif config.lookahead_predictor == "auto" and config.eamc is not None:
        beside = predictor_path(config.eamc)
        path = beside if beside.is_file() else None
    learned = None
    if path is not None:
        try:
            learned = load_learned(path, fingerprint=fingerprint)
        except ValueError as exc:
            raise ConfigError(f"lookahead_predictor: {exc}") from None
        if (learned.meta.get("num_layers"), learned.meta.get("num_experts")) != (num_layers, num_experts):
            raise ConfigError(f"lookahead_predictor: {path} predicts {learned.meta.get('num_layers')} layers "
                              f"of {learned.meta.get('num_experts')} experts, the model has {num_layers} of "
                              f"{num_experts}; re-run `moeinf trace`")
        log.info("look-ahead: learned predictor %s (depth %d)", path, learned.depth)
    lookahead = Lookahead(config.lookahead_depth, num_experts, learned, config.lookahead_next_token_layers,
                          config.lookahead_transition_layers)
    if config.lookahead_predictor == "auto" and config.eamc is not None:
        beside = transitions_path(config.eamc)
        if beside.is_file():
            try:
                transitions = load_transitions(beside, fingerprint=fingerprint)
            except ValueError as exc:
                raise ConfigError(f"eamc: {exc}") from None
            if (transitions.num_layers, transitions.num_experts) != (num_layers, num_experts):
                raise ConfigError(f"eamc: {beside} holds transitions of {transitions.num_layers} layers of "
                                  f"{transitions.num_experts} experts, the model has {num_layers} of "
                                  f"{num_experts}; re-run `moeinf trace`")
            lookahead.transitions = transitions
            log.info("look-ahead: expert transitions %s (depth %d)", beside, transitions.depth)
    return lookahead


TRANSITIONS_FORMAT = "moeinf-transitions"


def transitions_path(eamc_path: str | Path) -> Path:
    """Where the expert transitions of an EAMC file live: `X.eamc` -> `X.transitions.npz`."""
    path = Path(eamc_path)
    return path.with_name(path.stem + ".transitions.npz")


def save_transitions(transitions: Transitions, path: str | Path, *, fingerprint: str) -> Path:
    """Write `transitions` (fit on the routing of the model with `fingerprint`) to `path`, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    meta = json.dumps({"format": TRANSITIONS_FORMAT, "version": 2, "fingerprint": fingerprint})
    joined = {} if transitions.sources < 2 else {"prior": transitions.prior, "joint": transitions.joint}
    np.savez(tmp, cond=transitions.cond, calibration=transitions.calibration, meta=np.array(meta), **joined)
    tmp.replace(path)
    return path


def load_transitions(path: str | Path, *, fingerprint: str | None = None) -> Transitions:
    """Read a transitions file; with `fingerprint`, refuse one fit on another model's routing."""
    with np.load(path, allow_pickle=False) as data:
        try:
            meta = json.loads(str(data["meta"]))
            cond, calibration = data["cond"], data["calibration"]
            # version 1 files predict from one layer only
            prior = data["prior"] if "prior" in data.files else None
            joint = data["joint"] if "joint" in data.files else None
        except KeyError:
            meta = {}
        if meta.get("format") != TRANSITIONS_FORMAT:
            raise ValueError(f"{path} is not a moeinf transitions file ({TRANSITIONS_FORMAT!r})")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise ValueError(f"{path} was fit on another model's routing (fingerprint "
                         f"{str(meta.get('fingerprint'))[:12]}, this model {fingerprint[:12]})")
    return Transitions(cond, calibration, prior, joint)
