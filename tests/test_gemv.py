"""moeinf's own GEMV on a quantised store's layouts (moeinf/kernels/gemv.py, csrc/gemv.cpp): the product of
each layout's weights as stored, for every scale dtype, every tail of rows and inputs, and its refusals."""

from __future__ import annotations

import pytest
import torch

from moeinf import _kernels
from moeinf.kernels import gemv
from moeinf.kernels.quant_experts import TORCH_INT8_INPUTS
from moeinf.store.quant import Quantization, quantise

pytestmark = pytest.mark.skipif(not gemv.available(),
                                reason="moeinf's GEMV needs an x86 CPU with AVX2/FMA/F16C")

needs_int4_layout = pytest.mark.skipif(not gemv.available() or not gemv.int4_layout_matches(),
                                       reason="this torch packs int4 otherwise than the kernel reads")


def int4_weights(parts: dict[str, torch.Tensor], group: int, block_rows: int | None = None) -> torch.Tensor:
    """The float64 weight [N', K'] an int4 store's `parts` stand for (packed in blocks of `block_rows` rows;
    None: the running torch's). The nibbles are read back through `expected_int4_packing` of each weight's own
    position (packed four bits at a time), so this does not restate the layout it checks."""
    block_rows = block_rows or gemv.int4_block_rows()
    packed, scales = parts["qweight"].reshape(-1), parts["scales"].double()  # [N'*K'/2], [K'/G, N', 2]
    rows, cols = parts["qweight"].shape[0], parts["qweight"].shape[1] * 2
    position = torch.arange(rows * cols).reshape(rows, cols)
    digits = range(6)  # positions below 2**24, four bits at a time
    where = sum(gemv.expected_int4_packing(position >> (4 * d) & 15, block_rows).long() << (8 * d)
                for d in digits)
    index = [sum((where >> (8 * d + shift) & 15) << (4 * d) for d in digits) for shift in (0, 4)]  # low, high
    values = torch.empty(rows * cols, dtype=torch.float64)
    values[index[0]] = (packed & 15).double()
    values[index[1]] = (packed >> 4).double()
    s = scales[..., 0].T.repeat_interleave(group, dim=1)  # [N', K']
    z = scales[..., 1].T.repeat_interleave(group, dim=1)
    return (values.reshape(rows, cols) - 8) * s + z


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "shape"),
                         [(1, (64, 128)), (3, (66, 40)), (2, (7, 13)), (1, (1536, 2048))])
def test_int8_gemv_is_the_rowwise_product(rows: int, shape: tuple[int, int],
                                          scale_dtype: torch.dtype) -> None:
    """Every tail: rows not a multiple of the kernel's 4, inputs not a multiple of 8, several x rows."""
    generator = torch.Generator().manual_seed(shape[0] + rows)
    parts = quantise(torch.randn(shape, generator=generator).to(scale_dtype), Quantization.of("int8"))
    x = torch.randn(rows, shape[1], generator=generator)
    want = (x.double() @ parts["qweight"].double().T) * parts["scales"].double()  # [rows, N]
    got = gemv.int8_gemv(x, parts["qweight"], parts["scales"])
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    scale = (x.double().abs() @ parts["qweight"].double().abs().T) * parts["scales"].double()
    assert ((got.double() - want).abs() <= scale * 1e-6 + 1e-30).all()
    if shape[1] % TORCH_INT8_INPUTS:
        return  # torch 2.13's `_weight_int8pack_mm` crashes on such inputs (`TORCH_INT8_INPUTS`)
    # and what torch's own kernel computes, to its bf16 output's rounding
    x16 = x.to(torch.bfloat16)
    ours = gemv.int8_gemv(x16, parts["qweight"], parts["scales"].to(torch.bfloat16))
    torchs = torch.ops.aten._weight_int8pack_mm(x16, parts["qweight"], parts["scales"].to(torch.bfloat16))
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, torchs, rtol=2**-7, atol=float(scale.max()) * 2**-8)


