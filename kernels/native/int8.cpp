// Per-row int8 quantization of activations and the dequantizing epilogue of an int8 matmul
// (contract: kernels/int8_matmul.py). Both are one pass over their rows, so the int8 matmul between them is
// the only full-size work: torch's versions take four to six passes each.
#include "common.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

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


// ---------------------------------------------------------------------------------------------------------------
// The whole w8a8 layer in one call where the CPU has AVX512-VNNI (contract: shared/int8_linear.py): the rows of x
// are quantized as quantize_rows does (the same codes), shifted to unsigned (u = q + 128, the operand
// VPDPBUSD multiplies with signed weights), multiplied with the packed weight, and dequantized as
// dequantize_rows does, `128 * sum_k w[n, k]` taken back out of each integer sum first, so every sum equals
// oneDNN's s8 x s8 one and the outputs equal the two-pass path's. Weights are packed [N / 32][K / 4][32][4]: one
// 64-byte vector holds four consecutive k of 16 output channels, so a row's four codes, broadcast, meet 16
// channels per instruction and no sum is reduced across lanes. A register tile is up to 8 rows x 32 channels (16
// accumulators); one decode row streams the weight once, and many rows reuse each block of it from cache.
// AVX2 builds have a path of their own below, with the same integer sums.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PDSERVE_INT8_VNNI 1
#endif

namespace {

#if defined(PDSERVE_INT8_VNNI) || defined(PDSERVE_AVX2)
constexpr int64_t kBlockN = 32;

// Channels [c, c + valid) of row m from their integer sums (128 sum w already taken out), as dequantize_rows
// computes a row's tail: no fused multiply-add, so both paths round alike.
template <typename T>
void store_tail(const int32_t* sums, int64_t valid, int64_t m, int64_t c, int64_t n, const float* scale,
                const float* zero, const float* cs, const float* csum, const float* bias, const T* res, int64_t rs,
                T* y) {
  for (int64_t i = 0; i < valid; ++i) {
    float v = static_cast<float>(sums[i]) * scale[m] * cs[c + i] + zero[m] * csum[c + i];
    if (bias) v += bias[c + i];
    if (res) v += to_f32(res[m * rs + c + i]);
    y[m * n + c + i] = from_f32<T>(v);
  }
}

#endif

#if defined(PDSERVE_INT8_VNNI)
constexpr int kVecs = kBlockN / 16;
constexpr int kTileM = 8;

// Rows [m0, m0 + MT) x one block of kBlockN channels: the integer sums in registers, then out = (acc - 128 sum w)
// * scale * col_scale + zero * col_sum (+ bias) (+ residual), as dequantize_rows computes it, rounded once to T.
template <int MT, typename T>
void vnni_tile(const uint8_t* u, int64_t ku, const int8_t* wb, int64_t groups, int64_t m0, int64_t o0, int64_t n,
               const float* scale, const float* zero, const int32_t* sum128, const float* cs, const float* csum,
               const float* bias, const T* res, int64_t rs, T* y) {
  __m512i acc[MT][kVecs];
  for (int r = 0; r < MT; ++r) {
    for (int j = 0; j < kVecs; ++j) acc[r][j] = _mm512_setzero_si512();
  }
  const uint8_t* um = u + m0 * ku;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[kVecs];
    for (int j = 0; j < kVecs; ++j) w[j] = _mm512_loadu_si512(wb + (g * kVecs + j) * 64);
    for (int r = 0; r < MT; ++r) {
      int32_t four;
      std::memcpy(&four, um + r * ku + 4 * g, sizeof(four));
      const __m512i xb = _mm512_set1_epi32(four);
      for (int j = 0; j < kVecs; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xb, w[j]);
    }
  }
  for (int r = 0; r < MT; ++r) {
    const int64_t m = m0 + r;
    const __m512 vs = _mm512_set1_ps(scale[m]), vz = _mm512_set1_ps(zero[m]);
    for (int j = 0; j < kVecs; ++j) {
      const int64_t c = o0 + 16 * j;
      if (c >= n) break;
      const __m512i sums = _mm512_sub_epi32(acc[r][j], _mm512_loadu_si512(sum128 + c));
      const int64_t valid = std::min<int64_t>(16, n - c);
      if (valid == 16) {
        __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), vs), _mm512_loadu_ps(cs + c),
                                   _mm512_mul_ps(vz, _mm512_loadu_ps(csum + c)));
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c));
        if (res) v = _mm512_add_ps(v, load16(res + m * rs + c));
        store16(y + m * n + c, v);
      } else {
        alignas(64) int32_t part[16];
        _mm512_store_si512(part, sums);
        store_tail(part, valid, m, c, n, scale, zero, cs, csum, bias, res, rs, y);
      }
    }
  }
}
#endif

