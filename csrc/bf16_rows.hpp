#pragma once
#include <cstddef>
#include <cstdint>

#include "workers.hpp"

// One bf16 row times a bf16 matrix, with the bits of oneDNN's AVX-512 BF16 matmul (`brg_matmul:
// avx512_core_bf16`), which is what torch's bf16 `F.linear` runs on a CPU with AVX512_BF16. On such a CPU
// that call streams ~8-16 GB/s of weights at one decoded row, where this kernel streams ~24 (it repacks the
// weight for every call). The order of its sums, found by crafted inputs
// whose result depends on it (tests/test_bf16_rows.py), is reproduced here:
//   - K in blocks of `k_block` (512) values; within a block one float32 sum per output starts at +0 and takes
//     the pairs (k, k + 1) in order, each through `vdpbf16ps` (odd element first, as the instruction does);
//   - the blocks' sums are added in order, and the total rounded to bf16 by `vcvtneps2bf16`.
// The same instructions in the same order give the same bits; moeinf/kernels/bf16_rows.py uses it only
// for shapes where a probe of crafted inputs shows torch's bits. Plain C++ on pointers: no torch.
namespace moeinf {

// Whether this CPU runs `bf16_row_product` (AVX-512 F/BW/VL and BF16: Cooper Lake, Sapphire Rapids, Zen 4
// and later); when false it must not be called.
bool bf16_rows_supported();

// out[n] = x . w[n] for n < N as above: x [K] bf16, w rows of K bf16 `row_stride` values apart, out [N] bf16;
// N a multiple of 16, K of 32, `k_block` a multiple of 32. `workers` (or nullptr) split the outputs.
void bf16_row_product(const uint16_t* x, const uint16_t* w, size_t row_stride, size_t N, size_t K, uint16_t* out,
                      Workers* workers, size_t k_block = 512);

}  // namespace moeinf