@needs_int4_layout
def test_the_kernels_int4_layout_is_torchs_packing() -> None:
    values = torch.randint(0, 16, (80, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    rows = gemv.int4_block_rows()
    assert torch.equal(packed.reshape(-1).view(torch.uint8), gemv.expected_int4_packing(values, rows))
    assert not torch.equal(gemv.expected_int4_packing(values.flip(0), rows),
                           gemv.expected_int4_packing(values, rows))


def test_the_int4_layouts_place_rows_as_torchs_two_packings() -> None:
    """AVX2's packing (blocks of 32 rows: rows j and 16 + j share a byte, a 16-row tail in pairs) and
    AVX-512's (blocks of 64: rows j and 32 + j, a tail of 16, 32 or 48 rows in pairs), written out by hand on
    small cases whichever one this machine's torch uses."""
    values = torch.arange(112).reshape(112, 1).repeat(1, 2) % 16  # row r holds r % 16 at both inputs
    avx2 = gemv.expected_int4_packing(values, 32).reshape(-1)
    # block 0, k = 0: bytes j = 0..15 hold rows j (low) and 16 + j (high); the 16-row tail rows 96..111
    assert avx2[:16].tolist() == [j | (j << 4) for j in range(16)]
    assert avx2[96 * 2 // 2:][:8].tolist() == [(96 + 2 * j) % 16 | ((97 + 2 * j) % 16) << 4 for j in range(8)]
    avx512 = gemv.expected_int4_packing(values, 64).reshape(-1)
    # block 0, k = 0: bytes j = 0..31 hold rows j and 32 + j; the 48-row tail (rows 64..111) in pairs
    assert avx512[:32].tolist() == [j % 16 | ((32 + j) % 16) << 4 for j in range(32)]
    assert avx512[64:][:24].tolist() == [(64 + 2 * j) % 16 | ((65 + 2 * j) % 16) << 4 for j in range(24)]


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("block_rows", [32, 64])
@pytest.mark.parametrize(("rows", "shape", "group"), [(1, (128, 64), 32), (2, (112, 64), 64),
                                                      (1, (48, 96), 32), (1, (16, 64), 32),
                                                      (1, (1536, 256), 128), (1, (192, 64), 32)])
def test_int4_gemv_reads_both_of_torchs_packings(rows: int, shape: tuple[int, int], group: int,
                                                 block_rows: int, int8_activations: bool) -> None:
    """Each layout, packed here rather than by this torch: full blocks, tails of 16 to 48 rows."""
    generator = torch.Generator().manual_seed(shape[0] + block_rows)
    values = torch.randint(0, 16, shape, dtype=torch.int32, generator=generator)
    scales = torch.rand(shape[1] // group, shape[0], 2, generator=generator) * torch.tensor([0.1, 1.0]) \
        - torch.tensor([0.0, 0.5])
    packed = gemv.expected_int4_packing(values, block_rows).reshape(shape[0], shape[1] // 2)
    weight = (values.double() - 8) * scales[..., 0].T.double().repeat_interleave(group, dim=1) \
        + scales[..., 1].T.double().repeat_interleave(group, dim=1)
    x = torch.randn(rows, shape[1], generator=generator)
    want = product_of_rounded_rows(x.double(), weight) if int8_activations else x.double() @ weight.T
    got = gemv.int4_gemv(x, packed, scales, group, int8_activations=int8_activations, block_rows=block_rows)
    bound = x.double().abs() @ (weight.abs() + 16).T
    assert ((got.double() - want).abs() <= bound * 1e-6).all()

    if int8_activations and avx512_int4():
        # the AVX2 path on the same rounded rows: the same int32 sums and float steps, so the same bits
        try:
            _kernels.set_int4_avx512(False)
            avx2 = gemv.int4_gemv(x, packed, scales, group, int8_activations=True, block_rows=block_rows)
        finally:
            _kernels.set_int4_avx512(True)
        assert torch.equal(got, avx2)


def avx512_int4() -> bool:
    """Whether int4 products on int8 rows take the AVX-512 VNNI path here (and so the test above compares
    the two paths)."""
    return _kernels.set_int4_avx512(True)


def test_the_avx512_int4_path_can_be_turned_off() -> None:
    try:
        assert not _kernels.set_int4_avx512(False)
    finally:
        _kernels.set_int4_avx512(True)


@needs_int4_layout
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "shape", "group"),
                         [(1, (64, 128), 32), (2, (48, 64), 64), (1, (16, 256), 128), (1, (1536, 2048), 32)])
def test_int4_gemv_is_the_groupwise_product(rows: int, shape: tuple[int, int], group: int,
                                            scale_dtype: torch.dtype) -> None:
    """Full 32-row blocks, a 16-row tail (48, 16 rows), every group size, several x rows."""
    generator = torch.Generator().manual_seed(shape[1] + group)
    parts = quantise(torch.randn(shape, generator=generator).to(scale_dtype), Quantization.of("int4", group))
    x = torch.randn(rows, shape[1], generator=generator)
    weight = int4_weights(parts, group)
    want = x.double() @ weight.T
    got = gemv.int4_gemv(x, parts["qweight"], parts["scales"], group)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    bound = x.double().abs() @ (weight.abs() + parts["scales"].double().abs().amax() * 16).T
    assert ((got.double() - want).abs() <= bound * 1e-6).all()
    x16 = x.to(torch.bfloat16)
    scales16 = parts["scales"].to(torch.bfloat16)
    torchs = torch.ops.aten._weight_int4pack_mm_for_cpu(x16, parts["qweight"], group, scales16)
    torch.testing.assert_close(gemv.int4_gemv(x16, parts["qweight"], scales16, group), torchs,
                               rtol=2**-6, atol=float(bound.max()) * 2**-8)


def test_the_kernels_refuse_tensors_that_do_not_fit() -> None:
    parts = quantise(torch.randn(32, 64), Quantization.of("int8"))
    with pytest.raises(ValueError, match="do not fit"):
        gemv.int8_gemv(torch.randn(1, 63), parts["qweight"], parts["scales"])
    with pytest.raises(ValueError, match="do not fit"):
        gemv.int8_gemv(torch.randn(1, 64), parts["qweight"], parts["scales"][:16])
    with pytest.raises(ValueError, match="contiguous"):
        gemv.int8_gemv(torch.randn(1, 64), parts["qweight"].T.contiguous().T, parts["scales"])
    with pytest.raises(ValueError, match="scales"):
        gemv.int8_gemv(torch.randn(1, 64), parts["qweight"], parts["scales"].double())
    four = quantise(torch.randn(32, 64), Quantization.of("int4", 32))
    with pytest.raises(ValueError, match="do not fit"):
        gemv.int4_gemv(torch.randn(1, 64), four["qweight"], four["scales"], 64)


def test_activations_round_to_int8_blocks_as_llama_cpps_q8_0() -> None:
    generator = torch.Generator().manual_seed(17)
    x = torch.randn(2, 96, generator=generator) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(32)
    x[1, 32:64] = 0  # a block of zeros: scale 0, values 0
    q, d = gemv.quantise_activations(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and d.shape == (2, 3)
    blocks = q.reshape(2, 3, 32)
    assert blocks.abs().amax(dim=-1).tolist() == [[127, 127, 127], [127, 0, 127]]  # amax maps to 127
    assert d[1, 1] == 0
    error = (x.reshape(2, 3, 32) - blocks.float() * d.unsqueeze(-1)).abs()
    assert (error <= d.unsqueeze(-1) / 2 * (1 + 1e-6)).all()  # rounded to nearest


def product_of_rounded_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 `x` rounded to int8 blocks (`quantise_activations`) times `weight` [N, K] transposed."""
    q, d = gemv.quantise_activations(x)
    rounded = (q.double().reshape(x.shape[0], -1, gemv.Q8_BLOCK) * d.double().unsqueeze(-1)).reshape(x.shape)
    return rounded @ weight.T


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "shape"), [(1, (64, 128)), (3, (66, 64)), (2, (7, 32)), (1, (1536, 2048))])
def test_int8_gemv_on_int8_activations_is_the_product_of_the_rounded_rows(rows: int, shape: tuple[int, int],
                                                                          scale_dtype: torch.dtype) -> None:
    """Rows not a multiple of the kernel's 4, several x rows, a zero block; integer products, exact sums."""
    generator = torch.Generator().manual_seed(shape[0] + rows + 1)
    parts = quantise(torch.randn(shape, generator=generator).to(scale_dtype), Quantization.of("int8"))
    x = torch.randn(rows, shape[1], generator=generator)
    x[0, :32] = 0
    weight = parts["qweight"].double() * parts["scales"].double()[:, None]
    want = product_of_rounded_rows(x, weight)
    got = gemv.int8_gemv(x, parts["qweight"], parts["scales"], int8_activations=True)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    bound = x.double().abs() @ weight.abs().T
    assert ((got.double() - want).abs() <= bound * 1e-6 + 1e-30).all()
    # and within the activations' rounding of the float product
    float_rows = gemv.int8_gemv(x, parts["qweight"], parts["scales"]).double()
    assert ((got.double() - float_rows).abs() <= bound * 2**-7).all()


@needs_int4_layout
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "shape", "group"),
                         [(1, (64, 128), 32), (2, (48, 64), 64), (1, (16, 256), 128), (1, (1536, 2048), 32),
                          (1, (2048, 768), 32)])
def test_int4_gemv_on_int8_activations_is_the_product_of_the_rounded_rows(rows: int, shape: tuple[int, int],
                                                                          group: int,
                                                                          scale_dtype: torch.dtype) -> None:
    """Full 32-row blocks, a 16-row tail (48, 16 rows), groups of one to four x blocks, several x rows."""
    generator = torch.Generator().manual_seed(shape[1] + group + 1)
    parts = quantise(torch.randn(shape, generator=generator).to(scale_dtype), Quantization.of("int4", group))
    x = torch.randn(rows, shape[1], generator=generator)
    x[-1, -32:] = 0
    weight = int4_weights(parts, group)
    want = product_of_rounded_rows(x, weight)
    got = gemv.int4_gemv(x, parts["qweight"], parts["scales"], group, int8_activations=True)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    bound = x.double().abs() @ (weight.abs() + parts["scales"].double().abs().amax() * 16).T
    assert ((got.double() - want).abs() <= bound * 1e-6).all()
    float_rows = gemv.int4_gemv(x, parts["qweight"], parts["scales"], group).double()
    assert ((got.double() - float_rows).abs() <= bound * 2**-7).all()


def test_int8_activations_need_blocks_that_tile_the_row() -> None:
    parts = quantise(torch.randn(32, 48), Quantization.of("int8"))
    with pytest.raises(ValueError, match="multiple of 32"):
        gemv.int8_gemv(torch.randn(1, 48), parts["qweight"], parts["scales"], int8_activations=True)
    # the store's int4 groups are 32-256 wide (torch's kernel); the kernel itself takes any even group
    packed, scales = torch.zeros(32, 32, dtype=torch.uint8), torch.ones(4, 32, 2)
    assert gemv.int4_gemv(torch.randn(1, 64), packed, scales, 16).shape == (1, 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemv.int4_gemv(torch.randn(1, 64), packed, scales, 16, int8_activations=True)


def test_quantised_matmul_keeps_float_rows_where_int8_blocks_do_not_fit() -> None:
    from moeinf.kernels.quant_experts import int8_activations_fit, quantised_matmul

    eight = Quantization.of("int8")
    assert int8_activations_fit(eight, 64) and not int8_activations_fit(eight, 48)
    assert int8_activations_fit(Quantization.of("int4", 32), 64)
    parts = quantise(torch.randn(32, 48), eight)
    x = torch.randn(1, 48)
    got = quantised_matmul(x, parts["qweight"], parts["scales"], eight, (32, 48), gemv_rows=True,
                           int8_activations=True)
    assert torch.equal(got, gemv.int8_gemv(x, parts["qweight"], parts["scales"]))


def test_quant_activations_resolve_per_scheme_and_are_checked() -> None:
    from moeinf import OffloadConfig
    from moeinf.config import ConfigError
    from moeinf.kernels.quant_experts import resolve_activations

    four, eight = Quantization.of("int4", 32), Quantization.of("int8")
    assert resolve_activations("auto", four) and not resolve_activations("auto", eight)
    assert resolve_activations("int8", eight) and not resolve_activations("float", four)
    with pytest.raises(ValueError, match="quant_activations"):
        resolve_activations("int4", four)
    with pytest.raises(ConfigError, match="quant_activations: must be one of"):
        OffloadConfig(quant_activations="fp8")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_gemv_expert_computes_one_row_with_the_gemv_and_more_rows_weight_only(scheme: str) -> None:
    import torch.nn.functional as F

    from moeinf.kernels.moe import GatedKernel
    from moeinf.kernels.quant_experts import quantised_kernel, resolve_expert_kernel

    quant = Quantization.of(scheme)
    if scheme == "int4" and not gemv.int4_layout_matches():
        pytest.skip("this torch packs int4 otherwise than the kernel reads")
    generator = torch.Generator().manual_seed(7)
    shapes = {"gate_up_proj": (96, 64), "down_proj": (64, 48)}
    parts = {name: quantise((torch.randn(shape, generator=generator) * 0.1).to(torch.bfloat16), quant)
             for name, shape in shapes.items()}
    tensors = {f"{name}.{k}": v for name, p in parts.items() for k, v in p.items()}

    def apply_gate(h: torch.Tensor) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)
        return F.silu(g) * u

    exact = GatedKernel(has_gate=True, has_bias=False, is_transposed=False, apply_gate=apply_gate, act=None)
    kernel = quantised_kernel(exact, quant, shapes, "auto")
    weight_only = quantised_kernel(exact, quant, shapes, "weight-only")
    assert kernel.row_kernel == "gemv" == resolve_expert_kernel("auto", quant, all_resident=True)

    # int4 experts round a decoded row to int8 blocks by default, int8 experts do not (`quant_activations`)
    assert kernel.int8_activations == (scheme == "int4")
    assert quantised_kernel(exact, quant, shapes, "auto", activations="float").int8_activations is False

    def product(x: torch.Tensor, name: str) -> torch.Tensor:
        p = parts[name]
        if scheme == "int8":
            return gemv.int8_gemv(x, p["qweight"], p["scales"])
        padded = F.pad(x, (0, p["qweight"].shape[1] * 2 - x.shape[1]))  # down_proj's 48 inputs -> 64
        return gemv.int4_gemv(padded, p["qweight"], p["scales"], quant.group_size, int8_activations=True)

    x = torch.randn(3, 64, generator=generator).to(torch.bfloat16)
    row = x[:1]
    assert torch.equal(kernel(row, tensors), product(apply_gate(product(row, "gate_up_proj")), "down_proj"))
    assert torch.equal(kernel(x, tensors), weight_only(x, tensors))
    torch.testing.assert_close(kernel(row, tensors), weight_only(row, tensors), rtol=2**-5, atol=2**-7)


def test_without_the_cpu_for_it_auto_does_not_pick_the_gemv_and_gemv_is_refused(monkeypatch) -> None:
    from moeinf.kernels import quant_experts
    from moeinf.kernels.moe import GatedKernel

    monkeypatch.setattr(gemv, "available", lambda: False)
    quant = Quantization.of("int8")
    assert quant_experts.resolve_expert_kernel("auto", quant, all_resident=False) != "gemv"
    exact = GatedKernel(has_gate=True, has_bias=False, is_transposed=False, apply_gate=torch.relu, act=None)
    with pytest.raises(ValueError, match="'gemv' needs an x86 CPU with AVX2"):
        shapes = {"gate_up_proj": (64, 32), "down_proj": (32, 32)}
        quant_experts.quantised_kernel(exact, quant, shapes, "gemv")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_are_the_float32_product_rounded_to_nearest_even(dtype: torch.dtype) -> None:
    """Outputs from float16 subnormals to past float16's range (infinity), rounded as torch's `.to` does."""
    generator = torch.Generator().manual_seed(11)
    parts = quantise(torch.randn(256, 64, generator=generator), Quantization.of("int8"))
    scales = torch.logspace(-9, 5, 256, dtype=torch.float32)  # per-row magnitudes 1e-9 .. 1e5
    x = torch.randn(2, 64, generator=generator).to(dtype)
    got = gemv.int8_gemv(x, parts["qweight"], scales)
    want = gemv.int8_gemv(x.float(), parts["qweight"], scales).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    if dtype == torch.float16:
        assert got.isinf().any() and ((got != 0) & (got.abs() < 2**-14)).any()  # both ends were reached
    if gemv.int4_layout_matches():
        four = quantise(torch.randn(64, 64, generator=generator).to(dtype), Quantization.of("int4", 32))
        got = gemv.int4_gemv(x, four["qweight"], four["scales"], 32)
        assert torch.equal(got, gemv.int4_gemv(x.float(), four["qweight"], four["scales"], 32).to(dtype))


def products(x: torch.Tensor, eight: dict[str, torch.Tensor],
             four: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """`x` times both weights, with float and with int8 activations."""
    out = []
    for rounded in (False, True):
        out.append(gemv.int8_gemv(x, eight["qweight"], eight["scales"], int8_activations=rounded))
        if gemv.int4_layout_matches():
            out.append(gemv.int4_gemv(x, four["qweight"], four["scales"], 32, int8_activations=rounded))
    return out


@pytest.mark.parametrize("threads", [2, 3])
def test_a_row_split_across_threads_is_the_same_product(threads: int) -> None:
    """One row splits across torch's thread count; every output row is computed as on one thread."""
    generator = torch.Generator().manual_seed(13)
    eight = quantise(torch.randn(100, 96, generator=generator).to(torch.bfloat16), Quantization.of("int8"))
    four = quantise(torch.randn(80, 96, generator=generator).to(torch.bfloat16), Quantization.of("int4", 32))
    x = torch.randn(1, 96, generator=generator).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert gemv._workers_for(x) is None
        one = products(x, eight, four)
        torch.set_num_threads(threads)
        assert gemv._workers_for(x).threads == threads and gemv._workers_for(x.expand(2, 96)) is None
        many = products(x, eight, four)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))


def test_int4_blocks_of_64_rows_split_mid_block_give_the_same_bits() -> None:
    """AVX-512's packing reads a whole 64-row block in one pass (both of its 32-row units) and a unit alone
    where a thread's share of rows starts or ends inside a block: 192 rows (six units) over two threads
    split at unit 3. Every way gives the bits of one thread and of the AVX2 path."""
    generator = torch.Generator().manual_seed(64)
    values = torch.randint(0, 16, (192, 128), dtype=torch.int32, generator=generator)
    packed = gemv.expected_int4_packing(values, 64).reshape(192, 64)
    scales = (torch.rand(4, 192, 2, generator=generator) * 0.1).to(torch.bfloat16)
    x = torch.randn(1, 128, generator=generator).to(torch.bfloat16)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(gemv.int4_gemv(x, packed, scales, 32, int8_activations=True, block_rows=64))
        _kernels.set_int4_avx512(False)
        results.append(gemv.int4_gemv(x, packed, scales, 32, int8_activations=True, block_rows=64))
    finally:
        _kernels.set_int4_avx512(True)
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], other) for other in results[1:])
    weight = (values.double() - 8) * scales[..., 0].T.double().repeat_interleave(32, dim=1) \
        + scales[..., 1].T.double().repeat_interleave(32, dim=1)
    want = product_of_rounded_rows(x.double(), weight)
    assert ((results[0].double() - want).abs() <= 1e-2 * want.abs().max()).all()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_does_not_inherit_the_pools_of_helper_threads() -> None:
    """The parent's helper threads do not exist in a child: a pool it inherited would wait for them forever,
    so the child starts with none (and makes its own on first use)."""
    import os

    gemv.workers(2)  # the parent's pool exists now
    assert gemv.workers.cache_info().currsize >= 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report how many pools it holds, touching no torch thread pool
        os.write(write, str(gemv.workers.cache_info().currsize).encode())
        os._exit(0)
    os.close(write)
    inherited = int(os.read(read, 16))
    os.close(read)
    os.waitpid(pid, 0)
    assert inherited == 0 and gemv.workers.cache_info().currsize >= 1


