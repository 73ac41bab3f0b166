"""Quantised expert stores: formats, packing, the quantised kernels and the runtime on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeinf import MoE, OffloadConfig
from moeinf.builder import budget_of, default_offload_dir
from moeinf.commands.pack import add_arguments
from moeinf.commands.pack import run as run_pack
from moeinf.config import ConfigError
from moeinf.kernels.quant_experts import quantised_linear
from moeinf.store import Store, StoreError, pack, verify
from moeinf.store.index import INDEX_NAME
from moeinf.store.quant import Quantization, check_runtime, quantise


def dequantised(weight: torch.Tensor, quant: Quantization) -> torch.Tensor:
    """The weight the quantised kernel multiplies by: the kernel applied to the identity, transposed."""
    parts = quantise(weight, quant)
    eye = torch.eye(weight.shape[1], dtype=weight.dtype)
    names = {f"w.{k}": v for k, v in parts.items()}
    return quantised_linear(eye, names, "w", quant, tuple(weight.shape)).T  # [N, K]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 128), (128, 48), (40, 64)])
def test_int8_rounds_each_weight_to_its_row_scale(shape: tuple[int, int], dtype: torch.dtype) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    quant = Quantization.of("int8")
    parts = quantise(weight, quant)
    assert parts["qweight"].dtype == torch.int8 and parts["scales"].shape == (shape[0],)
    scale = parts["scales"].float()[:, None]
    error = (dequantised(weight, quant).float() - weight.float()).abs()
    # half a step of rounding, plus the kernel's own rounding of the output to `dtype`
    slack = 0.0 if dtype == torch.float32 else weight.float().abs().amax() * 2**-7
    assert (error <= scale / 2 * 1.001 + slack + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "group"),
                         [((96, 128), 32), ((128, 48), 32), ((40, 64), 64), ((64, 256), 128)])
def test_int4_fits_each_group_within_half_a_step(shape: tuple[int, int], group: int,
                                                 dtype: torch.dtype) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    quant = Quantization.of("int4", group)
    parts = quantise(weight, quant)
    rows = -(-shape[0] // 16) * 16
    cols = -(-shape[1] // group) * group
    assert parts["qweight"].shape == (rows, cols // 2) and parts["scales"].shape == (cols // group, rows, 2)
    step = parts["scales"][..., 0].float().T.repeat_interleave(group, dim=1)[: shape[0], : shape[1]]  # [N, K]
    error = (dequantised(weight, quant).float() - weight.float()).abs()
    slack = 0.0 if dtype == torch.float32 else weight.float().abs().amax() * 2**-7
    assert (error <= step / 2 * 1.01 + slack + 1e-5).all()
    # and the quantisation is not the identity (a 4-bit grid is coarse)
    assert error.max() > 0


def test_quantisation_settings_are_checked() -> None:
    assert Quantization.of("int4") == Quantization("int4", 32)
    assert Quantization.of("int8") == Quantization("int8", 0)
    with pytest.raises(ValueError, match="int4 group size"):
        Quantization.of("int4", 48)
    with pytest.raises(ValueError, match="one scale per output row"):
        Quantization.of("int8", 32)
    with pytest.raises(ValueError, match="scheme"):
        Quantization.of("int3")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_pack_quantised_store(scheme: str, tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("qwen3_moe")
    exact = Store(pack(model_dir, tmp_path / "exact", progress=False) and tmp_path / "exact")
    quant = Quantization.of(scheme)
    index = pack(model_dir, tmp_path / scheme, quant=quant, progress=False)
    store = Store(tmp_path / scheme)
    assert index.quant["scheme"] == scheme and index.quant["group_size"] == quant.group_size
    assert index.dtype == exact.index.dtype  # the compute dtype, also the scales'
    assert store.fingerprint == exact.fingerprint
    assert store.expert_bytes < exact.expert_bytes
    assert verify(tmp_path / scheme) == []
    recorded = json.loads((tmp_path / scheme / INDEX_NAME).read_text())["quant"]
    assert recorded["shapes"] == {"gate_up_proj": [64, 64], "down_proj": [64, 32]}
    # every expert's blob holds exactly the quantisation of that expert's exact tensors
    for layer, expert in [(0, 0), (1, 5), (2, 7)]:
        want = exact.read_expert(layer, expert)
        got = store.read_expert(layer, expert)
        for name in ("gate_up_proj", "down_proj"):
            for part, tensor in quantise(want[name], quant).items():
                assert torch.equal(got[f"{name}.{part}"], tensor)
    # packing the same way again is a no-op; another way is refused
    assert pack(model_dir, tmp_path / scheme, quant=quant, progress=False) == index
    with pytest.raises(StoreError, match="exact one asked for"):
        pack(model_dir, tmp_path / scheme, progress=False)
    with pytest.raises(StoreError, match=f"not the {scheme}"):
        pack(model_dir, tmp_path / "exact", quant=quant, progress=False)
    # an exact store's index does not mention quantisation at all
    assert "quant" not in json.loads((tmp_path / "exact" / INDEX_NAME).read_text())


def test_pack_refuses_experts_it_cannot_quantise(tiny_model_dir, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--quant handles experts made of"):
        pack(tiny_model_dir("gpt_oss"), tmp_path / "store", quant=Quantization.of("int8"), progress=False)
    assert not (tmp_path / "store").exists()


def test_runtime_refuses_another_int4_layout(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("qwen3_moe")
    pack(model_dir, tmp_path / "int4", quant=Quantization.of("int4"), progress=False)
    record = Store(tmp_path / "int4").index.quant
    assert check_runtime(record, tmp_path) == Quantization.of("int4")
    with pytest.raises(StoreError, match="another torch int4 weight layout"):
        check_runtime({**record, "probe": "0" * 32}, tmp_path)


def test_a_slot_budget_holds_proportionally_more_quantised_experts(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("qwen3_moe", hidden_size=256, moe_intermediate_size=128)
    exact = Store(pack(model_dir, tmp_path / "exact", progress=False) and tmp_path / "exact")
    int4 = Store(pack(model_dir, tmp_path / "int4", quant=Quantization.of("int4"), progress=False)
                 and tmp_path / "int4")
    budget = OffloadConfig(device_cache=4 * exact.max_blob_size)
    assert budget_of(budget, exact).slots == 4
    assert budget_of(budget, int4).slots == 4 * exact.max_blob_size // int4.max_blob_size > 4 * 3


# Largest logit error over the logits' spread; bf16 adds its own rounding (8 bits of mantissa) on top.
TOLERANCE = {("int8", "float32"): 0.02, ("int8", "bfloat16"): 0.05, ("int4", "float32"): 0.2,
             ("int4", "bfloat16"): 0.25}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runtime_on_quantised_experts_stays_close_to_hf(scheme: str, dtype: str, tiny_model_dir,
                                                        tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("deepseek_v3", dtype=dtype)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        want = ref(ids).logits.float()
    # The routed experts' error alone: the LM head (quantised by default) is test_quant_dense_*'s subject,
    # the attention projections (int8 by default) test_attention_linears's.
    config = OffloadConfig(offload_dir=str(tmp_path / scheme), quant=scheme, device_cache=0.5,
                           quant_dense="shared-experts", attention_linears="model")
    with MoE(model_dir, config) as moe:
        with torch.inference_mode():
            got = moe(ids).logits.float()
    assert Store(tmp_path / scheme).index.quant["scheme"] == scheme
    error = (got - want).abs().max() / want.std()
    assert 0 < error < TOLERANCE[scheme, dtype]


def test_dynamic_int8_row_is_the_integer_product_of_the_rounded_row() -> None:
    from moeinf.kernels.quant_experts import dynamic_int8_row

    generator = torch.Generator().manual_seed(4)
    weight = (torch.randn(48, 64, generator=generator) * 0.05).to(torch.bfloat16)
    parts = quantise(weight, Quantization.of("int8"))
    x = torch.randn(1, 64, generator=generator).to(torch.bfloat16)
    got = dynamic_int8_row(x, parts["qweight"], parts["scales"])
    scale = x.float().abs().max() / 127
    q = torch.round(x.float() / scale)  # [1, K], integers in [-127, 127]
    want = (q.double() @ parts["qweight"].double().T) * scale.double() * parts["scales"].double()
    assert got.shape == (1, 48) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float().to(torch.bfloat16).float(), rtol=0.01, atol=1e-3)
    exact = x.float() @ weight.float().T
    assert ((got.float() - exact).norm() / exact.norm()) < 0.02  # the row's and the weights' rounding


def test_dynamic_int8_experts_compute_one_row_as_an_integer_gemv_and_more_rows_weight_only() -> None:
    import torch.nn.functional as F

    from moeinf.kernels.moe import GatedKernel
    from moeinf.kernels.quant_experts import QuantisedGatedKernel, dynamic_int8_row, quantised_kernel

    generator = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(64, 32, generator=generator) * 0.1).to(torch.bfloat16)
    down = (torch.randn(32, 32, generator=generator) * 0.1).to(torch.bfloat16)
    quant = Quantization.of("int8")
    tensors = {f"gate_up_proj.{k}": v for k, v in quantise(gate_up, quant).items()}
    tensors |= {f"down_proj.{k}": v for k, v in quantise(down, quant).items()}

    def apply_gate(h: torch.Tensor) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)
        return F.silu(g) * u

    exact = GatedKernel(has_gate=True, has_bias=False, is_transposed=False, apply_gate=apply_gate, act=None)
    shapes = {"gate_up_proj": (64, 32), "down_proj": (32, 32)}
    dynamic = quantised_kernel(exact, quant, shapes, "dynamic-int8")  # "auto" on a CPU with VNNI
    weight_only = quantised_kernel(exact, quant, shapes, "weight-only")
    assert isinstance(dynamic, QuantisedGatedKernel) and dynamic.row_kernel == "dynamic-int8"
    assert weight_only.row_kernel == "weight-only"
    x = torch.randn(3, 32, generator=generator).to(torch.bfloat16)
    row = x[:1]
    want = dynamic_int8_row(apply_gate(dynamic_int8_row(row, tensors["gate_up_proj.qweight"],
                                                        tensors["gate_up_proj.scales"])),
                            tensors["down_proj.qweight"], tensors["down_proj.scales"])
    assert torch.equal(dynamic(row, tensors), want)
    assert not torch.equal(weight_only(row, tensors), want)
    assert torch.equal(dynamic(x, tensors), weight_only(x, tensors))
    assert quantised_kernel(exact, Quantization.of("int4"), shapes, "auto").row_kernel != "dynamic-int8"
    with pytest.raises(ValueError, match="quant_expert_kernel"):
        quantised_kernel(exact, Quantization.of("int4"), shapes, "dynamic-int8")
    with pytest.raises(ConfigError, match="quant_expert_kernel"):
        OffloadConfig(quant_expert_kernel="int8")


def test_prepacked_int8_experts_pack_each_slot_once_and_only_where_every_expert_stays(monkeypatch) -> None:
    import torch.nn.functional as F

    from moeinf.kernels import quant_experts
    from moeinf.kernels.moe import GatedKernel
    from moeinf.kernels.quant_experts import (
        QuantisedGatedKernel,
        fbgemm_prepack,
        prepacked_int8,
        quantised_kernel,
        resolve_expert_kernel,
    )

    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("torch has no fbgemm here")
    monkeypatch.setattr(quant_experts, "gemv_supported", lambda quant: False)  # what "auto" does without it
    generator = torch.Generator().manual_seed(6)
    quant = Quantization.of("int8")
    parts = {name: quantise((torch.randn(n, k, generator=generator) * 0.1).to(torch.bfloat16), quant)
             for name, (n, k) in (("gate_up_proj", (64, 32)), ("down_proj", (32, 32)))}
    tensors = {f"{name}.{k}": v for name, p in parts.items() for k, v in p.items()}

    def apply_gate(h: torch.Tensor) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)
        return F.silu(g) * u

    exact = GatedKernel(has_gate=True, has_bias=False, is_transposed=False, apply_gate=apply_gate, act=None)
    shapes = {"gate_up_proj": (64, 32), "down_proj": (32, 32)}
    kernel = quantised_kernel(exact, quant, shapes, "auto", all_resident=True)
    weight_only = quantised_kernel(exact, quant, shapes, "weight-only")
    assert isinstance(kernel, QuantisedGatedKernel) and kernel.row_kernel == "prepacked-int8"
    x = torch.randn(3, 32, generator=generator).to(torch.bfloat16)
    row = x[:1]
    packs = {name: fbgemm_prepack(p["qweight"], p["scales"]) for name, p in parts.items()}
    want = prepacked_int8(apply_gate(prepacked_int8(row, packs["gate_up_proj"])), packs["down_proj"])
    assert torch.equal(kernel(row, tensors), want)
    assert not torch.equal(weight_only(row, tensors), want)
    slots = {tensors[f"{name}.qweight"].data_ptr() for name in parts}
    assert set(kernel.packed) == slots
    first = dict(kernel.packed)
    assert torch.equal(kernel(row, tensors), want)
    assert all(kernel.packed[key] is value for key, value in first.items())  # packed once per slot
    assert torch.equal(kernel(x, tensors), weight_only(x, tensors))  # more rows stay weight-only
    # without a cache holding every expert a slot is refilled: auto falls back, the explicit value refuses
    from moeinf.kernels.quant_experts import x86_vnni

    assert resolve_expert_kernel("auto", quant, all_resident=False) == \
        ("dynamic-int8" if x86_vnni() else "weight-only")
    assert resolve_expert_kernel("auto", Quantization.of("int4"), all_resident=True) == "weight-only"
    with pytest.raises(ValueError, match="quant_expert_kernel 'prepacked-int8' needs .*device_cache"):
        quantised_kernel(exact, quant, shapes, "prepacked-int8", all_resident=False)
    with pytest.raises(ValueError, match="needs an int8 store"):
        quantised_kernel(exact, Quantization.of("int4"), shapes, "prepacked-int8", all_resident=True)


@pytest.mark.parametrize("vnni", [True, False, None])
def test_int8_kernels_follow_the_cpus_int8_instructions(vnni: bool | None, monkeypatch) -> None:
    """Without AVX512-VNNI `torch._int_mm` is ~9x the weight-only kernel at one row and fbgemm's int16 sums
    saturate: "auto" then keeps weight-only experts, and fbgemm's activations take 7 bits (on x86)."""
    from moeinf.kernels import quant_experts

    monkeypatch.setattr(quant_experts, "x86_vnni", lambda: vnni)
    monkeypatch.setattr(quant_experts, "gemv_supported", lambda quant: False)
    monkeypatch.setattr(quant_experts.platform, "machine", lambda: "x86_64")
    quant = Quantization.of("int8")
    assert quant_experts.resolve_expert_kernel("auto", quant, all_resident=False) == \
        ("dynamic-int8" if vnni else "weight-only")
    assert quant_experts.resolve_expert_kernel("dynamic-int8", quant, all_resident=False) == "dynamic-int8"
    assert quant_experts.fbgemm_reduce_range() is (vnni is not True)
    monkeypatch.setattr(quant_experts.platform, "machine", lambda: "aarch64")
    assert quant_experts.fbgemm_reduce_range() is False


