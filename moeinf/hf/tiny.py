"""Small real-architecture checkpoints for tests and examples (no download: built from configs).

Each family's config is the real transformers config class at a tiny size; `save_tiny` writes it with
`save_pretrained`, which exercises the same loading path as a downloaded checkpoint (transformers 5 saves
the hub layout: per-expert tensors, the family's module names). `FAMILIES` fixes the sizes of the families
the exactness tests route as the released models do; any other model_type is shrunk generically
(`SIZES`: every size field its config has, `EXTRA`: what a family needs on top).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "deepseek_v3": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32,
        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    ),
    "olmoe": dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
    ),
    "gpt_oss": dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "switch_transformers": dict(
        d_model=64, d_ff=32, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=8,
        encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=64,
    ),
}
VOCAB_SIZE = 128

SIZES: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    expert_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2,
    moe_k=2, moe_topk=2, n_shared_experts=1, moe_num_shared_experts=1, num_shared_experts=1, n_group=2,
    topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, max_position_embeddings=256, sliding_window=8,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    shared_experts_intermediate_size=48, index_topk=4, index_head_dim=16, index_n_heads=2, o_lora_rank=16,
    o_groups=2, vocab_size_per_layer_input=VOCAB_SIZE, hidden_size_per_layer_input=16, top_k_experts=2,
    unpadded_vocab_size=VOCAB_SIZE, swa_head_dim=16, sliding_window_size=8, rel_extent=8,
)
"""Size fields set on any family's config that has them (a tiny model, every MoE code path kept)."""
EXTRA: dict[str, dict[str, Any]] = {
    "gemma4_text": dict(enable_moe_block=True),
    "dots3_note_text": dict(per_layer_config={}, head_dim=16),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0,
                  mamba_dt_rank=8, use_mamba_kernels=False),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=32,
                             mamba_d_state=16, mamba_chunk_size=16, shared_intermediate_size=48),
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"],
                       mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
                       moe_shared_expert_intermediate_size=48, use_mamba_kernels=False),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"], num_dense_layers=1),
    "zaya": dict(num_experts_per_tok=1),
    "glm4v_moe_text": dict(rope_parameters=dict(rope_theta=10000.0, partial_rotary_factor=0.5,
                                                 rope_type="default", mrope_section=[2, 1, 1])),
    "hy_v4_vl_text": dict(pad_token_id=0),
    "ernie4_5_vl_moe_text": dict(moe_intermediate_size=[32, 32], rope_parameters=dict(
        rope_theta=500000.0, rope_type="default", mrope_section=[3, 3, 2])),
    "glm5_next_text": dict(index_topk=16, pad_token_id=0, qk_rope_head_dim=0),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2),
    "bailing_hybrid": dict(num_expert_group=2, topk_group=1, layer_group_size=3),
    "llama4_text": dict(num_hidden_layers=4, moe_layers=[1, 3], layer_types=None, no_rope_layers=None,
                        intermediate_size_mlp=128, attention_chunk_size=16, num_experts_per_tok=1),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=3, max_seq_len=256,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=4)),
    "jetmoe": dict(kv_channels=16),
    "longcat_flash": dict(num_layers=2, zero_expert_num=4, expert_ffn_hidden_size=32, ffn_hidden_size=96),
}
"""Per model_type, what the generic sizes do not cover (hybrid layer patterns, state sizes); a multimodal
model_type without an entry uses its text model's (`<model_type>_text`)."""
COMPOSITE_EXTRA: dict[str, dict[str, Any]] = {
    "qwen3_omni_moe_thinker": dict(vision_start_token_id=VOCAB_SIZE + 1),  # read by its rope index, unset
}
"""Per multimodal model_type, fields of the composite config itself."""
SUB_SIZES: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, depth=1, num_hidden_layers=1, num_layers=1, encoder_layers=1,
    num_heads=2, num_attention_heads=2, num_key_value_heads=2, encoder_attention_heads=2, d_model=32,
    encoder_ffn_dim=64, out_hidden_size=SIZES["hidden_size"], embed_dim=32, output_dim=SIZES["hidden_size"],
    projection_dim=32, text_hidden_size=SIZES["hidden_size"], adapter_in_dim=32, adapter_input_size=32,
)
"""Sizes of a multimodal model's other towers (vision, audio): one small layer each; they stay dense."""
_PER_LAYER = ("layer_types", "mlp_layer_types", "mlp_only_layers", "moe_layers", "layers_block_type")

REAL_TOP_K: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe-top8": ("qwen3_moe", dict(num_experts=32, num_experts_per_tok=8)),
    "olmoe-top8": ("olmoe", dict(num_experts=32, num_experts_per_tok=8)),
    "deepseek_v3-top8": ("deepseek_v3", dict(n_routed_experts=64, num_experts_per_tok=8, n_group=8,
                                             topk_group=4)),
    "qwen2_moe-top4": ("qwen2_moe", dict(num_experts=16, num_experts_per_tok=4)),
    "gpt_oss-top4": ("gpt_oss", dict(num_local_experts=32, num_experts_per_tok=4)),
    "mixtral-top2": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "mixtral-top4": ("mixtral", dict(num_local_experts=16, num_experts_per_tok=4)),
    "switch_transformers-top1": ("switch_transformers", {}),
}
"""Tiny models routed as the real ones are (name -> family, overrides of FAMILIES): the top-k of the released
checkpoints (DeepSeek-V3 with its expert groups, Qwen2-MoE with its shared expert), used by the exactness
tests and `moeinf bench exact`."""


