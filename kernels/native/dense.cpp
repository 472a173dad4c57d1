// A dense layer whose every output is summed in one fixed order (contract: shared/linear.py, DenseLinear):
// y[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) (+ residual[m, n]), accumulated in fp32 in a vector lane of its own,
// from k = 0 up, one k at a time (one pair of k per VDPBF16PS where the CPU has AVX512-BF16). No sum is split
// across lanes, threads or blocks of k, so a row's bits depend only on the row and the weight: not on how many
// rows are computed with it, where the register tiles fall or how many threads share the work. That is the
// batch invariance deterministic mode promises, by construction; oneDNN picks its kernels, and with them its
// summation orders, by the number of rows and by the CPU (AMX tiles at some row counts). It also gives the LM
// head fp32 logits from bf16 weights and activations (`fp32_out`).
//
// The weight is packed once [N / 32][K / P][32][P], padded with zeros: P = 2 for bf16 on AVX512-BF16 (a pair of
// k per 32-bit lane, the operand VDPBF16PS takes), else 1. One k (or pair) of 32 channels is 64 or 128
// contiguous bytes, so a row's x[m, k], broadcast, meets 16 channels per instruction. A register tile is up to
// 8 rows x 32 channels (16 accumulators) on AVX-512 and 4 rows x 16 channels on AVX2; one decode row streams
// the weight once, and many rows reuse each block of it from cache.
#include "common.h"

#include <algorithm>
#include <vector>

namespace pdserve {

namespace {

constexpr int64_t kBlockN = 32;

// k of each 32-bit lane in the packed weight of this dtype (see above).
int64_t pair_of(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  return dtype == at::kBFloat16 ? 2 : 1;
#else
  (void)dtype;
  return 1;
#endif
}

// Channels [c, c + valid) of row m from their sums: + bias, + residual, rounded once to Out. The same adds, in
// the same order, as the vector epilogues below.
template <typename Out>
void store_tail(const float* sums, int64_t valid, int64_t m, int64_t c, int64_t n, const float* bias,
                const Out* res, int64_t rs, Out* y) {
  for (int64_t i = 0; i < valid; ++i) {
    float v = sums[i];
    if (bias) v += bias[c + i];
    if (res) v += to_f32(res[m * rs + c + i]);
    y[m * n + c + i] = from_f32<Out>(v);
  }
}

#if defined(PDSERVE_AVX512)
constexpr int kTileM = 8;

// Rows [m0, m0 + MT) x the kBlockN channels from o0 of one packed block wb.
template <int MT, typename T, typename Out>
void tile(const T* x, int64_t xs, int64_t k, const T* wb, int64_t m0, int64_t o0, int64_t n, const float* bias,
          const Out* res, int64_t rs, Out* y) {
  __m512 acc[MT][2];
  for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const T* xm = x + m0 * xs;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const int64_t pairs = k / 2;
    for (int64_t g = 0; g < pairs; ++g) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + g * 64);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + g * 64 + 32);
      for (int r = 0; r < MT; ++r) {
        int32_t two;
        std::memcpy(&two, xm + r * xs + 2 * g, sizeof(two));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(two);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      }
    }
    if (k % 2) {  // the last k alone; its pair partner is zero in the packed weight and here
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + pairs * 64);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + pairs * 64 + 32);
      for (int r = 0; r < MT; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(xm[r * xs + k - 1].x));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      }
    }
  } else
#endif
  {
    for (int64_t i = 0; i < k; ++i) {
      const __m512 w0 = load16(wb + i * kBlockN), w1 = load16(wb + i * kBlockN + 16);
      for (int r = 0; r < MT; ++r) {
        const __m512 xb = _mm512_set1_ps(to_f32(xm[r * xs + i]));
        acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < MT; ++r) {
    const int64_t m = m0 + r;
    for (int j = 0; j < 2; ++j) {
      const int64_t c = o0 + 16 * j;
      if (c >= n) break;
      const int64_t valid = std::min<int64_t>(16, n - c);
      if (valid == 16) {
        __m512 v = acc[r][j];
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c));
        if (res) v = _mm512_add_ps(v, load16(res + m * rs + c));
        store16(y + m * n + c, v);
      } else {
        alignas(64) float part[16];
        _mm512_store_ps(part, acc[r][j]);
        store_tail(part, valid, m, c, n, bias, res, rs, y);
      }
    }
  }
}

#elif defined(PDSERVE_AVX2)
constexpr int kTileM = 4;  // 8 accumulators, 2 weight vectors and a broadcast of AVX2's 16 registers