def test_the_builder_prepacks_int8_experts_only_when_the_cache_holds_them_all(tiny_model_dir, tmp_path: Path,
                                                                              monkeypatch) -> None:
    from moeinf.kernels import quant_experts
    from moeinf.kernels.quant_experts import QuantisedGatedKernel, x86_vnni

    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("torch has no fbgemm here")
    monkeypatch.setattr(quant_experts, "gemv_supported", lambda quant: False)  # what "auto" does without it
    model_dir = tiny_model_dir("qwen3_moe")
    dynamic = bool(x86_vnni())  # what "auto" picks for a cache that does not hold every expert
    for cache, prepacked in ((1.0, True), (0.5, False)):
        with MoE(model_dir, OffloadConfig(offload_dir=str(tmp_path / "int8"), quant="int8",
                                          device_cache=cache)) as moe:
            kernels = [m.kernel for m in moe.model.modules()
                       if isinstance(getattr(m, "kernel", None), QuantisedGatedKernel)]
            want = "prepacked-int8" if prepacked else "dynamic-int8" if dynamic else "weight-only"
            assert kernels and all(k.row_kernel == want for k in kernels)
    with pytest.raises(ValueError, match="prepacked-int8"):
        MoE(model_dir, OffloadConfig(offload_dir=str(tmp_path / "int8"), quant="int8", device_cache=0.5,
                                     quant_expert_kernel="prepacked-int8"))


