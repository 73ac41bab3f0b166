"""Per-architecture facts. No other module branches on a model family.

What transformers already states is read from it, not repeated here:
- which families have offloadable experts: a modeling module whose experts class is decorated by
  `transformers.integrations.moe.use_experts_implementation` (`detect_experts_interface`); every such
  causal-LM family is supported without a row of its own (`interface_spec`);
- how one expert computes: the decorated module's `has_gate`, `has_bias`, `is_transposed`,
  `is_concatenated` and `_apply_gate`;
- how hub checkpoints name expert tensors: transformers' weight conversion mapping (per-expert tensors
  merged into a fused one, renamed modules), read by the packer (`moeinf/store/source.py`).
The table `SPECS` keeps what none of that says (Switch Transformers' per-expert modules, router names the
fingerprint hashes), and `REFUSED` says, per MoE family that cannot be offloaded, why and what is needed.

Expert tensors in the store are kept in the runtime layout of one expert: for the experts interface,
`gate_up_proj` is `module.gate_up_proj[e]` (gate rows then up rows, or interleaved / transposed as the
module declares), `down_proj` is `module.down_proj[e]`, plus `*_bias` where present. For Switch
Transformers they are `wi.weight` and `wo.weight` of `experts.expert_{e}`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
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
    stacked: bool = False
    """The fused tensor holds each expert's rows as one block along dim 0 ([E*n, ...], DBRX), not [E, ...]."""
    spare_rows: bool = False
    """The fused tensor may hold rows past the E routed experts that no token reaches (LongCat-Flash sizes
    gate_up_proj for its zero-computation experts too); rows 0..E-1 are stored."""


