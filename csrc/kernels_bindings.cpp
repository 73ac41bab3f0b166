// The only file of the kernels module that knows Python: raw addresses in, the GIL released while computing.
// moeinf/kernels/gemv.py checks every tensor (dtype, shape, contiguity, device) before an address gets here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "bf16_rows.hpp"
#include "gemv.hpp"
#include "mla.hpp"

namespace py = pybind11;

namespace {

template <typename T>
T* at(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
  m.doc() = "moeinf's quantised GEMV kernels (private; use moeinf.kernels.gemv)";
  py::enum_<moeinf::DType>(m, "DType")
      .value("float32", moeinf::DType::Float32)
      .value("bfloat16", moeinf::DType::BFloat16)
      .value("float16", moeinf::DType::Float16);
  py::class_<moeinf::Workers>(m, "Workers", "Threads that split one product with the calling thread.")
      .def(py::init([](size_t threads, long spin_us) {
             return std::make_unique<moeinf::Workers>(threads, std::chrono::microseconds(spin_us));
           }),
           py::arg("threads"), py::arg("spin_us") = moeinf::Workers::kDefaultSpin.count(),
           "spin_us: how long an idle helper (and the caller waiting for helpers) spins before sleeping")
      .def_property_readonly("threads", &moeinf::Workers::size);
  m.def("supported", &moeinf::gemv_supported, "Whether this CPU runs the kernels (x86-64 with AVX2, FMA, F16C).");
  m.def("set_int4_avx512", &moeinf::set_int4_avx512, py::arg("enabled"),
        "Whether int4 products on int8-rounded rows take the AVX-512 VNNI path where the CPU has it (default on; "
        "the same bits as the AVX2 path); returns whether they now take it.");
  m.def(
      "int8_rowwise_gemv",
      [](uintptr_t x, moeinf::DType io_type, size_t rows, uintptr_t q, uintptr_t scale, moeinf::DType scale_type,
         uintptr_t out, size_t n, size_t k, moeinf::Workers* workers, bool quantise_x) {
        moeinf::int8_rowwise_gemv(at<const void>(x), io_type, rows, at<const int8_t>(q), at<const void>(scale),
                                  scale_type, at<void>(out), n, k, workers, quantise_x);
      },
      py::arg("x"), py::arg("io_type"), py::arg("rows"), py::arg("q"), py::arg("scale"), py::arg("scale_type"),
      py::arg("out"), py::arg("n"), py::arg("k"), py::arg("workers").none(true), py::arg("quantise_x") = false,
      py::call_guard<py::gil_scoped_release>(),
      "out[m, :n] = scale * (q @ x[m]) for m < rows (addresses of x [rows, k] and out [rows, n] of io_type, int8 q "
      "[n, k], scale [n]); with quantise_x, x rounded to int8 in blocks of 32 first (k a multiple of 32).");
  m.def(
      "int4_packed_gemv",
      [](uintptr_t x, moeinf::DType io_type, size_t rows, uintptr_t packed, uintptr_t scale_zero,
         moeinf::DType scale_type, uintptr_t out, size_t n, size_t k, size_t group, moeinf::Workers* workers,
         bool quantise_x, size_t block_rows) {
        moeinf::int4_packed_gemv(at<const void>(x), io_type, rows, at<const uint8_t>(packed), at<const void>(scale_zero),
                                 scale_type, at<void>(out), n, k, group, workers, quantise_x, block_rows);
      },
      py::arg("x"), py::arg("io_type"), py::arg("rows"), py::arg("packed"), py::arg("scale_zero"),
      py::arg("scale_type"), py::arg("out"), py::arg("n"), py::arg("k"), py::arg("group"),
      py::arg("workers").none(true), py::arg("quantise_x") = false, py::arg("block_rows") = 32,
      py::call_guard<py::gil_scoped_release>(),
      "The same on torch's CPU int4 packing (rows in blocks of block_rows: 32 on AVX2, 64 on AVX-512) with "
      "group-wise (scale, zero) [k / group, n, 2].");
  py::class_<moeinf::RowWeight>(m, "RowWeight", "A quantised weight [n, k] at fixed addresses (csrc/gemv.hpp).")
      .def(py::init([](uintptr_t q, uintptr_t scales, moeinf::DType scale_type, size_t n, size_t k, size_t group,
                       bool quantise_x, size_t block_rows) {
             moeinf::RowWeight w{at<const void>(q), at<const void>(scales), scale_type, n, k, group, quantise_x,
                                 block_rows};
             w.check();
             return w;
           }),
           py::arg("q"), py::arg("scales"), py::arg("scale_type"), py::arg("n"), py::arg("k"), py::arg("group"),
           py::arg("quantise_x"), py::arg("block_rows") = 32,
           "group 0: int8 with per-row scales; else torch's int4 packing with that group size and rows per block.");
  m.def(
      "row_weight_product",
      [](uintptr_t x, moeinf::DType io_type, size_t rows, const moeinf::RowWeight& w, uintptr_t out,
         moeinf::Workers* workers) {
        moeinf::row_weight_product(at<const void>(x), io_type, rows, w, at<void>(out), workers);
      },
      py::arg("x"), py::arg("io_type"), py::arg("rows"), py::arg("weight"), py::arg("out"),
      py::arg("workers").none(true), py::call_guard<py::gil_scoped_release>(),
      "out[m] = weight @ x[m] for m < rows (addresses of x [rows, k] and out [rows, n] of io_type).");
  m.def(
      "gated_rows",
      [](uintptr_t x, moeinf::DType io_type,
         const std::vector<std::tuple<moeinf::RowWeight, moeinf::RowWeight, size_t>>& experts, uintptr_t weights,
         moeinf::DType weight_type, uintptr_t out, moeinf::DType out_type, moeinf::Workers* workers) {
        std::vector<moeinf::GatedExpert> gated;
        for (const auto& [gate_up, down, slot] : experts) gated.push_back({gate_up, down, slot});
        py::gil_scoped_release release;
        moeinf::gated_rows(at<const void>(x), io_type, gated, weights == 0 ? nullptr : at<const void>(weights),
                           weight_type, at<void>(out), out_type, workers);
      },
      py::arg("x"), py::arg("io_type"), py::arg("experts"), py::arg("weights"), py::arg("weight_type"), py::arg("out"),
      py::arg("out_type"), py::arg("workers").none(true),
      "A decoded row's gated experts, (gate_up, down, slot) each, in one call (csrc/gemv.hpp); weights 0: none.");
  m.def("bf16_rows_supported", &moeinf::bf16_rows_supported,
        "Whether this CPU runs bf16_row_product (AVX-512 F/BW/VL/DQ and BF16).");
  m.def(
      "bf16_row_product",
      [](uintptr_t x, uintptr_t w, size_t row_stride, size_t n, size_t k, uintptr_t out, moeinf::Workers* workers,
         size_t k_block) {
        moeinf::bf16_row_product(at<const uint16_t>(x), at<const uint16_t>(w), row_stride, n, k, at<uint16_t>(out),
                                 workers, k_block);
      },
      py::arg("x"), py::arg("w"), py::arg("row_stride"), py::arg("n"), py::arg("k"), py::arg("out"),
      py::arg("workers").none(true), py::arg("k_block") = 512, py::call_guard<py::gil_scoped_release>(),
      "out[:n] = w @ x for one bf16 row x [k] and bf16 w rows row_stride values apart, bf16 out, in the order of "
      "oneDNN's AVX-512 BF16 matmul (csrc/bf16_rows.hpp).");
  m.def(
      "dense_row_product",
      [](uintptr_t x, moeinf::DType x_type, uintptr_t w, moeinf::DType w_type, size_t n, size_t k, uintptr_t out,
         moeinf::Workers* workers) {
        moeinf::dense_row_product(at<const void>(x), x_type, at<const void>(w), w_type, n, k, at<float>(out), workers);
      },
      py::arg("x"), py::arg("x_type"), py::arg("w"), py::arg("w_type"), py::arg("n"), py::arg("k"), py::arg("out"),
      py::arg("workers").none(true) = nullptr, py::call_guard<py::gil_scoped_release>(),
      "out[:n] = w @ x in float32 for one row x [k] and a dense w [n, k] (k a multiple of 8), float32 out; "
      "its rows split among `workers` (the same bits).");
  m.def(
      "rms_norm",
      [](uintptr_t x, uintptr_t weight, float eps, moeinf::DType type, size_t rows, size_t n, uintptr_t out) {
        moeinf::rms_norm(at<const void>(x), at<const void>(weight), eps, type, rows, n, at<void>(out));
      },
      py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("type"), py::arg("rows"), py::arg("n"), py::arg("out"),
      py::call_guard<py::gil_scoped_release>(), "A Llama-form RMSNorm of rows x [rows, n] into out (csrc/mla.hpp).");
  m.def(
      "silu_mul",
      [](uintptr_t x, moeinf::DType type, size_t rows, size_t n, uintptr_t out) {
        moeinf::silu_mul(at<const void>(x), type, rows, n, at<void>(out));
      },
      py::arg("x"), py::arg("type"), py::arg("rows"), py::arg("n"), py::arg("out"),
      py::call_guard<py::gil_scoped_release>(),
      "silu(gate) * up of rows x [rows, 2n] ([gate | up]) into out [rows, n] (csrc/mla.hpp).");
  m.def(
      "sigmoid_topk",
      [](uintptr_t logits, uintptr_t bias, moeinf::DType bias_type, size_t E, size_t k, bool normalise, float scaling,
         uintptr_t weights, uintptr_t ids) {
        moeinf::sigmoid_topk(at<const float>(logits), at<const void>(bias), bias_type, E, k, normalise, scaling,
                             at<float>(weights), at<int64_t>(ids));
      },
      py::arg("logits"), py::arg("bias"), py::arg("bias_type"), py::arg("E"), py::arg("k"), py::arg("normalise"),
      py::arg("scaling"), py::arg("weights"), py::arg("ids"), py::call_guard<py::gil_scoped_release>(),
      "DeepSeek-V3's group-free top-k routing of one row from its logits (csrc/mla.hpp).");
  py::class_<moeinf::MlaShape>(m, "MlaShape", "Heads and dims of an MLA attention.")
      .def(py::init([](size_t heads, size_t nope, size_t rope, size_t rank, size_t v) {
             return moeinf::MlaShape{heads, nope, rope, rank, v};
           }),
           py::arg("heads"), py::arg("nope"), py::arg("rope"), py::arg("rank"), py::arg("v"));
  m.def(
      "mla_prepare",
      [](uintptr_t q, uintptr_t latent, uintptr_t norm_weight, float eps, uintptr_t cos, uintptr_t sin, bool interleave,
         moeinf::DType type, const moeinf::MlaShape& shape, uintptr_t q_out, uintptr_t kv_out, uintptr_t k_rot_out) {
        moeinf::mla_prepare(at<const void>(q), at<const void>(latent), at<const void>(norm_weight), eps,
                            at<const void>(cos), at<const void>(sin), interleave, type, shape, at<float>(q_out),
                            at<void>(kv_out), at<void>(k_rot_out));
      },
      py::arg("q"), py::arg("latent"), py::arg("norm_weight"), py::arg("eps"), py::arg("cos"), py::arg("sin"),
      py::arg("interleave"), py::arg("type"), py::arg("shape"), py::arg("q_out"), py::arg("kv_out"), py::arg("k_rot_out"),
      py::call_guard<py::gil_scoped_release>(), "One row's rotated query and normed, rotated latent (csrc/mla.hpp).");
  m.def(
      "mla_attend",
      [](uintptr_t q, uintptr_t latents, uintptr_t k_rot, size_t T, uintptr_t w_uk, uintptr_t w_uv_t, float scaling,
         uintptr_t mask, moeinf::DType type, const moeinf::MlaShape& shape, uintptr_t out) {
        moeinf::mla_attend(at<const float>(q), at<const void>(latents), at<const void>(k_rot), T, at<const float>(w_uk),
                           at<const float>(w_uv_t), scaling, mask == 0 ? nullptr : at<const uint8_t>(mask), type,
                           shape, at<void>(out));
      },
      py::arg("q"), py::arg("latents"), py::arg("k_rot"), py::arg("T"), py::arg("w_uk"), py::arg("w_uv_t"),
      py::arg("scaling"), py::arg("mask"), py::arg("type"), py::arg("shape"), py::arg("out"),
      py::call_guard<py::gil_scoped_release>(),
      "One row's attention over the latent cache with kv_b_proj absorbed (csrc/mla.hpp); mask 0: none.");
}
