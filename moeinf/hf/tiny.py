"""Small real-architecture checkpoints for tests and examples (no download: built from configs).

Each family's config is the real transformers config class at a tiny size; `save_tiny` writes it with
`save_pretrained`, which exercises the same loading path as a downloaded checkpoint.
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
    """The transformers config of a tiny model of `family` (a key of FAMILIES)."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    values: dict[str, Any] = dict(FAMILIES[family], vocab_size=VOCAB_SIZE)
    if family == "switch_transformers":
        values.update(decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    else:
        values.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    values.update(overrides)
    return AutoConfig.for_model(family, **values)


def save_tiny(family: str, out_dir: str | Path, *, seed: int = 0, dtype: str = "float32",
              **overrides: Any) -> Path:
    """Build a randomly initialised tiny model of `family` and `save_pretrained` it to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from ..spec import spec_for

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if spec_for(config.model_type).task == "seq2seq-lm" else AutoModelForCausalLM
    model = auto.from_config(config, dtype=getattr(torch, dtype))
    # Random routers at init send almost every token to the same experts; widen the router so tests
    # see many experts activated.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "router.weight", "router.classifier.weight")):
                param.normal_(0.0, 1.0)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
