// The sampler's row sums (contract: shared/sampler.py, row_sums): out[r] = sum_v x[r, v] in fp32, each row in one
// fixed order (16 or 8 lanes over v from 0 up, then one fixed tree across the lanes) and by one thread. torch's
// sum splits a single row across threads, so a row's logprobs would change with the number of rows beside it:
// deterministic mode promises they do not.
#include "common.h"

namespace pdserve {

at::Tensor row_sums(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "x must be a float32 CPU [R, V] with contiguous rows");
  const int64_t rows = x.size(0), width = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * xs;
      int64_t v = 0;
      float sum = 0.0f;
#if defined(PDSERVE_AVX512)
      __m512 acc = _mm512_setzero_ps();
      for (; v + 16 <= width; v += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(row + v));
      sum = _mm512_reduce_add_ps(acc);
#elif defined(PDSERVE_AVX2)
      __m256 acc = _mm256_setzero_ps();
      for (; v + 8 <= width; v += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(row + v));
      sum = hsum8(acc);
#endif
      for (; v < width; ++v) sum += row[v];
      op[r] = sum;
    }
  });
  return out;
}

}  // namespace pdserve