@dataclass(frozen=True)
class ArchSpec:
    """Where a family keeps its experts, at run time and in checkpoints."""

    family: str
    model_types: tuple[str, ...]
    task: Literal["causal-lm", "seq2seq-lm", "multimodal-lm"]
    """`multimodal-lm`: a model of `AutoModelForMultimodalLM` (vision/audio towers kept as dense weights)
    whose experts sit in its language model; text-only inputs generate through it as through HF."""
    adapter: Literal["experts-interface", "switch", "llama4", "dbrx", "jetmoe", "longcat"]
    """How experts are computed: transformers' experts interface, or an adapter (`moeinf.hf.adapters`)."""
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
    dense_params: str | None = None
    """Regex (fullmatch) of parameters under an experts module that are dense weights (JetMoE's MoE block
    holds its router and output bias beside the experts)."""
    num_experts_attrs: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts")
    top_k_attrs: tuple[str, ...] = ("num_experts_per_tok", "num_experts_per_token", "moe_k")

    def auto_class(self) -> type:
        """The transformers auto class that builds this family's generating model."""
        import transformers

        names = {"causal-lm": "AutoModelForCausalLM", "seq2seq-lm": "AutoModelForSeq2SeqLM",
                 "multimodal-lm": "AutoModelForMultimodalLM"}
        return getattr(transformers, names[self.task])

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
        value = config
        for part in name.split("."):  # a sub-config's field: `ffn_config.moe_num_experts`
            value = getattr(value, part, None)
        if isinstance(value, int) and value > 0:
            return value
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:  # a multimodal config: its language model holds the experts
        return _first_attr(text, names, what)
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
        family="llama4",
        model_types=("llama4_text",),
        task="causal-lm",
        adapter="llama4",
        experts_module=r"model\.layers\.\d+\.feed_forward\.experts",
        expert_id="{e}",
        tensors=(ExpertTensor("gate_up_proj", fused="gate_up_proj"),
                 ExpertTensor("down_proj", fused="down_proj")),
        router=r"\.feed_forward\.router\.weight$",
        shared_experts_module=r"\.feed_forward\.shared_expert$",
    ),
    ArchSpec(
        family="dbrx",
        model_types=("dbrx",),
        task="causal-lm",
        adapter="dbrx",
        experts_module=r"transformer\.blocks\.\d+\.ffn\.experts",
        expert_id="{e}",
        tensors=tuple(ExpertTensor(f"mlp.{w}", fused=f"mlp.{w}", stacked=True) for w in ("w1", "v1", "w2")),
        router=r"\.ffn\.router\.layer\.weight$",
        num_experts_attrs=("ffn_config.moe_num_experts",),
        top_k_attrs=("ffn_config.moe_top_k",),
    ),
    ArchSpec(
        family="jetmoe",
        model_types=("jetmoe",),
        task="causal-lm",
        adapter="jetmoe",
        experts_module=r"model\.layers\.\d+\.mlp",  # its MoE block: the parallel experts are two modules
        expert_id="{e}",
        tensors=(ExpertTensor("input_linear.weight", fused="input_linear.weight"),
                 ExpertTensor("output_linear.weight", fused="output_linear.weight")),
        router=r"\.mlp\.router\.layer\.weight$",
        dense_params=r"bias|router\.layer\.weight",
    ),
    ArchSpec(
        family="longcat",
        model_types=("longcat_flash",),
        task="causal-lm",
        adapter="longcat",
        experts_module=_DECODER_EXPERTS,
        expert_id="{e}",
        tensors=(ExpertTensor("gate_up_proj", per_expert=("gate_proj.weight", "up_proj.weight"),
                              fused="gate_up_proj", spare_rows=True),
                 ExpertTensor("down_proj", per_expert=("down_proj.weight",), fused="down_proj")),
        router=r"\.mlp\.router\.(classifier\.weight|e_score_correction_bias)$",
        num_experts_attrs=("n_routed_experts",),
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


_INTERFACE_TENSORS = (
    ExpertTensor("down_proj", per_expert=("down_proj.weight",), fused="down_proj"),
    ExpertTensor("gate_up_proj", per_expert=("gate_proj.weight", "up_proj.weight"), fused="gate_up_proj",
                 optional=True),
    ExpertTensor("up_proj", per_expert=("up_proj.weight",), fused="up_proj", optional=True),
    ExpertTensor("gate_up_proj_bias", fused="gate_up_proj_bias", optional=True),
    ExpertTensor("up_proj_bias", fused="up_proj_bias", optional=True),
    ExpertTensor("down_proj_bias", fused="down_proj_bias", optional=True),
)
"""Every tensor an experts-interface module may hold (down_proj first: the store's dtype is read from it)."""
_INTERFACE_EXPERTS = r"(?:[\w.]+\.)?layers\.\d+\.(?:(?:mlp|feed_forward|block_sparse_moe|mixer)\.)?experts"
"""Where decoder families put their MoE block's experts (a text tower's `language_model.` included)."""
_INTERFACE_ROUTER = (r"\.(?:gate|router)(?:\.gate|\.layer|\.wg|\.proj|\.down_proj|\.router_mlp\.\w+)?"
                     r"\.(?:weight|bias|e_score_correction_bias|tid2eid|balancing_biases|per_expert_scale"
                     r"|scale)$")
"""Router tensors under checkpoint or runtime names (the fingerprint hashes them)."""

REFUSED: dict[str, str] = {
    "llama4": "transformers' Llama4ForConditionalGeneration.forward fails on any input in this version (it "
              "reads image_outputs from its language model's output), so there is no reference to be exact "
              "against; its language model is supported as llama4_text: a llama4_text checkpoint of the "
              "text_config and language_model.* tensors is needed",
    "doge": "its cross-domain MoE is a product-key retrieval over embedding tables, not routed expert MLPs: "
            "there are no experts modules to offload",
    "nllb-moe": "an encoder-decoder translation model with capacity-dropping NllbMoeSparseMLP experts; a "
                "seq2seq adapter like Switch Transformers' is needed",
    "step3p7": "a multimodal model whose experts (Step3p7MoEMLP) are not transformers' experts interface; an "
               "adapter is needed",
    "step3p5": "the text model of step3p7, whose experts (Step3p7MoEMLP) are not transformers' experts "
               "interface; an adapter is needed",
    "vitpose_backbone": "a vision backbone whose 'experts' are per-dataset output heads, not routed experts",
}
"""MoE families of transformers that moeinf refuses, with why and what would be needed."""

_DENSE_CONVERSION = ("its hub checkpoints store dense tensors that transformers converts on load ({}); "
                     "moeinf's packer copies dense tensors as stored: a dense conversion step in pack is "
                     "needed")
_NOT_VERIFIED = ("its experts use transformers' experts interface, but moeinf has not yet checked a tiny "
                 "checkpoint of it bit-exact against transformers ({}); verify it to support it")
_META_BUFFER = ("{} is a non-persistent buffer of a module without a config, which moeinf's meta-device "
                "build cannot recompute; rebuilding them through transformers' _init_weights is needed")
REFUSED.update({
    "bailing_hybrid": _DENSE_CONVERSION.format("q/k/v_conv1d concatenated"),
    "kimi_linear": _DENSE_CONVERSION.format("q/k/v_conv1d concatenated"),
    "lara_mini": _DENSE_CONVERSION.format("linear_attn.in_proj split"),
    "glm5_next": _DENSE_CONVERSION.format("self_attn.k_conv1d concatenated into conv1d"),
    "inkling2_loop": _DENSE_CONVERSION.format("middle_cycle_cross_pass_kv_queries merged into message_input"),
    "inkling2_loop_text": _DENSE_CONVERSION.format("middle_cycle_cross_pass_kv_queries merged into "
                                                   "message_input"),
    "minimax_m3_vl": _DENSE_CONVERSION.format("shared experts' gate_proj and up_proj concatenated"),
    "mistral_large4": _DENSE_CONVERSION.format("vision attention wq/wk permuted for rope"),
    "unlimited_ocr": _DENSE_CONVERSION.format("vision qkv_proj chunked into q/k/v"),
    "inkling2": _DENSE_CONVERSION.format("lm_head unpadded from the padded unembed"),
    "inkling2_text": _DENSE_CONVERSION.format("lm_head unpadded from the padded unembed"),
    "inkling_mm_model": _DENSE_CONVERSION.format("shared experts' w13 interleaved and chunked"),
    "diffusion_gemma": ("a block-diffusion model (DiffusionGemmaForBlockDiffusion) that denoises blocks of "
                        "tokens through an encoder, not the left-to-right causal generation moeinf's runtime "
                        "drives; a runtime for its denoising loop is needed"),
    "mistral4": _NOT_VERIFIED.format("transformers' own forward fails on the tiny config (interleaved rotary "
                                     "dims of its multi-head latent attention); a tiny config that runs is "
                                     "needed"),
    "muse_spark": _NOT_VERIFIED.format("its vision tower's per-stage patch_sizes/hidden_sizes/depths were "
                                       "not shrunk with the tower; a tiny config that builds is needed"),
    "dots3_note": _NOT_VERIFIED.format("its tiny audio/vision towers did not build (adapter sizes); a tiny "
                                       "config that builds is needed"),
    "deepseek_ocr2": _NOT_VERIFIED.format("its SAM vision encoder is not shrunk by the generic tiny sizes, "
                                          "so the run did not finish here; a tiny config is needed"),
    "ernie4_5_vl_moe": ("each MoE layer holds two expert sets (text_moe and vision_moe experts, routed by "
                        "token modality); moeinf's store keeps one experts module per layer: a store and "
                        "routing keyed by (layer, expert set) is needed"),
    "gemma4": _META_BUFFER.format("its scaled word embedding's embed_scale"),
    "gemma4_text": _META_BUFFER.format("its scaled word embedding's embed_scale"),
    "qwen3_omni_moe_thinker": _META_BUFFER.format("its audio tower's sinusoid positional_embedding"),
})


class UnsupportedModelError(ValueError):
    """The model family is neither in the spec table nor offloadable through the experts interface."""


def package_source(model_type: str, kind: Literal["modeling", "configuration"]) -> str:
    """The source text of `model_type`'s modeling or configuration module in the installed transformers
    ("" when it has none); read, not imported, so a walk over every family stays fast."""
    import transformers.models
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    package = model_type_to_module_name(model_type)
    for root in transformers.models.__path__:
        path = Path(root) / package / f"{kind}_{package}.py"
        if path.is_file():
            return path.read_text(encoding="utf-8")
    return ""


_DECORATED = re.compile(r"^@use_experts_implementation\b[^\n]*\n(?:@[^\n]*\n)*class (\w+)\(", re.MULTILINE)


@cache
def detect_experts_interface(model_type: str) -> tuple[str, ...]:
    """Names of the experts classes of `model_type`'s modeling module that use transformers' experts
    interface (decorated by `@use_experts_implementation`); () if none. The flags the decorator sets are
    read from the module instances when the model is built (`moeinf.hf.integrate.kernel_for`)."""
    return tuple(sorted(set(_DECORATED.findall(package_source(model_type, "modeling")))))


def causal_lm(model_type: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def multimodal_lm(model_type: str) -> bool:
    """Whether transformers builds `model_type` with `AutoModelForMultimodalLM` (a model that generates text
    from text and images, video or audio)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES


@cache
def interface_spec(model_type: str) -> ArchSpec | None:
    """The spec of a causal-LM or multimodal-LM family whose experts use transformers' experts interface;
    None otherwise."""
    if not detect_experts_interface(model_type):
        return None
    if not causal_lm(model_type) and not multimodal_lm(model_type):
        return None
    return ArchSpec(
        family=model_type,
        model_types=(model_type,),
        task="causal-lm" if causal_lm(model_type) else "multimodal-lm",
        adapter="experts-interface",
        experts_module=_INTERFACE_EXPERTS,
        expert_id="{e}",
        tensors=_INTERFACE_TENSORS,
        router=_INTERFACE_ROUTER,
        shared_experts_module=r"\.(?:mlp|feed_forward|block_sparse_moe|mixer)\.shared_experts?$",
        num_experts_attrs=("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
        top_k_attrs=("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts"),
    )


def refusal(model_type: str) -> str | None:
    """Why `model_type` cannot be offloaded, for a MoE family moeinf does not support; None otherwise."""
    if model_type in REFUSED:
        return REFUSED[model_type]
    if detect_experts_interface(model_type) and not causal_lm(model_type) and not multimodal_lm(model_type):
        return ("transformers has no causal-LM or multimodal-LM class for it (a sub-model of a composite "
                "model, or a classifier): nothing generates text from it alone; offload the model that "
                "contains it")
    return None


def spec_for(model_type: str) -> ArchSpec:
    """The spec of a transformers `model_type`; an actionable error when unsupported."""
    for spec in SPECS:
        if model_type in spec.model_types:
            return spec
    reason = refusal(model_type)
    spec = interface_spec(model_type) if reason is None else None
    if spec is not None:
        return spec
    if reason is not None:
        raise UnsupportedModelError(f"model_type {model_type!r} cannot be offloaded: {reason}")
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not supported by moeinf: it is not a MoE family whose experts use "
        "transformers' experts interface (@use_experts_implementation), nor in moeinf/spec.py's table"
    )