def test_quant_setting_chooses_the_store(tiny_model_dir, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="quant"):
        OffloadConfig(quant="int2")
    model_dir = tiny_model_dir("qwen3_moe")
    pack(model_dir, tmp_path / "int8", quant=Quantization.of("int8"), progress=False)
    # "auto" takes the store as it is; asking for another format is refused, naming the store
    with MoE(model_dir, OffloadConfig(offload_dir=str(tmp_path / "int8"))) as moe:
        assert isinstance(moe(torch.tensor([[3, 4, 5]])).logits, torch.Tensor)
    with pytest.raises(StoreError, match="int8"):
        MoE(model_dir, OffloadConfig(offload_dir=str(tmp_path / "int8"), quant="none"))
    assert default_offload_dir(model_dir, "int4").name == f"{model_dir.name}.moeinf-int4"
    assert default_offload_dir(model_dir, "auto").name == f"{model_dir.name}.moeinf"


def test_pack_cli_quant_flags(tiny_model_dir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = [str(tiny_model_dir("qwen3_moe")), str(tmp_path / "a")]
    assert run_pack(parser.parse_args([*args, "--group-size", "64"])) == 2
    assert "--group-size needs --quant" in capsys.readouterr().err
    assert run_pack(parser.parse_args([*args, "--quant", "int4", "--group-size", "48"])) == 2
    assert "32, 64, 128" in capsys.readouterr().err
    assert run_pack(parser.parse_args([*args, "--quant", "int4", "--group-size", "64", "--json"])) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["quant"] == {"scheme": "int4", "group_size": 64}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantised_linear_module_is_the_kernel_on_the_quantised_weight(scheme: str) -> None:
    from torch import nn

    from moeinf.kernels.quant_linear import QuantisedLinear

    linear = nn.Linear(64, 40, bias=True).to(torch.bfloat16)
    quant = Quantization.of(scheme)
    module = QuantisedLinear(linear, quant)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = x.reshape(-1, 64) @ dequantised(linear.weight.detach(), quant).T + linear.bias.detach()
    got = module(x)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got.reshape(-1, 40).float(), want.float(), rtol=0.02, atol=0.02)
    assert not any(p is linear.weight for p in module.parameters())
    # a decoded row goes through moeinf's GEMV where it runs, to the same product
    from moeinf.kernels.quant_experts import gemv_supported, quantised_matmul

    row = x[:1, :1]  # [1, 1, 64]
    assert module.gemv_rows == gemv_supported(quant)
    torch.testing.assert_close(module(row).reshape(1, 40).float(), want[:1].float(), rtol=0.02, atol=0.02)
    if module.gemv_rows:
        product = quantised_matmul(row.reshape(1, 64), module.qweight, module.scales, quant, (40, 64),
                                   gemv_rows=True)
        assert torch.equal(module(row).reshape(1, 40), product + linear.bias.detach())


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantised_linear_rounds_a_decoded_row_to_int8_blocks_when_asked(scheme: str) -> None:
    from torch import nn

    from moeinf.kernels import gemv
    from moeinf.kernels.quant_experts import gemv_supported
    from moeinf.kernels.quant_linear import QuantisedLinear

    quant = Quantization.of(scheme)
    if not gemv_supported(quant):
        pytest.skip("moeinf's GEMV does not run here")
    linear = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    rounded, plain = (QuantisedLinear(linear, quant, int8_activations=flag) for flag in (True, False))
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    group = quant.group_size if scheme == "int4" else 0
    for module, flag in ((rounded, True), (plain, False)):
        want = gemv.RowProduct(module.qweight, module.scales, group, int8_activations=flag)(row)
        assert torch.equal(module(row), want)
    assert not torch.equal(rounded(row), plain(row))


