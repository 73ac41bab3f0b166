"""Replay a raw routing trace (`moeinf-rawtrace`, moeinf/trace/rawtrace.py) through a model's MoE layers.

A trace recorded on a real model (e.g. DeepSeek-V2-Lite-Chat) says, per request, per step and MoE layer,
which top_k experts each token went to. Replayed here, position p of request i is routed in every MoE layer
as the trace routed position p of its request i, whatever the model's own router would have chosen: a
random-weight checkpoint of the same geometry (`moeinf zoo synth`) then reads and computes experts in the
order the real model did.

Positions are the trace's tokens in order: the prefill step's tokens, then one per decode step. Request i
is run with a prompt as long as its prefill step and may decode while the trace has positions left
(`Routing.token_ids` holds the prompt's ids, chosen by the caller: only their count matters to routing).
The weights are the trace's gate weights (1/k where the trace has none).

The replacement is per model instance (`install_trace_replay`): each MoE block's `gate` becomes a
`ReplayRouter` (moeinf/bench/replay_routing.py) on a shared `RoutingCursor`; on a moeinf `MoE` it is
installed on `MoE.model` before its first forward (moeinf replaces the experts, never the gates).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..trace.rawtrace import RawTrace, read_raw
from .replay_routing import ReplayError, ReplayRouter, Routing, RoutingCursor

GATE_CONTRACT_TYPES = ("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "mixtral")
"""Model types whose MoE blocks call `gate(hidden [N, H]) -> (logits, weights [N, k], indices [N, k])`."""


class TraceMismatch(ValueError):
    """The trace's geometry (MoE layers, experts, top_k) is not the model's."""


def trace_positions(trace: RawTrace) -> tuple[int, np.ndarray, np.ndarray]:
    """(prefill length, expert ids [T, L, k] int64, weights [T, L, k] float32) of one request, positions
    in order; a step must route its tokens through every MoE layer."""
    index: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    layers = list(range(trace.num_layers))
    for s, step in enumerate(trace.steps):
        if sorted(step) != layers:
            raise TraceMismatch(f"request {trace.id}, step {s}: routes MoE layers {sorted(step)}, not all "
                                f"{trace.num_layers}; replay needs every layer of every step")
        ids = np.stack([np.asarray(step[layer][0], dtype=np.int64) for layer in layers], axis=1)  # [t, L, k]
        w = np.stack([np.asarray(step[layer][1], dtype=np.float32) for layer in layers], axis=1)
        index.append(ids)
        weights.append(w)
    prefill = index[0].shape[0] if index else 0
    return prefill, np.concatenate(index), np.concatenate(weights)


def trace_routings(path: str | Path, *, num_layers: int, num_experts: int, top_k: int, count: int,
                   positions: int, prompt_ids: list[int], max_prompt: int | None = None,
                   skip: int = 0, chosen: list[str] | None = None) -> list[Routing]:
    """The first `count` requests of the trace (after `skip` usable ones) that have at least `positions`
    positions beyond their prefill... precisely: prefill + `positions` positions, with a prefill of at
    most `max_prompt` tokens. Each Routing's prompt is `prompt_ids` cycled to the prefill's length.
    `chosen`, when given, receives the ids of the requests returned."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: pass the token ids to build prompts from")
    out: list[Routing] = []
    usable = 0
    for trace in _traces(path):
        if (trace.num_layers, trace.num_experts, trace.top_k) != (num_layers, num_experts, top_k):
            raise TraceMismatch(f"{path}: request {trace.id} routes {trace.num_layers} MoE layers x "
                                f"{trace.num_experts} experts top-{trace.top_k}; the model has "
                                f"{num_layers} x {num_experts} top-{top_k}")
        prefill, index, weights = trace_positions(trace)
        if prefill < 1 or index.shape[0] < prefill + positions:
            continue
        if max_prompt is not None and prefill > max_prompt:
            continue
        if (index < 0).any() or (index >= num_experts).any():
            raise TraceMismatch(f"{path}: request {trace.id} names an expert outside 0..{num_experts - 1}")
        usable += 1
        if usable <= skip:
            continue
        ids = torch.tensor([prompt_ids[i % len(prompt_ids)] for i in range(prefill)] + [0] * positions)
        out.append(Routing(ids, prefill, torch.from_numpy(index), torch.from_numpy(weights)))
        if chosen is not None:
            chosen.append(trace.id)
        if len(out) == count:
            return out
    raise ReplayError(f"{path}: {len(out)} requests with a prefill of at most {max_prompt} tokens and "
                      f"{positions} more positions, {count} asked for; ask for fewer prompts or new tokens")


def trace_eamc(path: str | Path, exclude: set[str], *, fingerprint: str, top_k: int,
               capacity: int = 300, seed: int = 0) -> Any:
    """An EAMC (moeinf/trace/eamc.py) of the trace's requests but `exclude` (those replayed): what
    `moeinf trace` would collect from the real model, stamped with the replaying model's `fingerprint`."""
    from ..trace.eam import flat_unit_rows
    from ..trace.eamc import EAMC, distinct_count
    from ..trace.rawtrace import load_step_counts

    eams = np.stack([counts.sum(axis=0) for rid, _, counts in load_step_counts(path) if rid not in exclude])
    capacity = min(capacity, distinct_count(flat_unit_rows(eams)))
    return EAMC.build(eams, capacity, seed=seed,
                      meta={"fingerprint": fingerprint, "top_k": top_k, "source": Path(path).name})


def _traces(path: str | Path) -> Iterator[RawTrace]:
    yield from read_raw(path)


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE blocks of `model` (parents of its experts modules), in MoE-layer order."""
    from ..spec import spec_for

    spec = spec_for(model.config.model_type)
    pattern = re.compile(spec.experts_module)
    modules = dict(model.named_modules())
    return [modules[name.rsplit(".", 1)[0]] for name in modules if pattern.fullmatch(name)]


def install_trace_replay(model: torch.nn.Module, cursor: RoutingCursor) -> list[ReplayRouter]:
    """Replace the gate of every MoE block of this model instance by a ReplayRouter on `cursor`."""
    from ..spec import spec_for

    config = model.config
    if config.model_type not in GATE_CONTRACT_TYPES:
        raise ReplayError(f"trace replay supports {', '.join(GATE_CONTRACT_TYPES)} models, not "
                          f"{config.model_type!r}")
    blocks = moe_blocks(model)
    if len(blocks) != cursor.num_layers:
        raise TraceMismatch(f"the model has {len(blocks)} MoE layers, the trace {cursor.num_layers}")
    num_experts = spec_for(config.model_type).num_experts(config)
    routers = [ReplayRouter(cursor, layer, num_experts) for layer in range(len(blocks))]
    for block, router in zip(blocks, routers, strict=True):
        block.gate = router
    return routers


def detach_router_lookahead(moe: object) -> bool:
    """Stop a moeinf `MoE`'s look-ahead from running the model's own routers ahead (and guessing the first
    layer from the next token): under replay they predict the checkpoint's routing, not the trace's, and
    every prefetch they plan is wasted. The rest of the prefetch planning (sequence and matched EAMs, a
    learned predictor where one is given) is kept. True when something was detached."""
    runtime = getattr(moe, "_runtime", None)
    lookahead = getattr(getattr(runtime, "offloader", None), "lookahead", None)
    if lookahead is None:
        return False
    detached = lookahead.routers is not None or lookahead.first_layer is not None
    lookahead.routers = None
    lookahead.first_layer = None
    if runtime.next_token_hook is not None:
        runtime.next_token_hook.remove()
        runtime.next_token_hook = None
    return detached
