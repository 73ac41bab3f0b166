"""A DeepSeek-V3 model body's decode step on one row, without the work whose result is known in advance.

At a decode step of one sequence that pads nothing, transformers' `DeepseekV3Model.forward` builds a causal
mask only to find that none is needed (SDPA attends one query row to every cached key without a mask:
`masking_utils.create_causal_mask` returns None), and runs its forward through three decorators that merge
config defaults, capture outputs nobody asked for and rename a deprecated argument. On the e2e int4 store
at one thread the body's work around its layers took 1.06 ms per token with them and 0.82 ms without (ten
alternating decodes, medians; a token ~20 ms).

`OneRowBody` is the body's forward: such a step runs the same modules in the same order (embedding, rotary
embedding, each decoder layer, final norm), each through its `__call__` so every hook still runs, with the
mask None. Any other call (prefill, batches, a padding mask, `past_key_values`, `output_hidden_states` or
any other keyword, another attention implementation, a static cache) runs the body's own forward. The
logits are the body's own, bit for bit (tests).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

OUTPUT_FLAGS = ("output_hidden_states", "output_attentions", "output_router_logits")
"""Config flags that make the body's forward return more than its last hidden state."""


class OneRowBody:
    """The `forward` of a DeepSeek-V3 model body (`body`): a one-row decode step without a padding mask runs
    without the mask construction and decorators, everything else as the body's own forward (module
    docstring). Set on the instance, as `OneRowDecode` is on its layers, so names and attributes stay."""

    def __init__(self, body: nn.Module) -> None:
        from transformers.modeling_outputs import MoeModelOutputWithPast

        self.body = body
        self.own = type(body).forward
        self.output = MoeModelOutputWithPast

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache: Any = None,
                 inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                 **kwargs: Any) -> Any:
        if kwargs or not self.one_row(input_ids, attention_mask, cache, inputs_embeds, use_cache):
            return self.own(self.body, input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                            use_cache=use_cache, **kwargs)
        body = self.body
        hidden_states = body.embed_tokens(input_ids)
        if position_ids is None:
            past = cache.get_seq_length()
            position_ids = (torch.arange(1, device=hidden_states.device) + past).unsqueeze(0)
        position_embeddings = body.rotary_emb(hidden_states, position_ids)
        for layer in body.layers:
            hidden_states = layer(hidden_states, position_embeddings=position_embeddings, attention_mask=None,
                                  position_ids=position_ids, cache=cache, use_cache=use_cache)
        return self.output(last_hidden_state=body.norm(hidden_states), cache=cache)

    def one_row(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, cache: Any,
                inputs_embeds: torch.Tensor | None, use_cache: bool | None) -> bool:
        """Whether this call is a decode step of one token of one sequence on a dynamic cache, no padding
        mask, SDPA attention, nothing more to return: the steps where the body's mask is None."""
        if input_ids is None or inputs_embeds is not None or attention_mask is not None or cache is None \
                or use_cache is not True or input_ids.shape != (1, 1):
            return False
        config = self.body.config
        return (config._attn_implementation == "sdpa" and getattr(config, "is_causal", True)
                and not getattr(cache, "is_compileable", False) and not torch.compiler.is_compiling()
                and len(self.body.layers) == config.num_hidden_layers
                and not any(getattr(config, flag, False) for flag in OUTPUT_FLAGS))


def flatten_decode_body(model: nn.Module) -> list[str]:
    """Give each DeepSeek-V3 model body in `model` a `OneRowBody` as its forward; their names."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Model

    targets = [name for name, module in model.named_modules() if type(module) is DeepseekV3Model]
    for name in targets:
        body = model.get_submodule(name)
        body.forward = OneRowBody(body)
    return targets
