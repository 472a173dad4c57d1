// RMSNorm, optionally fused with the residual add before it (contract: kernels/rmsnorm.py).
// One pass per row: r = round(x + residual); out = round(w * round(r * rsqrt(mean(r^2) + eps))).
#include "common.h"

namespace pdserve {

namespace {

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
               at::Tensor& out, at::Tensor* residual_out) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* rop = residual_out ? residual_out->data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), rs = residual ? residual->stride(0) : 0;
  const float inv_h = 1.0f / static_cast<float>(hidden), epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t t = begin; t < end; ++t) {
      const T* xr = xp + t * xs;
      const T* rr = rp ? rp + t * rs : nullptr;
      T* ro = rop ? rop + t * hidden : nullptr;
      T* o = op + t * hidden;
      int64_t i = 0;
      float sum = 0.0f;
#if defined(__AVX512F__)
      __m512 squares = _mm512_setzero_ps();
      for (; i + 16 <= hidden; i += 16) {
        __m512 v = load16(xr + i);
        if (rr) {
          v = round_to(ro, _mm512_add_ps(v, load16(rr + i)));  // the new residual, in T's precision
          store16(ro + i, v);
        }
        _mm512_storeu_ps(row.data() + i, v);
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      sum = _mm512_reduce_add_ps(squares);
#elif defined(PDSERVE_AVX2)
      __m256 squares = _mm256_setzero_ps();
      for (; i + 8 <= hidden; i += 8) {
        __m256 v = load8(xr + i);
        if (rr) {
          v = round_to(ro, _mm256_add_ps(v, load8(rr + i)));
          store8(ro + i, v);
        }
        _mm256_storeu_ps(row.data() + i, v);
        squares = _mm256_fmadd_ps(v, v, squares);
      }
      sum = hsum8(squares);
#endif
      for (; i < hidden; ++i) {
        float v = to_f32(xr[i]);
        if (rr) {
          const T r = from_f32<T>(v + to_f32(rr[i]));
          ro[i] = r;
          v = to_f32(r);
        }
        row[i] = v;
        sum += v * v;
      }
      const float rstd = 1.0f / std::sqrt(sum * inv_h + epsf);
      i = 0;
#if defined(__AVX512F__)
      const __m512 scale = _mm512_set1_ps(rstd);
      for (; i + 16 <= hidden; i += 16) {
        const __m512 normed = round_to(o, _mm512_mul_ps(_mm512_loadu_ps(row.data() + i), scale));
        store16(o + i, _mm512_mul_ps(load16(wp + i), normed));
      }
#elif defined(PDSERVE_AVX2)
      const __m256 scale = _mm256_set1_ps(rstd);
      for (; i + 8 <= hidden; i += 8) {
        const __m256 normed = round_to(o, _mm256_mul_ps(_mm256_loadu_ps(row.data() + i), scale));
        store8(o + i, _mm256_mul_ps(load8(wp + i), normed));
      }
#endif
      for (; i < hidden; ++i) o[i] = from_f32<T>(to_f32(wp[i]) * to_f32(from_f32<T>(row[i] * rstd)));
    }
  });
}

}  // namespace

std::vector<at::Tensor> rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                const c10::optional<at::Tensor>& residual) {
  check_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, H] with a contiguous last dim");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(1),
              "weight must be a contiguous [H] tensor of x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (!residual) {
    PDSERVE_DISPATCH(x.scalar_type(), [&] { norm_rows<scalar_t>(x, nullptr, weight, eps, out, nullptr); });
    return {out};
  }
  const at::Tensor& res = *residual;
  TORCH_CHECK(res.sizes() == x.sizes() && res.stride(1) == 1 && res.scalar_type() == x.scalar_type(),
              "residual must match x");
  at::Tensor res_out = at::empty({x.size(0), x.size(1)}, x.options());
  PDSERVE_DISPATCH(x.scalar_type(), [&] { norm_rows<scalar_t>(x, &res, weight, eps, out, &res_out); });
  return {out, res_out};
}

}  // namespace pdserve
