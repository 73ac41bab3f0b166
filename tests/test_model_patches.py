"""The patches of a model instance are declared per architecture and applied in their declared order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from moeinf import MoE, OffloadConfig
from moeinf.models import ARCHITECTURES, Build, Patch, apply, patches_for
from moeinf.models import deepseek_v3 as ds
from moeinf.models.patches import ATTENTION_LINEARS, BF16_LINEARS, SHARED


def test_a_family_without_a_list_takes_the_shared_one_and_deepseek_v3_its_own() -> None:
    assert patches_for("qwen3_moe") is SHARED
    assert patches_for("deepseek_v3") is ds.PATCHES is ARCHITECTURES["deepseek_v3"]
    order = ds.PATCHES.index
    assert order(ds.ABSORBED_MLA) < order(ATTENTION_LINEARS)  # absorbing copies kv_b_proj's exact weight
    assert order(BF16_LINEARS) < order(ds.EXACT_LAYERS)  # the flat layer reads what BF16_LINEARS did
    phases = [p.phase for p in ds.PATCHES]
    assert phases == sorted(phases, key=["modules", "forwards"].index)  # forwards after every module


def test_apply_runs_one_phase_in_order_and_only_what_applies() -> None:
    seen: list[str] = []

    def record(model: nn.Module, build: Build) -> object:
        seen.append(build.config.device)
        return None

    patches = (Patch("b", "modules", lambda b: True, record),
               Patch("skipped", "modules", lambda b: False, record),
               Patch("later", "forwards", lambda b: True, record),
               Patch("a", "modules", lambda b: True, record))
    build = Build(OffloadConfig(), spec=None, quant=None, row_kernel=False)  # type: ignore[arg-type]
    assert apply(nn.Linear(1, 1), patches, build, "modules") == ["b", "a"]
    assert apply(nn.Linear(1, 1), patches, build, "forwards") == ["later"]
    assert seen == ["cpu"] * 3


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_an_exact_cpu_build_applies_its_architectures_patches(family: str, tiny_model_dir,
                                                                tmp_path: Path) -> None:
    config = OffloadConfig(offload_dir=str(tmp_path / "store"), device_cache=1.0)
    with MoE(tiny_model_dir(family), config) as moe, torch.inference_mode():
        applied = moe._runtime.patches
        moe.model(torch.tensor([[3, 4, 5]]))
    expected = [p.name for p in patches_for(family) if p.applies(
        Build(config, spec=None, quant=None, row_kernel=config.bf16_row_kernel))]  # type: ignore[arg-type]
    assert list(applied) == expected
    assert (ds.EXACT_LAYERS.name in applied) is (family == "deepseek_v3")
