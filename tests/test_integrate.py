"""The meta-device skeleton + per-instance experts replacement, checked against from_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from moeinf.hf.integrate import ExpertsSite, experts_sites
from moeinf.hf.model import build_offloaded_model
from moeinf.hf.tiny import FAMILIES
from moeinf.kernels.moe import Dispatch, ExpertKernel, ExpertOutputs
from moeinf.spec import spec_for
from moeinf.store import Store, pack


class ReadExperts(nn.Module):
    """Experts read with plain reads from the store: the HF layer alone, without engine or policies."""

    def __init__(self, store: Store, site: ExpertsSite, kernel: ExpertKernel, switch: bool) -> None:
        super().__init__()
        self.store, self.layer, self.kernel, self.switch = store, site.layer, kernel, switch

    def forward(self, hidden_states: torch.Tensor, index: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        if self.switch:
            dispatch = index.reshape(hidden_states.shape[0], -1)
            index = torch.where(dispatch.sum(-1, keepdim=True) > 0, dispatch.argmax(-1, keepdim=True), -1)
        dispatch = Dispatch(index, self.store.index.num_experts, stable=self.kernel.stable)
        outputs = ExpertOutputs(hidden_states, weights, dispatch)
        for expert in dispatch.groups:
            outputs.compute(expert, self.kernel, self.store.read_expert(self.layer, expert))
        return outputs.result()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_skeleton_with_store_weights_matches_from_pretrained(family: str, tiny_model_dir,
                                                             tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    model_dir = tiny_model_dir(family)
    pack(model_dir, tmp_path / "store", progress=False)
    store = Store(tmp_path / "store")
    spec = spec_for(store.index.model_type)
    switch = spec.adapter == "switch"
    model, sites = build_offloaded_model(tmp_path / "store", spec, store.load_dense(),
                                         lambda site, kernel: ReadExperts(store, site, kernel, switch))
    auto = AutoModelForSeq2SeqLM if switch else AutoModelForCausalLM
    ref = auto.from_pretrained(model_dir).eval()
    assert [s.name for s in sites] == [s.name for s in experts_sites(ref, spec)] == store.index.modules
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    ref_buffers = dict(ref.named_buffers())
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, ref_buffers[name], rtol=0, atol=0)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    extra = {"decoder_input_ids": torch.zeros((2, 2), dtype=torch.long)} if switch else {}
    with torch.inference_mode():
        torch.testing.assert_close(model(ids, **extra).logits, ref(ids, **extra).logits)
        kw = dict(max_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
