"""Families built as a user would build them, not as moeinf's own tiny models are.

`moeinf.hf.tiny` sizes each family with care (every MoE code path kept, routers widened). Here a config is
guessed the way a user would write one, `AutoConfig.for_model(model_type, hidden_size=64, ...)` with only
the fields that family's config has, and transformers' own random init: other layer counts, other
first-dense / interleaving patterns, shared experts as the config defaults them. The checkpoint is saved with
`save_pretrained` in bf16 and offloaded at 30%: greedy tokens and logits must be `torch.equal` to
unmodified transformers'.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

GUESS = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, num_experts=8,
    num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
    shared_expert_intermediate_size=64, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1,
)
"""What a user would try for a tiny MoE model; a field is passed only where the family's config has it."""
NEW_TOKENS = 16


def user_config(model_type: str):
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    values = {key: value for key, value in GUESS.items() if key in defaults}
    if "kv_lora_rank" in defaults:  # multi-head latent attention: one latent per head, head_dim is rope's
        values["num_key_value_heads"] = values["num_attention_heads"]
        if "head_dim" in defaults:
            values["head_dim"] = values["qk_rope_head_dim"]
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists sized for the 4 layers asked for
        per_layer = defaults.get(key)
        if isinstance(per_layer, list) and per_layer and isinstance(per_layer[0], str):
            values[key] = (list(dict.fromkeys(per_layer)) * 4)[:4]
        elif isinstance(per_layer, list):
            values[key] = [layer for layer in per_layer if layer < 4]
    return AutoConfig.for_model(model_type, bos_token_id=1, eos_token_id=2, pad_token_id=0, **values)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe"])
def test_a_users_tiny_config_is_exact(model_type: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from moeinf import MoE
    from moeinf.config import OffloadConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(user_config(model_type), dtype=torch.bfloat16).save_pretrained(
        tmp_path / "model")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.bfloat16).eval()
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # a shorter, left-padded second prompt
    full_mask = torch.cat([mask, torch.ones(2, NEW_TOKENS, dtype=mask.dtype)], dim=1)
    greedy = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    with torch.inference_mode():
        want = reference.generate(input_ids=ids, attention_mask=mask, **greedy)
        want_logits = reference(input_ids=want, attention_mask=full_mask).logits
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache="30%")
    with MoE(tmp_path / "model", config) as moe, torch.inference_mode():
        got = moe.generate(ids, attention_mask=mask, **greedy)
        got_logits = moe(got, attention_mask=full_mask).logits
        misses = moe.stats()["misses"]
    assert torch.equal(got, want)
    assert torch.equal(got_logits, want_logits)  # bit for bit, not allclose
    assert misses > 0  # 30% of the experts: some were fetched on demand