#if defined(PDSERVE_AVX2)
constexpr int kTileM = 4;  // 8 accumulators, 2 weight vectors and a broadcast of AVX2's 16 registers

// Without VNNI (AVX2: AMD up to Zen 3, Intel before Ice Lake) the same packed weight and the same integer sums, from
// VPMADDWD on 16-bit operands (VPMADDUBSW's 8-bit products would saturate at 255 x 127 x 2): the codes of a row
// are widened to int16 once, four of them broadcast meet 4 channels x 4 k (16 weights widened as they load), and
// each channel's two partial sums are added at the end. Rows [m0, m0 + MT) x channels [c, c + 8) of a block.
template <int MT, typename T>
void avx2_tile(const int16_t* u16, int64_t ku, const int8_t* wb, int64_t groups, int64_t m0, int64_t c, int64_t n,
               int j, const float* scale, const float* zero, const int32_t* sum128, const float* cs,
               const float* csum, const float* bias, const T* res, int64_t rs, T* y) {
  __m256i acc[MT][2];
  for (int r = 0; r < MT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const int16_t* um = u16 + m0 * ku;
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w = wb + g * kBlockN * 4 + j * 32;
    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
    for (int r = 0; r < MT; ++r) {
      int64_t four;
      std::memcpy(&four, um + r * ku + 4 * g, sizeof(four));
      const __m256i xb = _mm256_set1_epi64x(four);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(xb, lo));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(xb, hi));
    }
  }
  // hadd leaves channels in the order 0 1 4 5 2 3 6 7; the permutation puts them back.
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  const int64_t valid = std::min<int64_t>(8, n - c);
  for (int r = 0; r < MT; ++r) {
    const int64_t m = m0 + r;
    const __m256i sums = _mm256_sub_epi32(_mm256_permutevar8x32_epi32(_mm256_hadd_epi32(acc[r][0], acc[r][1]), order),
                                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sum128 + c)));
    if (valid == 8) {  // as dequantize_rows computes it on this build (no fused multiply-add)
      const __m256 va = _mm256_cvtepi32_ps(sums);
      __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(va, _mm256_set1_ps(scale[m])), _mm256_loadu_ps(cs + c)),
                               _mm256_mul_ps(_mm256_set1_ps(zero[m]), _mm256_loadu_ps(csum + c)));
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + c));
      if (res) v = _mm256_add_ps(v, load8(res + m * rs + c));
      store8(y + m * n + c, v);
    } else {
      alignas(32) int32_t part[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(part), sums);
      store_tail(part, valid, m, c, n, scale, zero, cs, csum, bias, res, rs, y);
    }
  }
}
#endif

}  // namespace

bool int8_linear_supported() {
#if defined(PDSERVE_INT8_VNNI) || defined(PDSERVE_AVX2)
  return true;
#else
  return false;
#endif
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& col_scale,
                       const at::Tensor& col_sum, const at::Tensor& sum128, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& inv_smooth) {
#if defined(PDSERVE_INT8_VNNI) || defined(PDSERVE_AVX2)
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.stride(1) == 1, "x must be a float32 or bfloat16 CPU [M, K] with contiguous rows");
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(2) == kBlockN && packed.size(3) == 4 && packed.size(0) * kBlockN >= n &&
                  packed.size(1) * 4 >= x.size(1) && packed.size(1) * 4 < x.size(1) + 4,
              "packed must be the int8 [ceil(N / 32), ceil(K / 4), 32, 4] weight of this layer");
  const int64_t rows = x.size(0), k = x.size(1), groups = packed.size(1), ku = groups * 4;
  const int64_t padded_n = packed.size(0) * kBlockN;
  auto check_vec = [](const at::Tensor& t, at::ScalarType type, int64_t size, const char* name) {
    TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.dim() == 1 && t.size(0) == size, name,
                " must be a contiguous vector of ", size, " (padded to the packed channels)");
  };
  check_vec(col_scale, at::kFloat, padded_n, "col_scale");
  check_vec(col_sum, at::kFloat, padded_n, "col_sum");
  check_vec(sum128, at::kInt, padded_n, "sum128");
  if (bias) check_vec(*bias, at::kFloat, padded_n, "bias");
  if (inv_smooth) check_vec(*inv_smooth, at::kFloat, k, "inv_smooth");
  if (residual) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->dim() == 2 && residual->size(0) == rows &&
                    residual->size(1) == n && residual->stride(1) == 1,
                "residual must be [M, N] of x's dtype with contiguous rows");
  }
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  // Quantize: q as quantize_rows makes it, then the code u = q + 128 the multiply takes (VPDPBUSD's unsigned
  // operand, or int16 for VPMADDWD); the padding columns stay 0.
