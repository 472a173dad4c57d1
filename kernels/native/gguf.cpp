// A matmul over a GGUF file's own quantized weight blocks (contract: shared/gguf_linear.py): each block of 32
// weights is widened to fp32 in registers and multiplied with fp32 activations, so the weight is read from
// memory at its stored width (Q4_0 0.56, Q4_1 0.625, Q8_0 1.06 bytes a weight) and never expanded in memory.
// Blocks as ggml lays them out, a row of the weight [N, K] being K / 32 blocks:
//   Q4_0 {fp16 d; u8 qs[16]}         w[j] = d * ((qs[j] & 15) - 8), w[j + 16] = d * ((qs[j] >> 4) - 8)
//   Q4_1 {fp16 d; fp16 m; u8 qs[16]} w[j] = d * (qs[j] & 15) + m,   w[j + 16] = d * (qs[j] >> 4) + m
//   Q8_0 {fp16 d; i8 qs[32]}         w[j] = d * qs[j]
// Rows of x are taken MB at a time against NB weight rows, so a step of a few rows reads each block once and
// keeps enough independent sums in flight to run at the memory's speed rather than the adder's latency.
#include "common.h"

#include <c10/util/Half.h>

#include <vector>

namespace pdserve {

namespace {

constexpr int QK = 32;
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids

constexpr int64_t block_bytes(int64_t type) { return type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34; }

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// One block into 32 floats, in the order of its weights.
template <int64_t T> inline void dequant_scalar(const uint8_t* b, float* w) {
  const float d = half_at(b);
  if constexpr (T == Q8_0) {
    for (int j = 0; j < QK; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
  } else {
    const float m = T == Q4_1 ? half_at(b + 2) : -8.0f * d;
    const uint8_t* qs = b + (T == Q4_1 ? 4 : 2);
    for (int j = 0; j < QK / 2; ++j) {
      w[j] = d * static_cast<float>(qs[j] & 15) + m;
      w[j + QK / 2] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
}

// The vector width of a build: L lanes, a block being QK / L vectors.
#if defined(PDSERVE_AVX512)
struct Vec {
  using T = __m512;
  static constexpr int L = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(T a) { return _mm512_reduce_add_ps(a); }
  template <int64_t Q> static void dequant(const uint8_t* b, T* w) {
    const __m512 d = _mm512_set1_ps(half_at(b));
    if constexpr (Q == Q8_0) {
      for (int j = 0; j < 2; ++j) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * j));
        w[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
      }
    } else {
      const __m512 m = _mm512_set1_ps(Q == Q4_1 ? half_at(b + 2) : -8.0f * half_at(b));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Q == Q4_1 ? 4 : 2)));
      const __m128i low = _mm_set1_epi8(15);
      w[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low))), m);
      w[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low))), m);
    }
  }
};
#elif defined(PDSERVE_AVX2)
struct Vec {
  using T = __m256;
  static constexpr int L = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(T a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static __m256 widen(__m128i bytes8, bool is_signed) {  // the low 8 bytes
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
  }
  template <int64_t Q> static void dequant(const uint8_t* b, T* w) {
    const __m256 d = _mm256_set1_ps(half_at(b));
    if constexpr (Q == Q8_0) {
      for (int j = 0; j < 4; ++j) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j));
        w[j] = _mm256_mul_ps(d, widen(q, true));
      }
    } else {
      const __m256 m = _mm256_set1_ps(Q == Q4_1 ? half_at(b + 2) : -8.0f * half_at(b));
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (Q == Q4_1 ? 4 : 2)));
      const __m128i low = _mm_set1_epi8(15);
      const __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
      w[0] = _mm256_fmadd_ps(d, widen(lo, false), m);
      w[1] = _mm256_fmadd_ps(d, widen(_mm_srli_si128(lo, 8), false), m);
      w[2] = _mm256_fmadd_ps(d, widen(hi, false), m);
      w[3] = _mm256_fmadd_ps(d, widen(_mm_srli_si128(hi, 8), false), m);
    }
  }
};
#else
struct Vec {  // any CPU: one lane, the loops left to the compiler
  using T = float;
  static constexpr int L = 1;
  static T zero() { return 0.0f; }
  static T load(const float* p) { return *p; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static float sum(T a) { return a; }
  template <int64_t Q> static void dequant(const uint8_t* b, T* w) { dequant_scalar<Q>(b, w); }
};
#endif

constexpr int J = QK / Vec::L;  // vectors per block

// Rows [m0, m0 + MB) of x against weight rows [n0, n0 + NB): out[m][n] = x[m] . w[n] (fp32, before the epilogue).
template <int64_t Q, int MB, int NB>
void tile(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, float* sums /* [MB][NB] */) {
  typename Vec::T acc[MB][NB][J];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n)
      for (int j = 0; j < J; ++j) acc[m][n][j] = Vec::zero();
  const int64_t bb = block_bytes(Q);
  for (int64_t kb = 0; kb < k / QK; ++kb) {
    for (int n = 0; n < NB; ++n) {
      typename Vec::T wv[J];
      Vec::template dequant<Q>(w + n * row_bytes + kb * bb, wv);
      for (int m = 0; m < MB; ++m)
        for (int j = 0; j < J; ++j)
          acc[m][n][j] = Vec::fma(wv[j], Vec::load(x + m * k + kb * QK + j * Vec::L), acc[m][n][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      typename Vec::T s = acc[m][n][0];
      for (int j = 1; j < J; ++j) s = s + acc[m][n][j];
      sums[m * NB + n] = Vec::sum(s);
    }
}

// Rows: as many as MB at a time, then what is left one size down.
template <int64_t Q, int NB>
void rows(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t row_bytes, float* sums /* [m][NB] */) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) tile<Q, 4, NB>(x + r * k, k, w, row_bytes, sums + r * NB);
  for (; r + 2 <= m; r += 2) tile<Q, 2, NB>(x + r * k, k, w, row_bytes, sums + r * NB);
  for (; r < m; ++r) tile<Q, 1, NB>(x + r * k, k, w, row_bytes, sums + r * NB);
}

template <int64_t Q, typename Out>
void linear(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, const float* bias,
            const Out* residual, Out* out) {
  constexpr int NB = 2;  // weight rows per pass: two rows' sums in flight per row of x
  constexpr int64_t MC = 8;  // rows of x per sweep over the weight rows: their fp32 copy stays in the near cache
  const int64_t row_bytes = k / QK * block_bytes(Q);
  at::parallel_for(0, (n + NB - 1) / NB, 16, [&](int64_t g0, int64_t g1) {
    float sums[MC * NB];
    for (int64_t r0 = 0; r0 < m; r0 += MC) {
      const int64_t mc = std::min(MC, m - r0);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n0 = g * NB, nb = std::min<int64_t>(NB, n - n0);
        if (nb == NB) {
          rows<Q, NB>(x + r0 * k, mc, k, w + n0 * row_bytes, row_bytes, sums);
        } else {
          rows<Q, 1>(x + r0 * k, mc, k, w + n0 * row_bytes, row_bytes, sums);
        }
        for (int64_t r = r0; r < r0 + mc; ++r)
          for (int64_t j = 0; j < nb; ++j) {
            float v = sums[(r - r0) * nb + j] + (bias ? bias[n0 + j] : 0.0f);
            if (residual) v += to_f32(residual[r * n + n0 + j]);
            out[r * n + n0 + j] = from_f32<Out>(v);
          }
      }
    }
  });
}

