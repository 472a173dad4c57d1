// Shared helpers of the native CPU kernels: scalar conversions the compiler vectorizes, a vectorizable
// exp, and the dtype dispatch. Every kernel computes in fp32 and rounds once to the storage dtype, as the
// torch twins do.
// A guard, not #pragma once: the build includes a copy of this header first, precompiled (__init__.py), and the
// guard is what keeps the sources' own #include of it from defining everything a second time.
#ifndef PDSERVE_NATIVE_COMMON_H
#define PDSERVE_NATIVE_COMMON_H

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The vector paths a build has, widest first: AVX-512 (with AVX512-BF16 dot products where present), else AVX2
// with FMA (x86-64-v3: every x86 server CPU since 2013, AMD's up to Zen 3 among them), else what the compiler
// makes of the scalar loops. Each op's paths compute the same contract in the same order per row.
#if defined(__AVX512F__)
#define PDSERVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_AVX2 1
#endif

namespace pdserve {

inline float to_f32(float x) { return x; }

inline float to_f32(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }

// Round to nearest even, as torch's float -> bfloat16 conversion does (finite inputs).
template <> inline at::BFloat16 from_f32<at::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  at::BFloat16 out;
  out.x = static_cast<uint16_t>(bits >> 16);
  return out;
}

// e^x for x <= 0 (softmax after subtracting the row max): range reduction to 2^n * e^r with |r| <= ln2/2 and
// a degree-6 polynomial (relative error ~1e-7). Branch-free so loops over it vectorize, and bit-identical
// whatever the batch, which the deterministic mode relies on.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t exponent = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// 16 lanes at a time: loads widen bf16 to fp32 exactly; stores round to nearest even, as from_f32 does.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(at::BFloat16* p, __m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
// x rounded to T's precision and widened back (identity for float).
inline __m512 round_to(float*, __m512 x) { return x; }
inline __m512 round_to(at::BFloat16*, __m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// exp_nonpositive over 16 lanes, the same steps as the scalar version.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                        _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Sums of each of 16 vectors, in order: a fixed tree of lane shuffles and adds (about 3 instructions per
// vector instead of 8 for a horizontal sum each).
inline __m512 sum16(const __m512* v) {
  __m512 c[8], d[4], e[2];
  for (int j = 0; j < 8; ++j) {  // [a 8 partials | b 8 partials]
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  }
  for (int j = 0; j < 4; ++j) {  // one token's 4 partials per 128-bit lane
    d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
  }
  for (int j = 0; j < 2; ++j) {  // lane L: tokens L and L + 4 of the pair, 2 partials each
    e[j] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * j], d[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(d[2 * j], d[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // lane L: tokens L, L + 4, L + 8, L + 12; then back to token order.
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}
#endif

#if defined(PDSERVE_AVX2)
// 8 lanes at a time, as load16/store16 above: bf16 widens exactly, stores round to nearest even.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// The bf16 bits of x (rounded to nearest even) in the high halves of its 32-bit lanes, the low halves zero.
inline __m256i round_bits8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
}
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(at::BFloat16* p, __m256 x) {
  const __m256i hi = _mm256_srli_epi32(round_bits8(x), 16);
  // packus works within 128-bit lanes: words 0-3 and 4-7 land in qwords 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline __m256 round_to(float*, __m256 x) { return x; }
inline __m256 round_to(at::BFloat16*, __m256 x) { return _mm256_castsi256_ps(round_bits8(x)); }

// exp_nonpositive over 8 lanes, the same steps as the scalar version.
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lane i: the sum of v[i]'s 8 lanes, by a fixed tree of horizontal adds (the same for every lane, so a sum
// does not depend on which other vectors it is reduced with).
inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
// The sum of x's 8 lanes, in sum8's order.
inline float hsum8(__m256 x) {
  const __m256 z = _mm256_setzero_ps();
  const __m256 v[8] = {x, z, z, z, z, z, z, z};
  return _mm_cvtss_f32(_mm256_castps256_ps128(sum8(v)));
}
#endif

// f(std::integral_constant<int, rows>()) for 1 <= rows <= MT: each tile height its own unrolled code.
template <int MT, typename F>
void dispatch_rows(int64_t rows, F&& f) {
  if constexpr (MT > 1) {
    if (rows < MT) return dispatch_rows<MT - 1>(rows, f);
  }
  f(std::integral_constant<int, MT>());
}

inline void check_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              name, " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

}  // namespace pdserve

// Runs the body with scalar_t bound to float or at::BFloat16.
#define PDSERVE_DISPATCH(dtype, ...)                                              \
  [&] {                                                                           \
    if ((dtype) == at::kBFloat16) {                                               \
      using scalar_t = at::BFloat16;                                              \
      return __VA_ARGS__();                                                       \
    }                                                                             \
    using scalar_t = float;                                                       \
    return __VA_ARGS__();                                                         \
  }()

#endif  // PDSERVE_NATIVE_COMMON_H
