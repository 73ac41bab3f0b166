"""Per-architecture facts, in one table. No other module branches on a model family.

What transformers already states on a module is read from the module, not repeated here: the fused
experts classes decorated by `transformers.integrations.moe.use_experts_implementation` carry
`has_gate`, `has_bias`, `is_transposed`, `is_concatenated` and `_apply_gate`. This table says what the
module cannot: where experts live in a checkpoint and how their tensors are named there.

Expert tensors in the store are kept in the runtime layout of one expert: for the experts interface,
`gate_up_proj` is `module.gate_up_proj[e]` (gate rows then up rows, or interleaved / transposed as the
module declares), `down_proj` is `module.down_proj[e]`, plus `*_bias` where present. For Switch
Transformers they are `wi.weight` and `wo.weight` of `experts.expert_{e}`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class ExpertTensor:
    """How one per-expert runtime tensor is found in a checkpoint.

    `per_expert`: checkpoint suffixes under `<experts module>.<expert id>.`, concatenated along dim 0
    (gate rows then up rows). `fused`: a checkpoint suffix under `<experts module>.` naming a tensor
    of shape [E, ...] whose row e is this expert's tensor. A checkpoint uses one of the two.
    """

    name: str
    per_expert: tuple[str, ...] = ()
    fused: str | None = None
    optional: bool = False


@dataclass(frozen=True)
class ArchSpec:
    """Where a family keeps its experts, at run time and in checkpoints."""

    family: str
    model_types: tuple[str, ...]
    task: Literal["causal-lm", "seq2seq-lm"]
    adapter: Literal["experts-interface", "switch"]
    experts_module: str
    """Regex matching the names of experts modules in the runtime model (`named_modules()`)."""
    expert_id: str
    """How an expert is named under its experts module in per-expert checkpoints: `{e}` or `expert_{e}`."""
    tensors: tuple[ExpertTensor, ...]
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    """Regex renames (checkpoint key -> runtime key) applied to every key before anything else."""
    router: str = r"\.mlp\.gate\.(weight|e_score_correction_bias)$"
    """Regex searched in runtime keys naming the router tensors (hashed into the model fingerprint)."""
    shared_experts_module: str | None = None
    """Regex matching the names of shared-expert MLP modules (run by every token), where a family has them."""
    num_experts_attrs: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts")
    top_k_attrs: tuple[str, ...] = ("num_experts_per_tok", "num_experts_per_token", "moe_k")

    def rename(self, key: str) -> str:
        for pattern, repl in self.checkpoint_renames:
            key = re.sub(pattern, repl, key)
        return key

    def num_experts(self, config: Any) -> int:
        return _first_attr(config, self.num_experts_attrs, "number of experts")

    def top_k(self, config: Any) -> int:
        if self.adapter == "switch":
            return 1
        return _first_attr(config, self.top_k_attrs, "experts per token")


def _first_attr(config: Any, names: tuple[str, ...], what: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"config of model_type {config.model_type!r} has none of {names} ({what})")


_GATED = (
    ExpertTensor("gate_up_proj", per_expert=("gate_proj.weight", "up_proj.weight"), fused="gate_up_proj"),
    ExpertTensor("down_proj", per_expert=("down_proj.weight",), fused="down_proj"),
)
_DECODER_EXPERTS = r"model\.layers\.\d+\.mlp\.experts"

SPECS: tuple[ArchSpec, ...] = (
    ArchSpec(
        family="mixtral",
        model_types=("mixtral", "minimax"),
        task="causal-lm",
        adapter="experts-interface",
        experts_module=_DECODER_EXPERTS,
        expert_id="{e}",
        tensors=(
            ExpertTensor("gate_up_proj", per_expert=("w1.weight", "w3.weight"), fused="gate_up_proj"),
            ExpertTensor("down_proj", per_expert=("w2.weight",), fused="down_proj"),
        ),
        checkpoint_renames=((r"\.block_sparse_moe\.", ".mlp."),),
    ),
    ArchSpec(
        family="qwen-moe",
        model_types=("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"),
        task="causal-lm",
        adapter="experts-interface",
        experts_module=_DECODER_EXPERTS,
        expert_id="{e}",
        tensors=_GATED,
        shared_experts_module=r"\.mlp\.shared_experts?$",  # DeepSeek-V2/V3, Qwen2-MoE
    ),
    ArchSpec(
        family="gpt-oss",
        model_types=("gpt_oss",),
        task="causal-lm",
        adapter="experts-interface",
        experts_module=_DECODER_EXPERTS,
        expert_id="{e}",
        tensors=(
            ExpertTensor("gate_up_proj", fused="gate_up_proj"),
            ExpertTensor("gate_up_proj_bias", fused="gate_up_proj_bias"),
            ExpertTensor("down_proj", fused="down_proj"),
            ExpertTensor("down_proj_bias", fused="down_proj_bias"),
        ),
        router=r"\.mlp\.router\.(weight|bias)$",
    ),
    ArchSpec(
        family="switch",
        model_types=("switch_transformers",),
        task="seq2seq-lm",
        adapter="switch",
        experts_module=r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.mlp\.experts",
        expert_id="expert_{e}",
        tensors=(
            ExpertTensor("wi.weight", per_expert=("wi.weight",)),
            ExpertTensor("wo.weight", per_expert=("wo.weight",)),
        ),
        router=r"\.mlp\.router\.classifier\.weight$",
    ),
)


class UnsupportedModelError(ValueError):
    """The model family is not in the spec table."""


def spec_for(model_type: str) -> ArchSpec:
    """The spec of a transformers `model_type`; an actionable error when unsupported."""
    for spec in SPECS:
        if model_type in spec.model_types:
            return spec
    supported = sorted(t for s in SPECS for t in s.model_types)
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not supported by moeinf; supported: {supported}. "
        "Add an ArchSpec to moeinf/spec.py to support a new family."
    )