def test_a_quantised_linears_bound_row_product_follows_its_buffers() -> None:
    """The one-row GEMV bound at the first decoded row is made again when the module's buffers are
    replaced (a `.to`, a loaded state): never the old weights' product."""
    from torch import nn

    from moeinf.kernels.quant_experts import gemv_supported
    from moeinf.kernels.quant_linear import QuantisedLinear

    quant = Quantization.of("int8")
    if not gemv_supported(quant):
        pytest.skip("moeinf's GEMV needs an x86 CPU with AVX2/FMA/F16C")
    generator = torch.Generator().manual_seed(5)
    module = QuantisedLinear(nn.Linear(64, 32, bias=False).to(torch.bfloat16), quant)
    row = torch.randn(1, 64, generator=generator).to(torch.bfloat16)
    first = module(row)
    assert module.row_product() is not None and module.row_product() is module.row_product()
    other = QuantisedLinear(nn.Linear(64, 32, bias=False).to(torch.bfloat16), quant)
    module.qweight, module.scales = other.qweight.clone(), other.scales.clone()
    assert torch.equal(module(row), other(row)) and not torch.equal(module(row), first)


def test_a_gemv_experts_slot_computes_whichever_expert_it_holds_now() -> None:
    """The expert kernel binds its one-row GEMV to a slot's addresses; an expert read into the same slot
    later is what the next call computes."""
    from moeinf.kernels.moe import GatedKernel
    from moeinf.kernels.quant_experts import QuantisedGatedKernel, gemv_supported

    quant = Quantization.of("int8")
    if not gemv_supported(quant):
        pytest.skip("moeinf's GEMV needs an x86 CPU with AVX2/FMA/F16C")
    generator = torch.Generator().manual_seed(6)

    def expert() -> dict[str, torch.Tensor]:
        parts = {}
        for name, shape in (("gate_up_proj", (64, 32)), ("down_proj", (32, 32))):
            q = quantise(torch.randn(shape, generator=generator).to(torch.bfloat16), quant)
            parts |= {f"{name}.qweight": q["qweight"], f"{name}.scales": q["scales"]}
        return parts

    def apply_gate(h: torch.Tensor) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u

    exact = GatedKernel(has_gate=True, has_bias=False, is_transposed=False, apply_gate=apply_gate, act=None)
    kernel = QuantisedGatedKernel(exact, quant, {"gate_up_proj": (64, 32), "down_proj": (32, 32)},
                                  row_kernel="gemv")
    slot, other = expert(), expert()
    x = torch.randn(1, 32, generator=generator).to(torch.bfloat16)
    before = kernel(x, slot)
    for name, tensor in slot.items():
        tensor.copy_(other[name])  # another expert read into the same slot
    assert torch.equal(kernel(x, slot), kernel(x, dict(other))) and not torch.equal(kernel(x, slot), before)
    assert len(kernel.rows) == 4  # the two matrices of both tensor sets, each bound once


