// Shared helpers of the native CPU kernels: scalar conversions the compiler vectorizes, a vectorizable
// exp, and the dtype dispatch. Every kernel computes in fp32 and rounds once to the storage dtype, as the
// torch twins do.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

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
