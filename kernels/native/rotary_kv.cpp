// Rotary embedding of q and k fused with the KV-cache store (contract: kernels/rotary.py `rotary_store_kv`).
// One pass over the fused qkv projection: q heads are rotated into a new [T, Hq, D] tensor, k heads are
// rotated straight into their cache slots and v heads copied there, so K never exists outside the cache.
#include "common.h"

namespace pdserve {

namespace {

// out = (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves of one head, in fp32, rounded once.
template <typename T>
inline void rotate_head(const T* x, const float* cos, const float* sin, int64_t half, T* out) {
  int64_t i = 0;
#if defined(PDSERVE_AVX2)
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = load8(x + i), x2 = load8(x + i + half);
    const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
    store8(out + i, _mm256_fmsub_ps(x1, c, _mm256_mul_ps(x2, s)));
    store8(out + i + half, _mm256_fmadd_ps(x2, c, _mm256_mul_ps(x1, s)));
  }
#endif
  const int64_t done = i;
#pragma omp simd
  for (int64_t j = done; j < half; ++j) {
    const float x1 = to_f32(x[j]), x2 = to_f32(x[j + half]);
    out[j] = from_f32<T>(x1 * cos[j] - x2 * sin[j]);
    out[j + half] = from_f32<T>(x2 * cos[j] + x1 * sin[j]);
  }
}

template <typename T>
void rotary_store_rows(const at::Tensor& qkv, const at::Tensor& cos_sin, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads, at::Tensor& q_out) {
  const int64_t tokens = qkv.size(0), head_dim = q_out.size(2), half = head_dim / 2;
  const int64_t page_size = k_cache.size(1);
  const T* src = qkv.data_ptr<T>();
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  T* q = q_out.data_ptr<T>();
  const int64_t qkv_stride = qkv.stride(0), cs_stride = cos_sin.stride(0);
  const int64_t kp = k_cache.stride(0), ks = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vp = v_cache.stride(0), vs = v_cache.stride(1), vh = v_cache.stride(2);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = src + t * qkv_stride;
      const float* cos = cs + t * cs_stride;
      const float* sin = cos + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        rotate_head(row + h * head_dim, cos, sin, half, q + (t * num_heads + h) * head_dim);
      }
      const int64_t page = slot[t] / page_size, offset = slot[t] % page_size;
      T* k_dst = kc + page * kp + offset * ks;
      T* v_dst = vc + page * vp + offset * vs;
      const T* k_src = row + num_heads * head_dim;
      const T* v_src = k_src + num_kv_heads * head_dim;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        rotate_head(k_src + h * head_dim, cos, sin, half, k_dst + h * kh);
        std::memcpy(v_dst + h * vh, v_src + h * head_dim, head_dim * sizeof(T));
      }
    }
  });
}

}  // namespace

at::Tensor rotary_store_kv(const at::Tensor& qkv, const at::Tensor& cos_sin, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads) {
  check_dtype(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [T, (Hq + 2 Hk) * D] with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == qkv.scalar_type() &&
                  v_cache.scalar_type() == qkv.scalar_type(), "caches must be [P, S, Hk, D] of qkv's dtype");
  const int64_t head_dim = k_cache.size(3);
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "caches must be contiguous in head_dim");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache must have the same shape");
  TORCH_CHECK(k_cache.size(2) == num_kv_heads, "the caches hold ", k_cache.size(2), " kv heads, not ",
              num_kv_heads);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim && head_dim % 2 == 0,
              "qkv width does not match the head counts");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.stride(1) == 1 && cos_sin.size(0) == qkv.size(0) &&
              cos_sin.size(1) == head_dim, "cos_sin must be fp32 [T, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == qkv.size(0),
              "slots must be int64 [T]");
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "slot ", slot[t], " is outside the cache of ", capacity,
                " slots");
  }
  at::Tensor q = at::empty({qkv.size(0), num_heads, head_dim}, qkv.options());
  PDSERVE_DISPATCH(qkv.scalar_type(), [&] {
    rotary_store_rows<scalar_t>(qkv, cos_sin, k_cache, v_cache, slots, num_heads, num_kv_heads, q);
  });
  return q;
}

}  // namespace pdserve
