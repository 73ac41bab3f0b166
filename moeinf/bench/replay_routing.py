"""Replay the zoo model's trained routing through a larger benchmark model's experts.

The e2e benchmark model has Qwen3-30B-A3B's expert geometry but random weights, so its own router picks
experts at random and no prefetcher can do better than chance. Here routing comes from the trained zoo
model instead:

  record (zoo, unmodified HF)  -> per position and MoE layer, the zoo router's scores
  map (ExpertMapping)          -> per position and layer, top_k big experts and their weights
  replay (ReplayRouter)        -> the big model's gates return those, position by position

Recording: each prompt is chat-formatted and tokenised as the zoo does, the zoo model samples
`new_tokens` tokens (seeded; its generation_config), then one forward over prompt + generated tokens
records per layer the selection scores `sigmoid(logits) + e_score_correction_bias` (what DeepSeek-V3
ranks experts by) and the plain sigmoid scores (what it weights them by).

Mapping: zoo expert e stands for the group of big experts {g*e, ..., g*e + g-1}, g = E_big / E_zoo; the
zoo's top m = top_k_big / g experts by selection score give exactly top_k_big distinct big experts. Their
weights are the zoo's sigmoid scores of the m chosen experts normalised to sum 1 (DeepSeek-V3's
norm_topk_prob), each split equally over its group.

Replay depends on positions only: the big model is fed the zoo's prompt ids modulo its vocabulary (same
length), and whatever it generates, position p of prompt i is routed as the zoo routed position p.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..zoo.tokenizer import chat_text

log = logging.getLogger(__name__)

REPLAY_MODEL_TYPES = ("qwen3_moe",)
"""Model types whose MoE blocks call `gate(hidden [N, H]) -> (logits, weights, indices)`, as replayed here."""


class ReplayError(RuntimeError):
    """The replayed routing cannot serve a request (wrong model, prompt not started, recording too short)."""


@dataclass(frozen=True)
class ExpertMapping:
    """Zoo expert e -> big experts {g*e .. g*e + g-1}: the zoo's top `zoo_top` give the big model's top_k."""

    zoo_experts: int
    big_experts: int
    big_top_k: int

    def __post_init__(self) -> None:
        if self.zoo_experts < 1 or self.big_experts % self.zoo_experts:
            raise ValueError(f"cannot map {self.zoo_experts} zoo experts onto {self.big_experts} big "
                             "experts: the big model's expert count must be a multiple of the zoo model's")
        if self.big_top_k % self.group or not 0 < self.zoo_top <= self.zoo_experts:
            raise ValueError(f"cannot give the big model its top-{self.big_top_k} from groups of "
                             f"{self.group} big experts per zoo expert: top_k of the big model must be a "
                             f"positive multiple of {self.group} and at most {self.big_experts}")

    @property
    def group(self) -> int:
        """Big experts per zoo expert."""
        return self.big_experts // self.zoo_experts

    @property
    def zoo_top(self) -> int:
        """Zoo experts chosen per position (m)."""
        return self.big_top_k // self.group

    def describe(self, variant: str) -> str:
        return (f"zoo-{variant} replayed (top-{self.zoo_top} of {self.zoo_experts} -> {self.big_top_k} of "
                f"{self.big_experts})")

    def map(self, selection: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Big-model routing from zoo scores `[..., E_zoo]`: (index `[..., k]` int64, weights `[..., k]`
        float32 summing to 1). Experts come in descending zoo selection score, a group's experts together."""
        if selection.shape[-1] != self.zoo_experts or selection.shape != scores.shape:
            raise ValueError(f"expected selection and scores of shape [..., {self.zoo_experts}], got "
                             f"{tuple(selection.shape)} and {tuple(scores.shape)}")
        top = torch.topk(selection, self.zoo_top, dim=-1).indices  # [..., m]
        chosen = scores.gather(-1, top).float()  # [..., m]
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        members = torch.arange(self.group)
        index = (top.unsqueeze(-1) * self.group + members).flatten(-2)  # [..., m * g]
        weights = (chosen / self.group).unsqueeze(-1).expand(*chosen.shape, self.group).flatten(-2)
        return index.long(), weights.contiguous()


@dataclass(frozen=True)
class Recording:
    """One zoo sequence: its token ids and, per position and MoE layer, the zoo router's scores."""

    token_ids: torch.Tensor
    """[T] int64: prompt then generated tokens, in the zoo vocabulary."""
    prompt_length: int
    selection: torch.Tensor
    """[T, L, E_zoo] float32: sigmoid(logits) + e_score_correction_bias, what experts are ranked by."""
    scores: torch.Tensor
    """[T, L, E_zoo] float32: sigmoid(logits), what the chosen experts are weighted by."""