def test_dynamic_int8_linear_is_fbgemms_int8_product() -> None:
    from torch import nn

    from moeinf.kernels.quant_linear import DynamicInt8Linear

    linear = nn.Linear(64, 40, bias=True).to(torch.bfloat16)
    module = DynamicInt8Linear(linear)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    want = x.reshape(-1, 64).float() @ dequantised(linear.weight.detach(), Quantization.of("int8")).float().T
    want = want + linear.bias.detach().float()
    got = module(x)
    assert got.shape == (2, 3, 40) and got.dtype == torch.bfloat16
    # the activations' 8-bit rounding on top of the weights' int8
    torch.testing.assert_close(got.reshape(-1, 40).float(), want, rtol=0.03, atol=0.03)
    assert not list(module.parameters())


@pytest.mark.parametrize("kernel", ["weight-only", "dynamic-int8"])
def test_a_fused_gated_mlp_computes_as_its_three_quantised_linears(kernel: str) -> None:
    from torch import nn
    from transformers.activations import ACT2FN

    from moeinf.kernels.quant_linear import DynamicInt8Linear, FusedGatedMLP, QuantisedLinear, is_fusable_mlp

    class ToyMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(64, 48, bias=False), nn.Linear(64, 48, bias=False)
            self.down_proj = nn.Linear(48, 64, bias=False)
            self.act_fn = ACT2FN["silu"]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    mlp = ToyMLP().to(torch.bfloat16)
    assert is_fusable_mlp(mlp)
    quant = Quantization.of("int8")

    def make(linear: nn.Linear) -> nn.Module:
        return DynamicInt8Linear(linear) if kernel == "dynamic-int8" else QuantisedLinear(linear, quant)

    fused = FusedGatedMLP(mlp, make)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    gate, up, down = make(mlp.gate_proj), make(mlp.up_proj), make(mlp.down_proj)
    want = down(mlp.act_fn(gate(x)) * up(x))
    assert torch.equal(fused(x), want)  # one row: each output row's sum is the same in either matrix
    # a decoded row as the decoder layer passes it ([batch, seq, H]), its SiLU gate in one kernel call
    assert fused.silu and torch.equal(fused(x.view(1, 1, 64)), want.view(1, 1, 64))


