#include "mla.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "avx2.hpp"
#include "gemv.hpp"

namespace moeinf {
namespace {

// The float32 vector steps of `mla_attend`: a dot product, y += a x, and widening a row of `type`. The
// attention's sums are float32 reductions, which a compiler keeps in order (one dependent add after another:
// ~70 us per layer over 200 cached tokens); here eight lanes at a time where the CPU has AVX2.
struct VectorOps {
  float (*dot)(const float* a, const float* b, size_t n);
  void (*axpy)(float a, const float* x, float* y, size_t n);
  void (*widen)(const void* x, DType type, size_t n, float* out);
};

float dot_scalar(const float* a, const float* b, size_t n) {
  float sum = 0.0f;
  for (size_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void axpy_scalar(float a, const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void widen_scalar(const void* x, DType type, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = to_float(x, i, type);
}

#ifdef MOEINF_X86
MOEINF_AVX2 float dot_avx2(const float* a, const float* b, size_t n) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    even = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), even);
    odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), odd);
  }
  for (; i + 8 <= n; i += 8) even = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), even);
  float sum = hsum(_mm256_add_ps(even, odd));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

MOEINF_AVX2 void axpy_avx2(float a, const float* x, float* y, size_t n) {
  const __m256 av = _mm256_set1_ps(a);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

MOEINF_AVX2 void widen_avx2(const void* x, DType type, size_t n, float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8(x, i, type));
  for (; i < n; ++i) out[i] = to_float(x, i, type);
}
#endif  // MOEINF_X86

const VectorOps& vector_ops() {
  static const VectorOps scalar{dot_scalar, axpy_scalar, widen_scalar};
#ifdef MOEINF_X86
  static const VectorOps avx2{dot_avx2, axpy_avx2, widen_avx2};
  if (gemv_supported()) return avx2;
#endif
  return scalar;
}

// x [rope] rotated by (cos, sin) into `out` (float32 values of `type`).
void rotate(const void* x, size_t offset, const void* cos, const void* sin, bool interleave, DType type, size_t rope,
            float* out) {
  const size_t half = rope / 2;
  auto r = [type](float value) { return rounded(value, type); };
  for (size_t i = 0; i < half; ++i) {
    // interleaved: pair i is (x[2i], x[2i + 1]); halves: (x[i], x[i + half])
    const float a = to_float(x, offset + (interleave ? 2 * i : i), type);
    const float b = to_float(x, offset + (interleave ? 2 * i + 1 : i + half), type);
    const float c = to_float(cos, i, type), s = to_float(sin, i, type);
    const float c2 = to_float(cos, i + half, type), s2 = to_float(sin, i + half, type);
    if (interleave) {  // cat([x1 cos - x2 sin, x2 cos + x1 sin]) over the first half of cos, sin
      out[i] = r(r(a * c) - r(b * s));
      out[half + i] = r(r(b * c) + r(a * s));
    } else {  // x cos + rotate_half(x) sin
      out[i] = r(r(a * c) + r(-b * s));
      out[half + i] = r(r(b * c2) + r(a * s2));
    }
  }
}

// The norm of one row: weight * (x * rsqrt(mean(x^2) + eps)).to(type).
void norm_row(const void* x, size_t offset, const void* weight, float eps, DType type, size_t n, void* out,
              size_t out_offset) {
  float squares = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float v = to_float(x, offset + i, type);
    squares += v * v;
  }
  const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
  for (size_t i = 0; i < n; ++i) {
    const float normed = rounded(to_float(x, offset + i, type) * inverse, type);
    store(out, out_offset + i, to_float(weight, i, type) * normed, type);
  }
}

}  // namespace

void rms_norm(const void* x, const void* weight, float eps, DType type, size_t rows, size_t n, void* out) {
  for (size_t r = 0; r < rows; ++r) norm_row(x, r * n, weight, eps, type, n, out, r * n);
}

void silu_mul(const void* x, DType type, size_t rows, size_t n, void* out) {
  for (size_t r = 0; r < rows; ++r)
    for (size_t i = 0; i < n; ++i) {
      const float gate = to_float(x, r * 2 * n + i, type), up = to_float(x, r * 2 * n + n + i, type);
      const float act = rounded(gate / (1.0f + std::exp(-gate)), type);
      store(out, r * n + i, act * up, type);
    }
}