def tiny_config(family: str, **overrides: Any) -> Any:
    """The transformers config of a tiny model of `family` (a key of FAMILIES or any model_type)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if family in FAMILIES:
        values: dict[str, Any] = dict(FAMILIES[family], vocab_size=VOCAB_SIZE)
    elif family in CONFIG_MAPPING_NAMES:
        values = generic_sizes(family)
    else:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)} or a transformers "
                         "model_type")
    if family == "switch_transformers":
        values.update(decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    else:
        values.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    values.update(overrides)
    return AutoConfig.for_model(family, **values)


def generic_sizes(model_type: str) -> dict[str, Any]:
    """Tiny sizes for `model_type`: the SIZES fields its default config has, per-layer lists dropped (the
    config derives them for the new depth) unless EXTRA gives them. A composite config (a multimodal
    model) gets them in its `text_config`, where the experts are."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    composite = isinstance(defaults.get("text_config"), dict)
    fields = defaults["text_config"] if composite else defaults
    values = {key: value for key, value in SIZES.items() if key in fields}
    values["vocab_size"] = VOCAB_SIZE
    if "kv_lora_rank" in fields:  # multi-head latent attention: one latent per head, head_dim is rope's
        values["num_key_value_heads"] = values["num_attention_heads"]
        if "head_dim" in fields:
            values["head_dim"] = values["qk_rope_head_dim"]
    depth = values.get("num_hidden_layers", fields.get("num_hidden_layers"))
    extra = EXTRA.get(model_type, EXTRA.get(f"{model_type}_text", {}) if composite else {})
    for key in _PER_LAYER:
        if fields.get(key) is not None and key not in extra:
            values[key] = _tiny_pattern(fields[key], depth)
    _scale_mrope(fields, values)
    values.update(extra)
    if not composite:
        return values
    towers = {key: _tiny_tower(sub) for key, sub in defaults.items()
              if key != "text_config" and key.endswith("_config") and isinstance(sub, dict)}
    return {"text_config": values, "vocab_size": VOCAB_SIZE, **towers, **COMPOSITE_EXTRA.get(model_type, {})}


def _tiny_tower(fields: dict[str, Any]) -> dict[str, Any]:
    """SUB_SIZES for a vision or audio tower's config; its lists of layer indices kept below its depth."""
    values = {key: value for key, value in SUB_SIZES.items() if key in fields}
    depth = min((values[k] for k in ("depth", "num_hidden_layers", "num_layers") if k in values), default=1)
    for key, value in fields.items():
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value) and key.endswith(
                ("indexes", "indices", "layer_ids", "_layers")):
            values[key] = [v for v in value if v < depth]
    if isinstance(fields.get("per_layer_config"), dict):
        values["per_layer_config"] = {k: v for k, v in fields["per_layer_config"].items() if int(k) < depth}
    return values


def _scale_mrope(fields: dict[str, Any], values: dict[str, Any]) -> None:
    """Multimodal rotary sections (`mrope_section`, summing to half the rotary dims) scaled to the tiny
    head_dim, so the sections still cover the rotary dims exactly."""
    rope = dict(fields.get("rope_parameters") or {})
    section = rope.get("mrope_section")
    if not section or "head_dim" not in values:
        return
    old_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    total = sum(section) * values["head_dim"] // old_dim
    scaled = [s * values["head_dim"] // old_dim for s in section]
    scaled[0] += total - sum(scaled)
    values["rope_parameters"] = {**rope, "mrope_section": scaled}


def _tiny_pattern(per_layer: list, depth: int) -> list | None:
    """A per-layer list for `depth` layers: every kind the full list has, in order of first use, then its
    last kind (hybrid models end on full attention); layer indices kept if below `depth`."""
    if not per_layer or not all(isinstance(v, str) for v in per_layer):
        return [v for v in per_layer if isinstance(v, int) and v < depth] if per_layer else per_layer
    kinds = list(dict.fromkeys(per_layer))[:depth]
    return kinds + [per_layer[-1]] * (depth - len(kinds))


def save_tiny(family: str, out_dir: str | Path, *, seed: int = 0, dtype: str = "float32",
              **overrides: Any) -> Path:
    """Build a randomly initialised tiny model of `family` and `save_pretrained` it to `out_dir`."""
    import re

    import torch

    from ..spec import spec_for

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    spec = spec_for(config.model_type)
    model = spec.auto_class().from_config(config, dtype=getattr(torch, dtype))
    # Random routers at init send almost every token to the same experts; widen the router so tests
    # see many experts activated.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("weight") and re.search(spec.router, name):
                param.normal_(0.0, 1.0)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
