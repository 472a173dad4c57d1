// y = x W^T for a few rows of x (contract: shared/linear.py): the decode step of one or two sequences, which
// only streams the weights once. One pass over W's rows in order, 32 bf16 products per AVX512-BF16 instruction,
// 16 output rows reduced together; each thread takes a contiguous band of rows, so W is read as a stream.
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

}  // namespace

bool gemv_supported(const at::Tensor& weight) {
#if defined(__AVX512BF16__)
  return weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous() &&
         weight.size(1) % 32 == 0;
#else
  (void)weight;
  return false;
#endif
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(gemv_supported(weight), "gemv needs a contiguous bf16 [out, in] weight with in % 32 == 0 and "
              "a CPU with AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous() && x.size(1) == weight.size(1),
              "x must be contiguous bf16 [M, in]");
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
#endif
  return y;
}

}  // namespace pdserve
