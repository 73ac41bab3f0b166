#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "dtypes.hpp"
#include "workers.hpp"

// Matrix-vector products on the quantised expert layouts of moeinf/store/quant.py, for the few rows of a
// decoded token. torch's weight-only CPU kernels reach ~4 GB/s of weights on an AVX2-only CPU at one row,
// where one core streams ~13 GB/s: these read each weight byte once, in
// order, with the next block prefetched. Plain C++ on pointers: no torch, no Python (kernels_bindings.cpp).
namespace moeinf {

// Whether this CPU runs the kernels (x86-64 with AVX2, FMA and F16C); when false they must not be called.
bool gemv_supported();

// Whether int4 products on int8-rounded rows (`quantise_x`) take the AVX-512 VNNI path where the CPU has it
// (the default: on), else the AVX2 one; both give the same bits. Returns whether they now take it.
bool set_int4_avx512(bool enabled);

// out[m, n] = scale[n] * sum_k x[m, k] * q[n, k] for m < rows: x [rows, K] and out [rows, N] of `io_type`
// (sums in float32, rounded to nearest even once at the end), q int8 [N, K] row-major, scale [N] of
// `scale_type`.
// `workers` (or nullptr: the calling thread alone) split the output rows between them.
// With `quantise_x`, each x row is first rounded to int8 in blocks of 32 values with one float32 scale each
// (amax / 127, round to nearest even: llama.cpp's Q8_0) and the products are integer (K a multiple of 32):
// ~2x faster at one row on AVX2, at the price of that rounding of the activations.
void int8_rowwise_gemv(const void* x, DType io_type, size_t rows, const int8_t* q, const void* scale,
                       DType scale_type, void* out, size_t N, size_t K, Workers* workers, bool quantise_x);

// The same for torch's CPU int4 packing (`_convert_weight_to_int4pack_for_cpu`): rows in blocks of B =
// `block_rows` (32 where torch's CPU capability is AVX2, 64 on AVX-512), block b a [K, B / 2] byte array whose
// byte (k, j) holds row Bb+j in its low nibble and Bb+B/2+j in its high one; the last N % B rows (a multiple of
// 16) a [K, (N % B) / 2] array whose byte (k, j) holds rows 2j and 2j+1 of them. Weight
// w = (q - 8) * s + z with (s, z) = scale_zero[k / group][n] ([K / group, N, 2] of `scale_type`).
// N a multiple of 16, K of `group`, `group` even; with `quantise_x` (as above) a multiple of 32.
void int4_packed_gemv(const void* x, DType io_type, size_t rows, const uint8_t* packed, const void* scale_zero,
                      DType scale_type, void* out, size_t N, size_t K, size_t group, Workers* workers,
                      bool quantise_x, size_t block_rows = 32);

// One quantised weight [N, K] as the two products above read it: int8 `q` with per-row scales (group 0), or
// torch's int4 packing with group-wise (scale, zero) pairs (group > 0); `quantise_x` as above.
struct RowWeight {
  const void* q;
  const void* scales;
  DType scale_type;
  size_t N, K, group;
  bool quantise_x;
  size_t block_rows = 32;  // int4: torch's packing's rows per block (32 or 64, `int4_packed_gemv`)
  // std::invalid_argument where the shapes do not fit the kernel.
  void check() const;
};

// x [rows, K] times `w` into out [rows, N], both of `io_type`: `int8_rowwise_gemv` or `int4_packed_gemv`.
void row_weight_product(const void* x, DType io_type, size_t rows, const RowWeight& w, void* out, Workers* workers);

// One gated expert of a decoded row: `gate_up` [2I, K] ([gate | up] rows) and `down` [H, I]; its output goes to
// row `slot` of `gated_rows`' out.
struct GatedExpert {
  RowWeight gate_up, down;
  size_t slot;
};

// A decoded row's experts in one call, each step rounded as torch's ops on `io_type` round: for each expert,
// (g | u) = gate_up(x) rounded to io_type, a = silu(g) * u as `silu_mul`, y = down(a) rounded to io_type, then
// out[slot] = y * weights[slot] computed in float32 and stored as `out_type` (what torch.mul of y and the
// router weights stores), or out[slot] = y with `weights` nullptr (out_type then io_type). x [K] of `io_type`,
// out [*, H]; x's int8 blocks (where the gate_ups round x) are made once for every expert. Per expert this
// saves the Python of three products and three torch ops (~0.15 ms of a decoded row on a small VM). With
// `workers`, experts that divide evenly among the threads run whole on one thread each (no hand-off inside
// an expert: 0.93-0.95x the decode step of splitting each product); otherwise each product is split.
void gated_rows(const void* x, DType io_type, const std::vector<GatedExpert>& experts, const void* weights,
                DType weight_type, void* out, DType out_type, Workers* workers);

// out[n] = sum_k x[k] * w[n, k] in float32 (float32 out [N]) for one row x [K] of `x_type` and a dense w
// [N, K] of `w_type`, row-major; K a multiple of 8. On the calling thread: for small matrices read once per
// token (a router's [E, H]), where a torch call's dispatch costs more than the product.
void dense_row_product(const void* x, DType x_type, const void* w, DType w_type, size_t N, size_t K, float* out,
                       Workers* workers = nullptr);

}  // namespace moeinf
