// y = x W^T for a few rows of x (contract: shared/linear.py): the decode step of one or two sequences, which
// only streams the weights once. One pass over W's rows in order, 32 bf16 products per AVX512-BF16 instruction,
// 16 output rows reduced together; each thread takes a contiguous band of rows, so W is read as a stream.
// An AVX2 build (no AVX-512) has the same pass 8 lanes wide, for bf16 weights (oneDNN packs no bf16 there and
// F.linear emulates it) and fp32 ones (what `--dtype auto` serves there; shared/linear.py decides whether a layer
// uses it). The speeds of each path: README, "Native kernels on AVX2-only CPUs".
#include "common.h"

#include <algorithm>

namespace pdserve {

namespace {

constexpr int64_t kMaxRows = 4;

#if defined(__AVX512BF16__)
// Output rows [begin, end) for every x row; in_f is a multiple of 32.
template <int M>
void gemv_band(const at::BFloat16* x, const at::BFloat16* w, int64_t in_f, int64_t out_f, int64_t begin,
               int64_t end, at::BFloat16* y) {
  const int64_t pairs = in_f / 32;
  for (int64_t o0 = begin; o0 < end; o0 += 16) {
    const int64_t n = std::min<int64_t>(16, end - o0);
    __m512 acc[M][16];
    for (int64_t r = 0; r < n; ++r) {
      const at::BFloat16* wr = w + (o0 + r) * in_f;
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_setzero_ps();
      for (int64_t c = 0; c < pairs; ++c) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + 32 * c);
        for (int m = 0; m < M; ++m) {
          acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)_mm512_loadu_si512(x + m * in_f + 32 * c), wv);
        }
      }
    }
    for (int m = 0; m < M; ++m) {
      at::BFloat16* ym = y + m * out_f + o0;
      if (n == 16) {
        store16(ym, sum16(acc[m]));
      } else {
        for (int64_t r = 0; r < n; ++r) ym[r] = from_f32<at::BFloat16>(_mm512_reduce_add_ps(acc[m][r]));
      }
    }
  }
}
#endif

#if defined(PDSERVE_AVX2)
// The AVX2 pass, for fp32 or bf16 (widened exactly) weights: 8 output rows at a time, each summed in 8 lanes over
// in_f (a multiple of 8) and reduced together by sum8; the x rows take turns over the block, which is read from
// memory once and from cache after. A partial block reduces zeros in the missing rows' places, so a row's sum
// is the same wherever the block boundaries fall.
template <typename T>
void gemv_band_avx2(const T* x, const T* w, int64_t rows, int64_t in_f, int64_t out_f, int64_t begin, int64_t end,
                    T* y) {
  for (int64_t o0 = begin; o0 < end; o0 += 8) {
    const int64_t n = std::min<int64_t>(8, end - o0);
    const T* wr[8];
    for (int64_t r = 0; r < 8; ++r) wr[r] = w + (o0 + std::min(r, n - 1)) * in_f;
    for (int64_t m = 0; m < rows; ++m) {
      const T* xm = x + m * in_f;
      __m256 acc[8];
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t c = 0; c < in_f; c += 8) {
        const __m256 xv = load8(xm + c);
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(xv, load8(wr[r] + c), acc[r]);
      }
      for (int64_t r = n; r < 8; ++r) acc[r] = _mm256_setzero_ps();
      const __m256 sums = sum8(acc);
      T* ym = y + m * out_f + o0;
      if (n == 8) {
        store8(ym, sums);
      } else {
        alignas(32) float part[8];
        _mm256_store_ps(part, sums);
        for (int64_t r = 0; r < n; ++r) ym[r] = from_f32<T>(part[r]);
      }
    }
  }
}
#endif

}  // namespace

bool gemv_supported(const at::Tensor& weight) {
  if (weight.dim() != 2 || !weight.is_contiguous()) return false;
#if defined(__AVX512BF16__)
  return weight.scalar_type() == at::kBFloat16 && weight.size(1) % 32 == 0;
#elif defined(PDSERVE_AVX2)
  return (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat) && weight.size(1) % 8 == 0;
#else
  return false;
#endif
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(gemv_supported(weight), "gemv needs a contiguous [out, in] weight this build has a path for "
              "(AVX512-BF16: bf16 with in % 32 == 0; AVX2: fp32 or bf16 with in % 8 == 0)");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && x.dim() == 2 && x.is_contiguous() &&
              x.size(1) == weight.size(1), "x must be contiguous [M, in] of the weight's dtype");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "gemv takes 1 to ", kMaxRows, " rows");
  const int64_t rows = x.size(0), in_f = weight.size(1), out_f = weight.size(0);
  at::Tensor y = at::empty({rows, out_f}, x.options());
#if defined(__AVX512BF16__)
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // Bands of whole 16-row blocks, so that how rows are split among threads never changes a result.
  const int64_t blocks = (out_f + 15) / 16;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    const int64_t begin = b0 * 16, end = std::min(out_f, b1 * 16);
    switch (rows) {
      case 1: gemv_band<1>(xp, wp, in_f, out_f, begin, end, yp); break;
      case 2: gemv_band<2>(xp, wp, in_f, out_f, begin, end, yp); break;
      case 3: gemv_band<3>(xp, wp, in_f, out_f, begin, end, yp); break;
      default: gemv_band<4>(xp, wp, in_f, out_f, begin, end, yp); break;
    }
  });
#elif defined(PDSERVE_AVX2)
  PDSERVE_DISPATCH(x.scalar_type(), [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const int64_t blocks = (out_f + 7) / 8;  // whole 8-row blocks per thread, as above
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
      gemv_band_avx2(xp, wp, rows, in_f, out_f, b0 * 8, std::min(out_f, b1 * 8), yp);
    });
  });
#endif
  return y;
}

}  // namespace pdserve