template <int64_t Q, typename Out> void dequantize_rows(const uint8_t* w, int64_t n, int64_t k, Out* out) {
  const int64_t row_bytes = k / QK * block_bytes(Q);
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    float block[QK];
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t kb = 0; kb < k / QK; ++kb) {
        dequant_scalar<Q>(w + r * row_bytes + kb * block_bytes(Q), block);
        for (int j = 0; j < QK; ++j) out[r * k + kb * QK + j] = from_f32<Out>(block[j]);
      }
  });
}

void check(const at::Tensor& blocks, int64_t type, int64_t k) {
  TORCH_CHECK(type == Q4_0 || type == Q4_1 || type == Q8_0, "gguf: unsupported block type ", type);
  TORCH_CHECK(k % QK == 0, "gguf: the input width ", k, " is not a whole number of blocks");
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
              blocks.size(1) == k / QK * block_bytes(type), "gguf: blocks must be a contiguous uint8 [N, K / 32 * ",
              block_bytes(type), "]");
}

template <typename F> void by_type(int64_t type, F&& f) {
  if (type == Q4_0) f(std::integral_constant<int64_t, Q4_0>{});
  else if (type == Q4_1) f(std::integral_constant<int64_t, Q4_1>{});
  else f(std::integral_constant<int64_t, Q8_0>{});
}

}  // namespace

// x [M, K] fp32 or bf16; blocks [N, K / 32 * block bytes] -> [M, N] in x's dtype (fp32 with fp32_output),
// plus bias [N] (fp32) and residual [M, N] (the output's dtype) when given.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t k,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                       bool fp32_output) {
  check(blocks, type, k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "gguf_linear: x must be [M, ", k, "]");
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), n = blocks.size(0);
  at::Tensor out = at::empty({m, n}, x.options().dtype(fp32_output ? at::kFloat : x.scalar_type()));
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (residual.has_value()) TORCH_CHECK(residual->sizes() == out.sizes() && residual->dtype() == out.dtype() &&
                                        residual->is_contiguous(), "gguf_linear: residual must be like the output");
  by_type(type, [&](auto q) {
    if (out.scalar_type() == at::kFloat) {
      linear<decltype(q)::value, float>(x32.data_ptr<float>(), m, k, blocks.data_ptr<uint8_t>(), n, b,
                             residual.has_value() ? residual->data_ptr<float>() : nullptr, out.data_ptr<float>());
    } else {
      TORCH_CHECK(out.scalar_type() == at::kBFloat16, "gguf_linear: x must be float32 or bfloat16");
      linear<decltype(q)::value, at::BFloat16>(x32.data_ptr<float>(), m, k, blocks.data_ptr<uint8_t>(), n, b,
                                    residual.has_value() ? residual->data_ptr<at::BFloat16>() : nullptr,
                                    out.data_ptr<at::BFloat16>());
    }
  });
  return out;
}

// blocks [N, K / 32 * block bytes] -> the weight [N, K] in `dtype` (fp32 or bf16), each weight computed as
// gguf_linear's registers hold it.
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t k, at::ScalarType dtype) {
  check(blocks, type, k);
  at::Tensor out = at::empty({blocks.size(0), k}, blocks.options().dtype(dtype));
  by_type(type, [&](auto q) {
    if (dtype == at::kFloat) {
      dequantize_rows<decltype(q)::value, float>(blocks.data_ptr<uint8_t>(), blocks.size(0), k, out.data_ptr<float>());
    } else {
      TORCH_CHECK(dtype == at::kBFloat16, "gguf_dequantize: dtype must be float32 or bfloat16");
      dequantize_rows<decltype(q)::value, at::BFloat16>(blocks.data_ptr<uint8_t>(), blocks.size(0), k,
                                             out.data_ptr<at::BFloat16>());
    }
  });
  return out;
}

}  // namespace pdserve