// Rows [m0, m0 + MT) x the 16 channels of half j of one packed block wb, which starts at channel o0.
template <int MT, typename T, typename Out>
void tile_half(const T* x, int64_t xs, int64_t k, const T* wb, int j, int64_t m0, int64_t o0, int64_t n,
               const float* bias, const Out* res, int64_t rs, Out* y) {
  __m256 acc[MT][2];
  for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const T* xm = x + m0 * xs;
  const T* wj = wb + 16 * j;
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = load8(wj + i * kBlockN), w1 = load8(wj + i * kBlockN + 8);
    for (int r = 0; r < MT; ++r) {
      const __m256 xb = _mm256_set1_ps(to_f32(xm[r * xs + i]));
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < MT; ++r) {
    const int64_t m = m0 + r;
    for (int h = 0; h < 2; ++h) {
      const int64_t c = o0 + 16 * j + 8 * h;
      if (c >= n) break;
      const int64_t valid = std::min<int64_t>(8, n - c);
      if (valid == 8) {
        __m256 v = acc[r][h];
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));
        if (res) v = _mm256_add_ps(v, load8(res + m * rs + c));
        store8(y + m * n + c, v);
      } else {
        alignas(32) float part[8];
        _mm256_store_ps(part, acc[r][h]);
        store_tail(part, valid, m, c, n, bias, res, rs, y);
      }
    }
  }
}

#else
// No vector path: one output at a time, the same order (k from 0 up, one product per step).
template <typename T, typename Out>
void block_scalar(const T* x, int64_t xs, int64_t k, const T* wb, int64_t m0, int64_t m1, int64_t o0, int64_t n,
                  const float* bias, const Out* res, int64_t rs, Out* y) {
  float sums[kBlockN];
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t l = 0; l < kBlockN; ++l) {
      float s = 0.0f;
      for (int64_t i = 0; i < k; ++i) s += to_f32(x[m * xs + i]) * to_f32(wb[i * kBlockN + l]);
      sums[l] = s;
    }
    store_tail(sums, std::min<int64_t>(kBlockN, n - o0), m, o0, n, bias, res, rs, y);
  }
}
#endif

}  // namespace

int64_t dense_pair(const at::Tensor& weight) { return pair_of(weight.scalar_type()); }

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& residual, bool fp32_out) {
  check_dtype(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t rows = x.size(0), k = x.size(1), p = pair_of(x.scalar_type());
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(2) == kBlockN && packed.size(3) == p && packed.size(0) * kBlockN >= n &&
                  packed.size(1) * p >= k && packed.size(1) * p < k + p,
              "packed must be this layer's [ceil(N / 32), ceil(K / ", p, "), 32, ", p, "] weight, of x's dtype");
  const int64_t padded_n = packed.size(0) * kBlockN;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 1 &&
                    bias->size(0) == padded_n, "bias must be a contiguous float32 vector of ", padded_n,
                " (padded to the packed channels)");
  }
  const at::ScalarType out_type = fp32_out ? at::kFloat : x.scalar_type();
  if (residual) {
    TORCH_CHECK(residual->scalar_type() == out_type && residual->dim() == 2 && residual->size(0) == rows &&
                    residual->size(1) == n && residual->stride(1) == 1,
                "residual must be [M, N] of the output's dtype with contiguous rows");
  }
  at::Tensor y = at::empty({rows, n}, x.options().dtype(out_type));
  if (rows == 0) return y;
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t blocks = packed.size(0), groups = packed.size(1), xs = x.stride(0);
  const int64_t rs = residual ? residual->stride(0) : 0;
  PDSERVE_DISPATCH(x.scalar_type(), [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    const T* wp = packed.data_ptr<T>();
    auto run = [&](auto* out_tag) {
      using Out = std::remove_pointer_t<decltype(out_tag)>;
      const Out* res = residual ? residual->data_ptr<Out>() : nullptr;
      Out* yp = y.data_ptr<Out>();
#if defined(PDSERVE_AVX512) || defined(PDSERVE_AVX2)
      // Rows in chunks whose x stays in L1/L2 while every block of a thread's band passes over them.
      const int64_t chunk = std::max<int64_t>(kTileM, (128 * 1024 / (k * int64_t(sizeof(T)))) / kTileM * kTileM);
#endif
      at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
#if defined(PDSERVE_AVX512) || defined(PDSERVE_AVX2)
        for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
          const int64_t c1 = std::min(rows, c0 + chunk);
          for (int64_t b = b0; b < b1; ++b) {
            const T* wb = wp + b * groups * kBlockN * p;
            for (int64_t m0 = c0; m0 < c1; m0 += kTileM) {
              dispatch_rows<kTileM>(std::min<int64_t>(kTileM, c1 - m0), [&](auto mt) {
#if defined(PDSERVE_AVX512)
                tile<decltype(mt)::value, T, Out>(xp, xs, k, wb, m0, b * kBlockN, n, bp, res, rs, yp);
#else
                for (int j = 0; j < 2 && b * kBlockN + 16 * j < n; ++j) {
                  tile_half<decltype(mt)::value, T, Out>(xp, xs, k, wb, j, m0, b * kBlockN, n, bp, res, rs, yp);
                }
#endif
              });
            }
          }
        }
#else
        for (int64_t b = b0; b < b1; ++b) {
          block_scalar<T, Out>(xp, xs, k, wp + b * groups * kBlockN, 0, rows, b * kBlockN, n, bp, res, rs, yp);
        }
#endif
      });
    };
    if (fp32_out) {
      run(static_cast<float*>(nullptr));
    } else {
      run(static_cast<T*>(nullptr));
    }
  });
  return y;
}

}  // namespace pdserve