@dataclass(frozen=True)
class Routing:
    """The big model's routing of one prompt, per position and MoE layer."""

    token_ids: torch.Tensor
    """[T] int64, zoo vocabulary (`prompt_ids` maps them into the big model's)."""
    prompt_length: int
    index: torch.Tensor
    """[T, L, k] int64 big-expert ids."""
    weights: torch.Tensor
    """[T, L, k] float32, each row summing to 1."""

    @property
    def num_layers(self) -> int:
        return self.index.shape[1]

    def prompt_ids(self, vocab_size: int) -> torch.Tensor:
        """[1, P] the prompt fed to the big model: zoo ids modulo its vocabulary, so positions line up."""
        return (self.token_ids[: self.prompt_length] % vocab_size).unsqueeze(0)

    def eam(self, num_experts: int) -> np.ndarray:
        """[L, E] token counts of every recorded position (prompt and generated), as an EAM."""
        counts = np.zeros((self.num_layers, num_experts), dtype=np.float32)
        for layer in range(self.num_layers):
            counts[layer] = np.bincount(self.index[:, layer].reshape(-1).numpy(), minlength=num_experts)
        return counts


def zoo_prompt_ids(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """The zoo's chat-formatted token ids of `text`; a long prompt loses the end of its user text, never the
    template around it."""
    ids = tokenizer(chat_text(text), add_special_tokens=False).input_ids
    if len(ids) <= max_tokens:
        return ids
    head, tail = (tokenizer(part, add_special_tokens=False).input_ids for part in chat_text("\0").split("\0"))
    room = max_tokens - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"max_tokens={max_tokens} leaves no room for a prompt inside the chat template "
                         f"({len(head) + len(tail)} tokens)")
    return head + tokenizer(text, add_special_tokens=False).input_ids[:room] + tail


class RouterScores:
    """Forward hooks on the DeepSeek-V3 routers of one model instance that keep each call's scores."""

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        if not self.routers:
            raise ValueError(f"no DeepseekV3TopkRouter in this {model.config.model_type} model: routing is "
                             "recorded from a zoo (DeepSeek-V3) checkpoint")
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles = [r.register_forward_hook(self._record) for r in self.routers]

    def _record(self, module: torch.nn.Module, _args: Any, output: Any) -> None:
        self.calls[self.routers.index(module)].append(output[0].detach().float())  # logits [N, E]

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(selection, scores) `[N, L, E]` of the single forward since the last take."""
        if any(len(calls) != 1 for calls in self.calls):
            raise RuntimeError(f"expected one router call per layer, got {[len(c) for c in self.calls]}")
        logits = torch.stack([calls[0] for calls in self.calls], dim=1)  # [N, L, E]
        bias = torch.stack([r.e_score_correction_bias.float() for r in self.routers])  # [L, E]
        for calls in self.calls:
            calls.clear()
        scores = logits.sigmoid()
        return scores + bias, scores

    def clear(self) -> None:
        for calls in self.calls:
            calls.clear()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def record_routing(zoo_dir: str | Path, texts: Sequence[str], *, new_tokens: int, max_prompt_tokens: int,
                   seed: int = 0) -> list[Recording]:
    """Sample `new_tokens` tokens after each prompt with the unmodified zoo model, then record its router
    scores over prompt + generated tokens. Prompt i samples with seed `seed + i` (the global RNG is kept)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(zoo_dir))
    model = AutoModelForCausalLM.from_pretrained(str(zoo_dir), dtype=torch.float32).eval()
    hooks = RouterScores(model)
    recordings = []
    # The zoo model is small: a second intra-op thread only adds synchronisation, which costs ~7x on a
    # machine whose other core is busy. Restored below.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, text in enumerate(texts):
            ids = torch.tensor([zoo_prompt_ids(tokenizer, text, max_prompt_tokens)])  # [1, P]
            with torch.no_grad(), torch.random.fork_rng():
                torch.manual_seed(seed + i)
                # min_new_tokens: every sequence is as long as the benchmark decodes.
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens)  # [1, P + new_tokens]
                hooks.clear()
                model(out)
            selection, scores = hooks.take()
            recordings.append(Recording(out[0], ids.shape[1], selection, scores))
    finally:
        hooks.close()
        torch.set_num_threads(threads)
    return recordings


def map_recordings(recordings: Sequence[Recording], mapping: ExpertMapping) -> list[Routing]:
    return [Routing(r.token_ids, r.prompt_length, *mapping.map(r.selection, r.scores)) for r in recordings]


