// Grammar token mask (contract: kernels/token_mask.py): tokens whose bit is clear become -inf, in place.
// One 32-bit word covers 32 tokens, so an all-ones word (the common case inside free text) is skipped whole.
#include <limits>
#include <type_traits>

#include "common.h"

namespace pdserve {

namespace {

template <typename T>
void mask_rows(at::Tensor& logits, const at::Tensor& bitmask) {
  const int64_t rows = logits.size(0), vocab = logits.size(1), ls = logits.stride(0), ms = bitmask.stride(0);
  const int64_t words = (vocab + 31) / 32;
  T* lp = logits.data_ptr<T>();
  const int32_t* mp = bitmask.data_ptr<int32_t>();
  const T minus_inf = from_f32<T>(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = lp + r * ls;
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(mp + r * ms);
      int64_t w = 0;
#if defined(__AVX512BW__)
      // A word's banned bits are the store mask of one 32-lane (bf16) or two 16-lane (fp32) masked stores.
      for (; (w + 1) * 32 <= vocab; ++w) {
        const uint32_t banned = ~mask[w];
        if (banned == 0) continue;
        T* out = row + w * 32;
        if constexpr (std::is_same_v<T, float>) {
          const __m512 inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          _mm512_mask_storeu_ps(out, static_cast<__mmask16>(banned), inf);
          _mm512_mask_storeu_ps(out + 16, static_cast<__mmask16>(banned >> 16), inf);
        } else {
          const __m512i inf = _mm512_set1_epi16(static_cast<int16_t>(0xFF80));  // bf16 -inf
          _mm512_mask_storeu_epi16(out, static_cast<__mmask32>(banned), inf);
        }
      }
#elif defined(PDSERVE_AVX2)
      // A word's banned bits become lane masks (bit i of the word: lane i) for blends of -inf into the row.
      const __m256i bit32 = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
      const __m256i bit16 = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                              16384, static_cast<int16_t>(0x8000));
      for (; (w + 1) * 32 <= vocab; ++w) {
        const uint32_t banned = ~mask[w];
        if (banned == 0) continue;
        T* out = row + w * 32;
        if constexpr (std::is_same_v<T, float>) {
          const __m256 inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
          for (int part = 0; part < 4; ++part) {
            const __m256i bits = _mm256_set1_epi32(static_cast<int>((banned >> (8 * part)) & 0xFFu));
            const __m256i lanes = _mm256_cmpeq_epi32(_mm256_and_si256(bits, bit32), bit32);
            _mm256_maskstore_ps(out + 8 * part, lanes, inf);
          }
        } else {
          const __m256i inf = _mm256_set1_epi16(static_cast<int16_t>(0xFF80));  // bf16 -inf
          for (int part = 0; part < 2; ++part) {
            const __m256i bits = _mm256_set1_epi16(static_cast<int16_t>((banned >> (16 * part)) & 0xFFFFu));
            const __m256i lanes = _mm256_cmpeq_epi16(_mm256_and_si256(bits, bit16), bit16);
            __m256i* p = reinterpret_cast<__m256i*>(out + 16 * part);
            _mm256_storeu_si256(p, _mm256_blendv_epi8(_mm256_loadu_si256(p), inf, lanes));
          }
        }
      }
#endif
      for (; w < words; ++w) {
        uint32_t banned = ~mask[w];
        const int64_t base = w * 32;
        while (banned) {
          const int64_t t = base + __builtin_ctz(banned);
          if (t >= vocab) break;
          row[t] = minus_inf;
          banned &= banned - 1;
        }
      }
    }
  });
}

}  // namespace

void apply_token_mask(at::Tensor logits, const at::Tensor& bitmask) {
  check_dtype(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [B, V] with contiguous rows");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.dim() == 2 && bitmask.stride(1) == 1 &&
                  bitmask.size(0) == logits.size(0) && bitmask.size(1) == (logits.size(1) + 31) / 32,
              "bitmask must be int32 [B, ceil(V/32)] with contiguous rows");
  PDSERVE_DISPATCH(logits.scalar_type(), [&] { mask_rows<scalar_t>(logits, bitmask); });
}

}  // namespace pdserve