#if defined(PDSERVE_INT8_VNNI)
  using code_t = uint8_t;
#else
  using code_t = int16_t;
#endif
  at::Tensor u = at::zeros({rows, ku}, x.options().dtype(sizeof(code_t) == 1 ? at::kByte : at::kShort));
  at::Tensor scale = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor zero = at::empty({rows}, x.options().dtype(at::kFloat));
  code_t* up = u.data_ptr<code_t>();
  float *sp = scale.data_ptr<float>(), *zp = zero.data_ptr<float>();
  const float* smooth = inv_smooth ? inv_smooth->data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0);
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(is_bf16 ? k : 0);
    std::vector<int8_t> q(k);
    for (int64_t t = begin; t < end; ++t) {
      const float* row;
      if (is_bf16) {
        const at::BFloat16* xb = x.data_ptr<at::BFloat16>() + t * xs;
        for (int64_t i = 0; i < k; ++i) wide[i] = to_f32(xb[i]);
        row = wide.data();
      } else {
        row = x.data_ptr<float>() + t * xs;
      }
      quantize_row(row, smooth, k, q.data(), sp + t, zp + t);
      code_t* ut = up + t * ku;
      for (int64_t i = 0; i < k; ++i) ut[i] = static_cast<code_t>(q[i] + 128);
    }
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* s128 = sum128.data_ptr<int32_t>();
  const float *cs = col_scale.data_ptr<float>(), *csum = col_sum.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t blocks = packed.size(0), rs = residual ? residual->stride(0) : 0;
  // Rows in chunks small enough that a chunk's codes stay in L1/L2 while every block of the band passes over them.
  const int64_t chunk = std::max<int64_t>(kTileM, (32 * 1024 / (ku * sizeof(code_t))) / kTileM * kTileM);
  PDSERVE_DISPATCH(x.scalar_type(), [&] {
    const scalar_t* res = residual ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
        const int64_t c1 = std::min(rows, c0 + chunk);
        for (int64_t b = b0; b < b1; ++b) {
          const int8_t* wb = wp + b * groups * kBlockN * 4;
          for (int64_t m0 = c0; m0 < c1; m0 += kTileM) {
#if defined(PDSERVE_INT8_VNNI)
            dispatch_rows<kTileM>(std::min<int64_t>(kTileM, c1 - m0), [&](auto mt) {
              vnni_tile<decltype(mt)::value, scalar_t>(up, ku, wb, groups, m0, b * kBlockN, n, sp, zp, s128, cs,
                                                       csum, bp, res, rs, yp);
            });
#else
            for (int j = 0; j < kBlockN / 8 && b * kBlockN + 8 * j < n; ++j) {
              dispatch_rows<kTileM>(std::min<int64_t>(kTileM, c1 - m0), [&](auto mt) {
                avx2_tile<decltype(mt)::value, scalar_t>(up, ku, wb, groups, m0, b * kBlockN + 8 * j, n, j, sp, zp,
                                                         s128, cs, csum, bp, res, rs, yp);
              });
            }
#endif
          }
        }
      }
    });
  });
  return y;
#else
  TORCH_CHECK(false, "int8_linear needs a build with AVX512-VNNI or AVX2 (int8_linear_supported() is false here)");
  return x;
#endif
}

}  // namespace pdserve