class RoutingCursor:
    """The replayed routing of several prompts and, per MoE layer, the next position to serve.

    `start(i)` selects prompt i and rewinds; each gate call of layer l with N tokens (batch 1) takes that
    layer's next N positions. Layers keep their own positions, so nothing needs to know where a forward ends.
    """

    def __init__(self, routings: Sequence[Routing]) -> None:
        if not routings:
            raise ValueError("a routing cursor needs at least one prompt's routing")
        layers = {r.num_layers for r in routings}
        if len(layers) != 1:
            raise ValueError(f"routings disagree on the number of MoE layers: {sorted(layers)}")
        self.routings = list(routings)
        self.num_layers = layers.pop()
        self.prompt: int | None = None
        self.positions = [0] * self.num_layers

    def start(self, prompt: int) -> None:
        """Replay prompt `prompt` from position 0 on every layer."""
        if not 0 <= prompt < len(self.routings):
            raise ReplayError(f"prompt {prompt} was not recorded (0..{len(self.routings) - 1})")
        self.prompt = prompt
        self.positions = [0] * self.num_layers

    def take(self, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(index `[count, k]`, weights `[count, k]`) of layer `layer`'s next `count` positions."""
        if self.prompt is None:
            raise ReplayError("no prompt started: call RoutingCursor.start(prompt) before each prompt")
        routing = self.routings[self.prompt]
        begin = self.positions[layer]
        end = begin + count
        if end > routing.index.shape[0]:
            raise ReplayError(f"prompt {self.prompt}, MoE layer {layer}: positions {begin}..{end - 1} asked "
                              f"for, but {routing.index.shape[0]} were recorded; record more new tokens than "
                              "the benchmark decodes")
        self.positions[layer] = end
        return routing.index[begin:end, layer], routing.weights[begin:end, layer]


class ReplayRouter(torch.nn.Module):
    """Stands in for one MoE block's gate: returns the recorded routing of the cursor's next positions.

    Contract of the replaced Qwen3MoeTopKRouter: `forward(hidden [N, H]) -> (router_logits [N, E],
    weights [N, k] in the hidden dtype, indices [N, k] int64)`. The MoE block uses only weights and
    indices; the logits (read only for output_router_logits) are the log of the replayed weights spread
    over all experts (-inf elsewhere), so their softmax is the replayed distribution.
    """

    def __init__(self, cursor: RoutingCursor, layer: int, num_experts: int) -> None:
        super().__init__()
        self.cursor = cursor
        self.layer = layer
        self.num_experts = num_experts

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0]
        index, weights = self.cursor.take(self.layer, tokens)  # [N, k], [N, k]
        index = index.to(hidden_states.device)
        weights = weights.to(hidden_states.device)
        spread = torch.zeros(tokens, self.num_experts, device=hidden_states.device)
        spread.scatter_(1, index, weights)  # [N, E]
        return spread.log().to(hidden_states.dtype), weights.to(hidden_states.dtype), index

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}"


def install_replay(model: torch.nn.Module, cursor: RoutingCursor) -> list[ReplayRouter]:
    """Replace the gate of every MoE block of this model instance (only) by a ReplayRouter on `cursor`.

    Works on the plain HF model, on `MoE.model` (moeinf replaces the experts, not the gates) and on an
    accelerate-dispatched model. MoE layer l is the l-th experts module in `named_modules()` order, as
    everywhere in moeinf.
    """
    import re

    from ..spec import spec_for

    config = model.config
    if config.model_type not in REPLAY_MODEL_TYPES:
        raise ReplayError(f"routing replay supports {REPLAY_MODEL_TYPES} models (the e2e benchmark's), not "
                          f"{config.model_type!r}; use the model's own routing for it")
    spec = spec_for(config.model_type)
    pattern = re.compile(spec.experts_module)
    modules = dict(model.named_modules())
    blocks = [modules[name.rsplit(".", 1)[0]] for name in modules if pattern.fullmatch(name)]
    if len(blocks) != cursor.num_layers:
        raise ReplayError(f"the model has {len(blocks)} MoE layers but the replayed routing has "
                          f"{cursor.num_layers}; build the benchmark model with {cursor.num_layers} layers")
    routers = [ReplayRouter(cursor, layer, spec.num_experts(config)) for layer in range(len(blocks))]
    for block, router in zip(blocks, routers, strict=True):
        block.gate = router
    return routers


def build_replay_eamc(model_dir: str | Path, routings: Sequence[Routing], path: str | Path, *,
                      description: str, seed: int = 0) -> Path:
    """An EAMC of the big model (its fingerprint, so MoE accepts it) from the EAMs of replayed routings;
    capacity = the number of distinct EAMs."""
    from ..store.fingerprint import fingerprint
    from ..trace.eam import flat_unit_rows
    from ..trace.eamc import EAMC, distinct_count

    num_experts, top_k = expert_shape(model_dir)
    eams = np.stack([r.eam(num_experts) for r in routings])  # [N, L, E]
    capacity = distinct_count(flat_unit_rows(eams))
    meta = {"fingerprint": fingerprint(model_dir), "model": Path(model_dir).resolve().name, "top_k": top_k,
            "routing": description, "tokens": int(eams[:, 0].sum()) // top_k}
    return EAMC.build(eams, capacity, seed=seed, meta=meta).save(path)


def mapping_for(model_dir: str | Path, recordings: Sequence[Recording]) -> ExpertMapping:
    """The mapping from the recorded zoo experts onto the experts of the checkpoint in `model_dir`."""
    return ExpertMapping(recordings[0].selection.shape[-1], *expert_shape(model_dir))


def expert_shape(model_dir: str | Path) -> tuple[int, int]:
    """(experts per MoE layer, top_k) of the checkpoint in `model_dir`."""
    from transformers import AutoConfig

    from ..spec import spec_for

    config = AutoConfig.from_pretrained(str(model_dir))
    spec = spec_for(config.model_type)
    return spec.num_experts(config), spec.top_k(config)
