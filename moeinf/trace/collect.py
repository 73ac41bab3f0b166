"""Collect activation traces: generate on prompt sets with the unmodified HF model and trace its routers.

`collect(model_dir, prompts, ...)` loads the model with transformers (no offloading: tracing must see
exactly the model's own routing), generates for each batch of prompts, and returns one EAM per prompt
plus, on request, the raw routing (`rawtrace.RawTrace`). `build_eamc` clusters the EAMs into an EAMC
whose metadata names the model (fingerprint), the data and the build parameters.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..hf.tokenizer import load_tokenizer
from ..spec import spec_for
from .eam import flat_unit_rows
from .eamc import EAMC, distinct_count
from .lookahead_fit import HiddenRecords
from .rawtrace import RawTrace
from .router import RouterTracer, generated_lengths

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    id: str
    task: str
    prompt: str
    source: str


@dataclass
class Collected:
    """What `collect` traced: per prompt its EAM `[L, E]`, and the raw routing when asked for."""

    eams: np.ndarray
    prompts: list[Prompt]
    num_layers: int
    num_experts: int
    top_k: int
    tokenizer: str
    tokens: int
    raw: list[RawTrace] = field(default_factory=list)
    hidden: HiddenRecords | None = None
    """Every real token's router inputs and experts at every layer, when asked for (`hidden=True`)."""


def read_prompts(paths: Sequence[str | Path], limit: int | None = None) -> list[Prompt]:
    """The {"id", "task", "prompt"} lines of JSONL files, at most `limit` from each file. Only "prompt" is
    required: a missing id is the file's name and line number, a missing task "unknown". A line that is
    not such an object is a `ValueError` naming the file and line."""
    prompts: list[Prompt] = []
    for path in paths:
        taken = 0
        with Path(path).open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if limit is not None and taken >= limit:
                    break
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: not valid JSON ({exc})") from None
                if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                    raise ValueError(f"{path}:{number}: expected a JSON object with a \"prompt\" string "
                                     "(and optionally \"id\" and \"task\")")
                prompts.append(Prompt(str(record.get("id", f"{Path(path).name}:{number}")),
                                      str(record.get("task", "unknown")), record["prompt"], Path(path).name))
                taken += 1
    return prompts


def load_model(model_dir: str | Path) -> torch.nn.Module:
    """The unmodified HF model of `model_dir` (its family's auto class per the spec), in eval mode."""
    from transformers import AutoConfig

    spec = spec_for(AutoConfig.from_pretrained(str(model_dir)).model_type)
    return spec.auto_class().from_pretrained(str(model_dir)).eval()


def collect(model_dir: str | Path, prompts: Sequence[Prompt], *, max_new_tokens: int, batch_size: int = 8,
            max_prompt_tokens: int = 256, sample: bool = False, seed: int = 0, raw: bool = False,
            progress: bool = True, hidden: bool = False, temperature: float = 1.0) -> Collected:
    """Generate for every prompt and trace each sequence's routing (prompt and generated tokens).

    `sample` samples at `temperature` instead of decoding greedily.
    `hidden=True` also keeps every token's router inputs (for the learned look-ahead predictor).
    """
    from ..progress import progress_bar

    if not prompts:
        raise ValueError("no prompt to trace; check --prompts and --limit")
    model = load_model(model_dir)
    tokenizer, kind = load_tokenizer(model_dir)
    config = model.config
    pad = config.pad_token_id if config.pad_token_id is not None else tokenizer.pad_token_id
    if pad is None:
        pad = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
    eos = model.generation_config.eos_token_id
    torch.manual_seed(seed)
    eams: list[np.ndarray] = []
    traces: list[RawTrace] = []
    tokens = 0
    states: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    with RouterTracer(model, hidden=hidden) as tracer, torch.no_grad(), \
            progress_bar(len(prompts), desc="tracing", unit="seq", enabled=progress) as bar:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            encoded = [tokenizer.encode(p.prompt)[:max_prompt_tokens] for p in batch]
            empty = [p.id for p, seq in zip(batch, encoded, strict=True) if not seq]
            if empty:
                raise ValueError(f"prompts {empty} encode to no token; remove them from the prompt file")
            ids, mask = pad_batch(encoded, pad, left=not config.is_encoder_decoder)
            tracer.reset()
            sampling = {"do_sample": True, "temperature": temperature} if sample else {"do_sample": False}
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                                 **sampling)
            new = out[:, 1:] if config.is_encoder_decoder else out[:, ids.shape[1]:]
            lengths = generated_lengths(new, eos)
            eams.extend(tracer.eams(lengths))
            tokens += sum(map(len, encoded)) + sum(lengths)
            if raw:
                traces.extend(RawTrace(p.id, p.task, tracer.num_layers, tracer.num_experts, tracer.top_k,
                                       tracer.sequence_steps(b, lengths[b])) for b, p in enumerate(batch))
            if hidden:
                for b in range(len(batch)):
                    x, ids_b = tracer.sequence_hidden(b, lengths[b])
                    if len(x):  # an encoder-decoder's steps never run every MoE layer: nothing to fit
                        states.append((x, ids_b, np.full(len(x), start + b, dtype=np.int64)))
            bar.update(len(batch))
    records = None
    if states:
        records = HiddenRecords(*(np.concatenate(parts) for parts in zip(*states, strict=True)))
    return Collected(np.stack(eams), list(prompts), tracer.num_layers, tracer.num_experts, tracer.top_k,
                     kind, tokens, traces, records)


def pad_batch(encoded: Sequence[Sequence[int]], pad: int, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` `[B, max_len]`, padded on the left (decoder-only) or the right."""
    width = max(map(len, encoded))
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, seq in enumerate(encoded):
        span = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[row, span] = torch.tensor(seq, dtype=torch.long)
        mask[row, span] = 1
    return ids, mask


def build_eamc(collected: Collected, capacity: int, *, seed: int = 0,
               meta: dict[str, Any] | None = None) -> EAMC:
    """K-Means the collected EAMs into an EAMC of `capacity` entries.

    A capacity above the number of distinct EAMs is clamped to that number with a warning (there is
    nothing to cluster beyond it); the metadata keeps both `capacity_requested` and `capacity`.
    """
    distinct = distinct_count(flat_unit_rows(collected.eams))
    effective = min(capacity, distinct)
    if effective < capacity:
        log.warning("capacity %d exceeds the %d distinct sequences traced; the EAMC keeps %d entries (a "
                    "larger one needs more prompts: more --prompts files, or a larger --limit if one is set)",
                    capacity, distinct, effective)
    full_meta = dict(meta or {}, capacity_requested=capacity, top_k=collected.top_k,
                     datasets=sorted({p.source for p in collected.prompts}),
                     tasks=sorted({p.task for p in collected.prompts}), tokenizer=collected.tokenizer,
                     tokens=collected.tokens)
    return EAMC.build(collected.eams, effective, seed=seed, meta=full_meta)
