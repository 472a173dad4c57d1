// SwiGLU over a fused [gate | up] projection (contract: kernels/silu_mul.py): silu(gate) computed in fp32 and
// rounded to the storage dtype, then multiplied by up and rounded again, as the unfused torch ops do.
#include "common.h"

namespace pdserve {

namespace {

template <typename T>
void silu_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t rows = x.size(0), inter = out.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gate = xp + t * xs;
      const T* up = gate + inter;
      T* o = op + t * inter;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= inter; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        // g >= 0: g / (1 + e); g < 0: g * e / (1 + e), with e = exp(-|g|) never overflowing.
        const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 numerator = _mm512_mask_mul_ps(g, negative, g, e);
        const __m512 silu = _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        store16(o + i, _mm512_mul_ps(round_to(o, silu), load16(up + i)));
      }
#elif defined(PDSERVE_AVX2)
      const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
      const __m256 sign = _mm256_set1_ps(-0.0f);
      for (; i + 8 <= inter; i += 8) {
        const __m256 g = load8(gate + i);
        const __m256 e = exp_nonpositive8(_mm256_or_ps(g, sign));  // e^-|g|
        const __m256 numerator = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
        const __m256 silu = _mm256_div_ps(numerator, _mm256_add_ps(one, e));
        store8(o + i, _mm256_mul_ps(round_to(o, silu), load8(up + i)));
      }
#endif
      for (; i < inter; ++i) {
        const float g = to_f32(gate[i]);
        // silu(g) = g / (1 + e^-g), written with a non-positive exponent for the vectorizable exp.
        const float e = exp_nonpositive(-std::fabs(g));
        const float silu = g >= 0.0f ? g / (1.0f + e) : g * e / (1.0f + e);
        o[i] = from_f32<T>(to_f32(from_f32<T>(silu)) * to_f32(up[i]));
      }
    }
  });
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [T, 2I], contiguous rows");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  PDSERVE_DISPATCH(x.scalar_type(), [&] { silu_mul_rows<scalar_t>(x, out); });
  return out;
}

}  // namespace pdserve
