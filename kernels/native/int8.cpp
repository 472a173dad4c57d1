// Per-row int8 quantization of activations and the dequantizing epilogue of an int8 matmul
// (contract: kernels/int8_matmul.py). Both are one pass over their rows, so the int8 matmul between them is
// the only full-size work: torch's versions take four to six passes each.
#include "common.h"

#include <algorithm>
#include <limits>

// The scalar loops (a row's tail, or all of it without AVX-512) must round x * inv_smooth before subtracting, as
// the torch twin does (q is bit-identical across implementations): no fused multiply-add, which -march builds
// with FMA otherwise contract it into (seen as a code one step off in a smoothed row's tail).
#pragma GCC optimize("fp-contract=off")

namespace pdserve {

namespace {

// Row t of x (times inv_smooth per column when given) -> q in [-128, 127] with x ~ scale * q + zero.
void quantize_row(const float* x, const float* inv_smooth, int64_t k, int8_t* q, float* scale, float* zero) {
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
  for (; i + 16 <= k; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    if (inv_smooth) v = _mm512_mul_ps(v, _mm512_loadu_ps(inv_smooth + i));
    vlo = _mm512_min_ps(vlo, v);
    vhi = _mm512_max_ps(vhi, v);
  }
  lo = _mm512_reduce_min_ps(vlo);
  hi = _mm512_reduce_max_ps(vhi);
#endif
  for (; i < k; ++i) {
    const float v = inv_smooth ? x[i] * inv_smooth[i] : x[i];
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  const float range = hi - lo;
  // As the torch twin computes it: `255.0 / span` is span.reciprocal() * 255 in torch, two roundings.
  const float inv_step = range > 0.0f ? (1.0f / range) * 255.0f : 0.0f;
  const float step = range / 255.0f;
  *scale = step;
  *zero = lo + 128.0f * step;
  i = 0;
#if defined(__AVX512F__)
  const __m512 vmin = _mm512_set1_ps(lo), vinv = _mm512_set1_ps(inv_step);
  const __m512i bias = _mm512_set1_epi32(128);
  for (; i + 16 <= k; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    if (inv_smooth) v = _mm512_mul_ps(v, _mm512_loadu_ps(inv_smooth + i));
    // Rounds to nearest even (the default MXCSR mode), as torch.round does; saturating narrow to int8.
    const __m512i n = _mm512_sub_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(v, vmin), vinv)), bias);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(n));
  }
#endif
  for (; i < k; ++i) {
    const float v = inv_smooth ? x[i] * inv_smooth[i] : x[i];
    const float n = std::nearbyint((v - lo) * inv_step) - 128.0f;
    q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, n)));
  }
}

}  // namespace

std::vector<at::Tensor> quantize_rows(const at::Tensor& x, const c10::optional<at::Tensor>& inv_smooth) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x must be a float32 CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t rows = x.size(0), k = x.size(1), xs = x.stride(0);
  const float* sp = nullptr;
  if (inv_smooth) {
    TORCH_CHECK(inv_smooth->scalar_type() == at::kFloat && inv_smooth->is_contiguous() &&
                    inv_smooth->dim() == 1 && inv_smooth->size(0) == k,
                "inv_smooth must be a contiguous float32 [K]");
    sp = inv_smooth->data_ptr<float>();
  }
  at::Tensor q = at::empty({rows, k}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({rows}, x.options());
  at::Tensor zero = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* scp = scale.data_ptr<float>();
  float* zp = zero.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) quantize_row(xp + t * xs, sp, k, qp + t * k, scp + t, zp + t);
  });
  return {q, scale, zero};
}

// out[m, n] = acc[m, n] * scale[m] * col_scale[n] + zero[m] * col_sum[n] (+ bias[n]) (+ residual[m, n]).
at::Tensor dequantize_rows(const at::Tensor& acc, const at::Tensor& scale, const at::Tensor& zero,
                           const at::Tensor& col_scale, const at::Tensor& col_sum, const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(acc.device().is_cpu() && acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.stride(1) == 1,
              "acc must be an int32 CPU [M, N] with contiguous rows");
  const int64_t rows = acc.size(0), n = acc.size(1);
  auto check_vec = [](const at::Tensor& t, int64_t size, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 && t.size(0) == size,
                name, " must be a contiguous float32 vector of ", size);
  };
  check_vec(scale, rows, "scale");
  check_vec(zero, rows, "zero");
  check_vec(col_scale, n, "col_scale");
  check_vec(col_sum, n, "col_sum");
  if (bias) check_vec(*bias, n, "bias");
  if (residual) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->dim() == 2 && residual->size(0) == rows &&
                    residual->size(1) == n && residual->stride(1) == 1,
                "residual must be a float32 [M, N] with contiguous rows");
  }
  at::Tensor out = at::empty({rows, n}, acc.options().dtype(at::kFloat));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float *sp = scale.data_ptr<float>(), *zp = zero.data_ptr<float>();
  const float *cs = col_scale.data_ptr<float>(), *csum = col_sum.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  const int64_t as = acc.stride(0), rs = residual ? residual->stride(0) : 0;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int32_t* a = ap + t * as;
      const float* r = rp ? rp + t * rs : nullptr;
      float* o = op + t * n;
      const float s = sp[t], z = zp[t];
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
      for (; i + 16 <= n; i += 16) {
        const __m512 va = _mm512_cvtepi32_ps(_mm512_loadu_si512(a + i));
        __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(va, vs), _mm512_loadu_ps(cs + i),
                                   _mm512_mul_ps(vz, _mm512_loadu_ps(csum + i)));
        if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bp + i));
        if (r) v = _mm512_add_ps(v, _mm512_loadu_ps(r + i));
        _mm512_storeu_ps(o + i, v);
      }
#endif
      for (; i < n; ++i) {
        float v = static_cast<float>(a[i]) * s * cs[i] + z * csum[i];
        if (bp) v += bp[i];
        if (r) v += r[i];
        o[i] = v;
      }
    }
  });
  return out;
}

}  // namespace pdserve