void sigmoid_topk(const float* logits, const void* bias, DType bias_type, size_t E, size_t k, bool normalise,
                  float scaling, float* weights, int64_t* ids) {
  std::vector<float> scores(E), choice(E);
  std::vector<size_t> order(E);
  for (size_t e = 0; e < E; ++e) {
    scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    choice[e] = scores[e] + to_float(bias, e, bias_type);
    order[e] = e;
  }
  // the k largest choices, largest first (ties: the lower id)
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](size_t a, size_t b) { return choice[a] > choice[b] || (choice[a] == choice[b] && a < b); });
  float total = 0.0f;
  for (size_t i = 0; i < k; ++i) total += scores[order[i]];
  const float denominator = normalise ? total + 1e-20f : 1.0f;
  for (size_t i = 0; i < k; ++i) {
    ids[i] = static_cast<int64_t>(order[i]);
    const float weight = normalise ? scores[order[i]] / denominator : scores[order[i]];
    weights[i] = weight * scaling;
  }
}

void mla_prepare(const void* q, const void* latent, const void* norm_weight, float eps, const void* cos,
                 const void* sin, bool interleave, DType type, const MlaShape& shape, float* q_out, void* kv_out,
                 void* k_rot_out) {
  const size_t width = shape.nope + shape.rope;
  for (size_t h = 0; h < shape.heads; ++h) {
    for (size_t i = 0; i < shape.nope; ++i) q_out[h * width + i] = to_float(q, h * width + i, type);
    rotate(q, h * width + shape.nope, cos, sin, interleave, type, shape.rope, q_out + h * width + shape.nope);
  }
  norm_row(latent, 0, norm_weight, eps, type, shape.rank, kv_out, 0);
  std::vector<float> k(shape.rope);
  rotate(latent, shape.rank, cos, sin, interleave, type, shape.rope, k.data());
  for (size_t i = 0; i < shape.rope; ++i) store(k_rot_out, i, k[i], type);
}

void mla_attend(const float* q, const void* latents, const void* k_rot, size_t T, const float* w_uk,
                const float* w_uv_t, float scaling, const uint8_t* mask, DType type, const MlaShape& shape, void* out) {
  const VectorOps& ops = vector_ops();
  const size_t width = shape.nope + shape.rope, rank = shape.rank;
  std::vector<float> lat(T * rank), keys(T * shape.rope);
  ops.widen(latents, type, T * rank, lat.data());
  ops.widen(k_rot, type, T * shape.rope, keys.data());
  std::vector<float> q_latent(rank), scores(T), out_latent(rank), values(shape.v);
  for (size_t h = 0; h < shape.heads; ++h) {
    const float* qh = q + h * width;
    // q_nope W_uk: the query in the latent space
    std::fill(q_latent.begin(), q_latent.end(), 0.0f);
    for (size_t n = 0; n < shape.nope; ++n) ops.axpy(qh[n], w_uk + (h * shape.nope + n) * rank, q_latent.data(), rank);
    float top = -std::numeric_limits<float>::infinity();
    for (size_t t = 0; t < T; ++t) {
      const float rot = ops.dot(qh + shape.nope, keys.data() + t * shape.rope, shape.rope);
      const float nope = ops.dot(q_latent.data(), lat.data() + t * rank, rank);
      scores[t] = mask != nullptr && mask[t] == 0 ? -std::numeric_limits<float>::infinity() : (rot + nope) * scaling;
      top = std::max(top, scores[t]);
    }
    float total = 0.0f;
    for (size_t t = 0; t < T; ++t) total += (scores[t] = std::exp(scores[t] - top));
    std::fill(out_latent.begin(), out_latent.end(), 0.0f);
    for (size_t t = 0; t < T; ++t) ops.axpy(scores[t] / total, lat.data() + t * rank, out_latent.data(), rank);
    // W_uv^T (the attended latent): this head's values, row r of w_uv_t [rank, v] at a time
    std::fill(values.begin(), values.end(), 0.0f);
    for (size_t r = 0; r < rank; ++r) ops.axpy(out_latent[r], w_uv_t + (h * rank + r) * shape.v, values.data(), shape.v);
    for (size_t v = 0; v < shape.v; ++v) store(out, h * shape.v + v, values[v], type);
  }
}

}  // namespace moeinf
