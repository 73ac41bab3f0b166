#pragma once
// Small per-row kernels of a decoded token where torch's op dispatch costs more than the arithmetic. The
// RMSNorm of a row, DeepSeek-V3's top-k routing of a row, and its (MLA) attention's decode step of one row on the latent cache, `kv_b_proj` absorbed, as
// moeinf/models/deepseek_v3/mla_decode.py computes it with torch ops: the same math in two calls instead of ~40 small
// ops per layer (at one decoded row each op's dispatch costs more than its arithmetic). Plain C++ on
// pointers: no torch, no Python (kernels_bindings.cpp).
#include <cstddef>
#include <cstdint>

#include "dtypes.hpp"

namespace moeinf {

// DeepSeek-V3's group-free top-k routing of one row from its router logits [E] (float32): scores =
// sigmoid(logits); the k experts of highest scores + bias ([E] of `bias_type`), largest first; their scores,
// divided by their sum + 1e-20 with `normalise`, times `scaling`. Writes weights [k] float32 and ids [k].
void sigmoid_topk(const float* logits, const void* bias, DType bias_type, size_t E, size_t k, bool normalise,
                  float scaling, float* weights, int64_t* ids);

struct MlaShape {
  size_t heads, nope, rope, rank, v;  // query heads, per-head no-position and rotary dims, latent rank, value dim
};

// A Llama-form RMSNorm of `rows` rows of x [rows, n] into out, weight [n], all of `type`: out = weight *
// (x * rsqrt(mean(x^2) + eps)).to(type), the float32 sum of squares in this loop's order.
void rms_norm(const void* x, const void* weight, float eps, DType type, size_t rows, size_t n, void* out);

// transformers' default gate of gated experts with a SiLU, for rows x [rows, 2n] of `type` ([gate | up]):
// out [rows, n] = silu(gate) * up, each op rounded to `type` as torch's are (silu as x / (1 + exp(-x)) in
// float32; exp is the C library's, so a value may differ from torch's by a rounding step of the dtype).
void silu_mul(const void* x, DType type, size_t rows, size_t n, void* out);

// Before the cache update, for one row: q [heads, nope + rope] and latent [rank + rope] (the outputs of
// q_proj and kv_a_proj_with_mqa), the latent's Llama-form RMSNorm weight [rank] and eps, and this
// position's cos and sin [rope] (`cat(freqs, freqs)`), all of `type`. Writes q_out float32 [heads, nope +
// rope] (the rotary part rotated), kv_out [rank] (the normed latent) and k_rot_out [rope] (the rotated key)
// of `type`. Rotation and norm round to `type` after each op as transformers' do in that dtype: with
// `interleave` DeepSeek's pairs (x0, x1), (x2, x3)... (`apply_rotary_pos_emb_interleave`), else
// `rotate_half`'s halves.
void mla_prepare(const void* q, const void* latent, const void* norm_weight, float eps, const void* cos,
                 const void* sin, bool interleave, DType type, const MlaShape& shape, float* q_out, void* kv_out,
                 void* k_rot_out);

// After the cache update: q float32 [heads, nope + rope] (from mla_prepare), the whole caches `latents` [T,
// rank] and `k_rot` [T, rope] of `type`, the key and value halves of kv_b_proj as w_uk [heads, nope, rank]
// and w_uv_t [heads, rank, v] float32, the softmax scaling, and `mask` (T bytes, 0 where the row may not
// attend; or nullptr). Writes out [heads, v] of `type`: sums in float32, rounded once.
void mla_attend(const float* q, const void* latents, const void* k_rot, size_t T, const float* w_uk,
                const float* w_uv_t, float scaling, const uint8_t* mask, DType type, const MlaShape& shape, void* out);

}  // namespace moeinf