@pytest.mark.parametrize(("dense", "kernel", "fast"), [("none", "auto", True),
                                                      ("shared-experts", "weight-only", False),
                                                      ("shared-experts+lm-head", "weight-only", False),
                                                      ("shared-experts+lm-head", "weight-only", True),
                                                      ("shared-experts+lm-head", "int8", True),
                                                      ("shared-experts+lm-head", "dynamic-int8", True)])
def test_quant_dense_quantises_the_shared_experts_of_a_quantised_store(dense: str, kernel: str,
                                                                       fast: bool, tiny_model_dir,
                                                                       tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from moeinf.kernels.quant_linear import DynamicInt8Linear, FusedGatedMLP, QuantisedLinear

    model_dir = tiny_model_dir("deepseek_v3", dtype="bfloat16")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        want = ref(ids).logits.float()
    config = OffloadConfig(offload_dir=str(tmp_path / "int4"), quant="int4", quant_dense=dense,
                           quant_dense_kernel=kernel, fast_dense_modules=fast, attention_linears="model",
                           device_cache=0.5)
    linear = DynamicInt8Linear if kernel == "dynamic-int8" else QuantisedLinear
    with MoE(model_dir, config) as moe:
        modules = dict(moe.model.named_modules())
        quantised = {name for name, m in modules.items() if isinstance(m, linear)}
        fused = {name for name, m in modules.items() if isinstance(m, FusedGatedMLP)}
        with torch.inference_mode():
            got = moe(ids).logits.float()
    shared_blocks = {name for name, m in ref.named_modules() if name.endswith(".shared_experts")}
    shared = {name for name, m in ref.named_modules()
              if ".shared_experts." in name and isinstance(m, torch.nn.Linear)}
    assert shared_blocks and shared
    if dense == "none":
        assert not quantised and not fused
    elif fast:
        assert fused == shared_blocks
        assert {name for name in quantised if ".shared_experts." in name} == {
            f"{block}.{part}" for block in shared_blocks for part in ("gate_up_proj", "down_proj")}
    else:
        assert not fused and quantised >= shared
    assert ("lm_head" in quantised) == (dense == "shared-experts+lm-head")
    if linear is QuantisedLinear:  # "int8": per-row int8 whatever the store's scheme; else the store's
        assert {modules[name].quant.scheme for name in quantised} <= {"int8" if kernel == "int8" else "int4"}
        # a decoded row of an int4 weight is rounded to int8 blocks, as the int4 experts' rows are
        assert {modules[name].int8_activations for name in quantised} <= {kernel != "int8"}
    # routers, attention and the routed experts' modules are never replaced
    assert all(".shared_experts" in name or name == "lm_head" for name in quantised | fused)
    error = (got - want).abs().max() / want.std()
    # an int4 LM head rounds the logits' own weights: twice the experts' allowance
    assert 0 < error < TOLERANCE["int4", "bfloat16"] * (2 if "lm-head" in dense else 1)


@pytest.mark.parametrize("has_gemv", [True, False])
def test_quant_dense_kernel_auto_is_int8_in_the_gemv_else_dynamic_int8_where_torch_has_fbgemm(
        has_gemv: bool, monkeypatch) -> None:
    from moeinf.kernels import quant_linear
    from moeinf.kernels.quant_linear import resolve_kernel

    monkeypatch.setattr(quant_linear, "gemv_supported", lambda quant: has_gemv)
    fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    assert resolve_kernel("auto") == ("int8" if has_gemv else "dynamic-int8" if fbgemm else "weight-only")
    for kernel in ("weight-only", "int8", "dynamic-int8"):
        assert resolve_kernel(kernel) == kernel
    with pytest.raises(ConfigError, match="quant_dense_kernel"):
        OffloadConfig(quant_dense_kernel="int4")


def test_an_exact_store_ignores_quant_dense(tiny_model_dir, tmp_path: Path) -> None:
    from moeinf.kernels.quant_linear import QuantisedLinear

    with pytest.raises(ConfigError, match="quant_dense"):
        OffloadConfig(quant_dense="all")
    model_dir = tiny_model_dir("deepseek_v3")
    config = OffloadConfig(offload_dir=str(tmp_path / "exact"), quant_dense="shared-experts+lm-head")
    with MoE(model_dir, config) as moe:
        assert not any(isinstance(m, QuantisedLinear) for m in moe.model.modules())


def test_int8_inputs_not_a_multiple_of_8_compute_without_torchs_kernel() -> None:
    """torch's `_weight_int8pack_mm` crashed the process on 13 inputs (torch 2.13, AVX2)."""
    weight = torch.randn(8, 13, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    quant = Quantization.of("int8")
    parts = quantise(weight, quant)
    x = torch.randn(3, 13, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    got = quantised_linear(x, {f"w.{k}": v for k, v in parts.items()}, "w", quant, (8, 13))
    want = x.float() @ (parts["qweight"].float() * parts["scales"].float()[:, None]).T
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_decoded_rows_silu_gate_in_one_call_is_torchs_to_a_rounding_step(dtype: torch.dtype) -> None:
    """`silu_mul_row` rounds each op to the dtype as torch's ops do; only its exponential is its own, so a
    rare silu may differ by a rounding step, and the product by at most two (that step, and its own)."""
    from moeinf.kernels import gemv
    from moeinf.kernels.quant_experts import silu_mul_row

    if not gemv.available():
        pytest.skip("the kernels module needs an x86 CPU with AVX2/FMA/F16C")
    h = (torch.randn(1, 2 * 4096, generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    gate, up = h.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = silu_mul_row(h)
    assert got.dtype == dtype and got.shape == (1, 4096)
    step = 2 * torch.finfo(dtype).eps * want.abs().float()  # two rounding steps at each value's magnitude
    assert ((got.float() - want.float()).abs() <= step + torch.finfo(dtype).tiny).all()
    # half precision rounds the small differences of float32 away; in float32 a few percent show
    assert (got == want).float().mean() >= (0.95 if dtype == torch.float32 else 0.99)
    assert silu_mul_row(h.expand(2, -1)) is None and silu_mul_row(h[:, :-1]) is None  # two rows; odd width


def test_the_silu_gate_kernel_serves_only_transformers_default_silu_gate() -> None:
    """Experts whose gate is transformers' default with a SiLU take the one-call gate; any other gate (a
    family's own, another activation) keeps the module's."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    from moeinf.kernels.quant_experts import is_default_silu_gate

    config = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=4)
    experts = DeepseekV3Experts(config)
    assert is_default_silu_gate(experts._apply_gate)
    experts.act_fn = torch.nn.GELU()
    assert not is_default_silu_gate(experts._apply_gate)
    assert not is_default_silu_gate(lambda h: h) and not is_default_silu_gate(None)