def product_on(pool, x: torch.Tensor, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One int8 row product split over `pool` (a `_kernels.Workers`; None: the calling thread alone)."""
    rows, cols = parts["qweight"].shape
    out = torch.empty(1, rows, dtype=x.dtype)
    gemv._kernels.int8_rowwise_gemv(x.data_ptr(), gemv.DTYPES[x.dtype], 1, parts["qweight"].data_ptr(),
                                    parts["scales"].data_ptr(), gemv.DTYPES[parts["scales"].dtype],
                                    out.data_ptr(), rows, cols, pool, False)
    return out


@pytest.mark.parametrize("spin_us", [0, 20, 1_000_000])
def test_helpers_hand_off_every_product_whether_spinning_or_asleep(spin_us: int) -> None:
    """Helpers spin for `spin_us` after a product, then sleep: products in quick succession, after a pause
    longer than the spin (helpers asleep), and from four threads at once (taking turns) are each the
    one-thread product, and none is lost or run twice (a lost hand-off would hang here)."""
    import threading
    import time

    generator = torch.Generator().manual_seed(spin_us % 97)
    parts = quantise(torch.randn(200, 64, generator=generator), Quantization.of("int8"))
    inputs = [torch.randn(1, 64, generator=generator) for _ in range(8)]
    want = [product_on(None, x, parts) for x in inputs]
    pool = gemv._kernels.Workers(3, spin_us)
    for step in range(60):
        if step % 20 == 19:
            time.sleep(0.002)  # past a short spin: the helpers go to sleep and must be woken
        assert torch.equal(product_on(pool, inputs[step % 8], parts), want[step % 8])
    wrong = []

    def caller(offset: int) -> None:
        for step in range(50):
            i = (step + offset) % 8
            if not torch.equal(product_on(pool, inputs[i], parts), want[i]):
                wrong.append(i)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


@pytest.mark.parametrize("rounded", [False, True])
def test_a_bound_row_product_is_the_checked_products_result(rounded: bool) -> None:
    """`RowProduct` (the runtime's per-token calls, checks done once) computes what `int8_gemv` and
    `int4_gemv` do, and refuses rows that do not fit its weight."""
    generator = torch.Generator().manual_seed(21)
    eight = quantise(torch.randn(48, 96, generator=generator).to(torch.bfloat16), Quantization.of("int8"))
    x = torch.randn(1, 96, generator=generator).to(torch.bfloat16)
    bound = gemv.RowProduct(eight["qweight"], eight["scales"], int8_activations=rounded)
    want = gemv.int8_gemv(x, eight["qweight"], eight["scales"], int8_activations=rounded)
    assert torch.equal(bound(x), want)
    if gemv.int4_layout_matches():
        weight = torch.randn(48, 96, generator=generator).to(torch.bfloat16)
        four = quantise(weight, Quantization.of("int4", 32))
        bound4 = gemv.RowProduct(four["qweight"], four["scales"], 32, int8_activations=rounded)
        assert torch.equal(bound4(x), gemv.int4_gemv(x, four["qweight"], four["scales"], 32,
                                                     int8_activations=rounded))
    for bad in (torch.randn(2, 96), torch.randn(1, 95), x.double()):
        with pytest.raises(ValueError, match="one CPU row of 96"):
            bound(bad)
    with pytest.raises(ValueError, match="do not fit"):
        gemv.RowProduct(eight["qweight"], eight["scales"][:16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_row_product_is_the_float32_product(dtype: torch.dtype) -> None:
    """The router's logits kernel: one row times a dense weight in its own dtype (rows not a multiple of the
    kernel's four), to float32 rounding of the float64 product; inputs not a multiple of 8 are refused."""
    generator = torch.Generator().manual_seed(8)
    weight = torch.randn(67, 96, generator=generator).to(dtype)
    x = torch.randn(1, 96, generator=generator).to(dtype)
    out = torch.empty(1, 67)
    gemv._kernels.dense_row_product(x.data_ptr(), gemv.DTYPES[dtype], weight.data_ptr(), gemv.DTYPES[dtype],
                                    67, 96, out.data_ptr())
    want = x.double() @ weight.double().T
    bound = (x.double().abs() @ weight.double().abs().T) * 96 * 2**-24
    assert ((out.double() - want).abs() <= bound).all()
    for threads in (2, 3):  # rows split among helpers (17 groups of four: uneven parts) give the same bits
        split = torch.empty(1, 67)
        gemv._kernels.dense_row_product(x.data_ptr(), gemv.DTYPES[dtype], weight.data_ptr(),
                                        gemv.DTYPES[dtype], 67, 96, split.data_ptr(), gemv.workers(threads))
        assert torch.equal(split, out)
    with pytest.raises(ValueError, match="multiple of 8"):
        gemv._kernels.dense_row_product(x.data_ptr(), gemv.DTYPES[dtype], weight.data_ptr(),
                                        gemv.DTYPES[dtype], 67, 95, out.data_ptr())


@pytest.mark.parametrize(("scheme", "rounded"),
                         [("int8", False), ("int8", True), ("int4", True), ("int4", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.bfloat16])
def test_gated_rows_are_the_steps_they_fuse(scheme: str, rounded: bool, dtype: torch.dtype,
                                            weight_dtype: torch.dtype | None) -> None:
    """A decoded row's experts in one call: each slot holds, bit for bit, what the bound products, the SiLU
    gate kernel and torch's product with the router weight give it one step at a time; other slots are left
    alone."""
    from moeinf.kernels.quant_experts import silu_mul_row

    if scheme == "int4" and not gemv.int4_layout_matches():
        pytest.skip("this torch packs int4 otherwise than the kernel reads")
    quant = Quantization.of(scheme)
    group = quant.group_size if scheme == "int4" else 0
    generator = torch.Generator().manual_seed(5)
    experts = []
    for slot in (2, 0):
        gate_up, down = (quantise((torch.randn(shape, generator=generator) * 0.1).to(dtype), quant)
                         for shape in ((192, 128), (128, 96)))
        bound = [gemv.RowProduct(p["qweight"], p["scales"], group, int8_activations=rounded)
                 for p in (gate_up, down)]
        experts.append((*bound, slot))
    x = torch.randn(1, 128, generator=generator).to(dtype)
    weights = None if weight_dtype is None else torch.rand(3, generator=generator).to(weight_dtype)
    out_dtype = dtype if weights is None else torch.promote_types(dtype, weight_dtype)
    out = torch.full((3, 128), 7.0, dtype=out_dtype)
    gemv.gated_rows(x, experts, weights, out)
    for gate_up, down, slot in experts:
        y = down(silu_mul_row(gate_up(x)))
        want = y if weights is None else torch.mul(y, weights[slot:slot + 1])  # promotes as [k, 1] does
        assert torch.equal(out[slot], want[0])
    assert (out[1] == 7.0).all()


def test_gated_rows_refuse_what_does_not_fit() -> None:
    quant = Quantization.of("int8")
    generator = torch.Generator().manual_seed(6)
    gate_up, down, other = (quantise(torch.randn(shape, generator=generator).to(torch.bfloat16), quant)
                            for shape in ((64, 32), (32, 32), (32, 16)))
    g, d, wrong = (gemv.RowProduct(p["qweight"], p["scales"]) for p in (gate_up, down, other))
    x, out = torch.randn(1, 32).to(torch.bfloat16), torch.empty(2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one contiguous CPU row"):
        gemv.gated_rows(x.expand(2, -1), [(g, d, 0)], None, out)
    with pytest.raises(ValueError, match="out must be"):
        gemv.gated_rows(x, [(g, d, 0)], None, out.float())
    with pytest.raises(ValueError, match="out must be"):
        gemv.gated_rows(x, [(g, d, 2)], None, out)
    with pytest.raises(ValueError, match="not one gated expert"):
        gemv.gated_rows(x, [(g, wrong, 0)], None, out)
    with pytest.raises(ValueError, match="weights must be 2"):
        gemv.gated_rows(x, [(g, d, 0)], torch.ones(3, dtype=torch.bfloat16), out)
    with pytest.raises(ValueError, match="the experts take 32"):
        gemv.gated_rows(torch.randn(1, 16).to(torch.bfloat16), [(g, d, 0)], None, out)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_decoded_rows_experts_run_in_one_call_as_they_would_one_by_one(scheme: str, monkeypatch) -> None:
    """`ExpertOutputs` hands a decoded row's wave of experts to the gemv kernel's `rows_into` (one kernel
    call); the layer's output is bit-equal to computing them one at a time, and more rows never take it."""
    from transformers.integrations import moe as hf_moe

    from moeinf.kernels import quant_experts
    from moeinf.kernels.moe import Dispatch, ExpertOutputs, GatedKernel

    if scheme == "int4" and not gemv.int4_layout_matches():
        pytest.skip("this torch packs int4 otherwise than the kernel reads")

    class Experts(torch.nn.Module):  # the gate transformers' experts interface applies by default
        act_fn = torch.nn.SiLU()

    quant = Quantization.of(scheme)
    apply_gate = hf_moe._default_apply_gate.__get__(Experts())
    exact = GatedKernel(has_gate=True, has_bias=False, is_transposed=False, apply_gate=apply_gate, act=None)
    shapes = {"gate_up_proj": (192, 128), "down_proj": (128, 96)}
    kernel = quant_experts.quantised_kernel(exact, quant, shapes, "auto")
    assert kernel.row_kernel == "gemv" and kernel.silu_gate
    generator = torch.Generator().manual_seed(9)
    store = {e: {f"{name}.{k}": v for name, shape in shapes.items()
                 for k, v in quantise((torch.randn(shape, generator=generator) * 0.1).to(torch.bfloat16),
                                      quant).items()}
             for e in range(4)}

    def layer(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        dispatch = Dispatch(index, 4)
        outputs = ExpertOutputs(hidden, weights, dispatch)
        experts = sorted(dispatch.groups)
        outputs.compute_many(experts, kernel, [store[e] for e in experts], stack=False)
        return outputs.result()

    calls = []
    fused = quant_experts.QuantisedGatedKernel.rows_into

    def spy(self, *args):
        calls.append(args[0].shape[0])
        return fused(self, *args)

    monkeypatch.setattr(quant_experts.QuantisedGatedKernel, "rows_into", spy)
    row = torch.randn(1, 128, generator=generator).to(torch.bfloat16)
    index, weights = torch.tensor([[3, 1]]), torch.tensor([[0.7, 0.3]])
    together = layer(row, index, weights)
    assert calls == [1]
    monkeypatch.setattr(quant_experts.QuantisedGatedKernel, "rows_into", lambda *args: False)
    one_by_one = layer(row, index, weights)
    assert torch.equal(together, one_by_one)
    monkeypatch.setattr(quant_experts.QuantisedGatedKernel, "rows_into", spy)
    calls.clear()
    two = torch.randn(2, 128, generator=generator).to(torch.bfloat16)
    layer(two, torch.tensor([[3, 1], [0, 1]]), torch.rand(2, 2, generator=generator))
    assert calls == []


@pytest.mark.parametrize("count", [2, 3, 4])
def test_gated_rows_across_threads_are_the_one_thread_result(count: int) -> None:
    """With helper threads, a wave whose experts divide among the threads runs whole experts per thread (no
    hand-off inside an expert), another splits each product: both are the one-thread result bit for bit."""
    if not gemv.int4_layout_matches():
        pytest.skip("this torch packs int4 otherwise than the kernel reads")
    quant = Quantization.of("int4")
    generator = torch.Generator().manual_seed(count)
    experts = []
    for slot in range(count):
        parts = [quantise((torch.randn(shape, generator=generator) * 0.1).to(torch.bfloat16), quant)
                 for shape in ((384, 256), (256, 192))]
        experts.append((*(gemv.RowProduct(p["qweight"], p["scales"], quant.group_size, int8_activations=True)
                          for p in parts), slot))
    x = torch.randn(1, 256, generator=generator).to(torch.bfloat16)
    weights = torch.rand(count, generator=generator)
    results = {}
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results[n] = torch.zeros(count, 256)
            gemv.gated_rows(x, experts, weights, results[n])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[1], results[2]) and (results[1] != 0).all(dim=1).all()
