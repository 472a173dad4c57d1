// Paged attention reading the KV cache in place (contracts: kernels/decode_attention.py and
// kernels/extend_attention.py).
//
// Both ops reduce to one routine, `attend_row`: the query heads of one token that share a kv head attend to
// the first `len` tokens of their sequence, found page by page through the page table. Scores, softmax and
// the weighted sum are fp32 in a fixed order (token 0 to len - 1), so a token's output depends only on its
// own query and the cached K/V: not on the batch, on how a prompt was split into chunks, or on whether its
// prefix came from the cache. Decode and extend give bit-identical rows, which the deterministic mode needs.
#include "attention.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace pdserve {

namespace {

// Where one sequence's K and V rows are: `heads` kv heads from the layer view's base, page by page.
struct KV {
  const void* k;  // the layer's K view, offset to the first kv head handled
  const void* v;
  int64_t k_page, k_token, k_head, v_page, v_token, v_head;  // strides in elements
  int64_t page_size;
  int64_t heads;  // kv heads handled together (their rows are adjacent in a token's slot)
};

// Softmax over each head's scores in place (scaled first), leaving 1 / sum per head in inv_sum.
inline void softmax_rows(float* scores, int64_t heads, int64_t len, float scale, float* inv_sum) {
  for (int64_t g = 0; g < heads; ++g) {
    float* sg = scores + g * len;
    float m = sg[0] * scale;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] *= scale;
      m = std::max(m, sg[t]);
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      const float e = exp_nonpositive(sg[t] - m);
      sg[t] = e;
      sum += e;
    }
    inv_sum[g] = 1.0f / sum;
  }
}

#if defined(__AVX512F__)

// The AVX-512 passes for head_dim = 16 * CHUNKS and GROUP query heads per kv head (both known at compile
// time, so a kv head's accumulators stay in registers). Pages are walked one at a time, each kv head's rows of
// the page in turn, so a page is read from memory once; a score is reduced across lanes in a fixed order.
template <typename T, int CHUNKS, int GROUP>
void scores_avx512(const float* qf, const KV& kv, const int32_t* pages, int64_t len, float* scores) {
  constexpr int D = 16 * CHUNKS;
  const T* base = static_cast<const T*>(kv.k);
  for (int64_t t0 = 0, p = 0; t0 < len; t0 += kv.page_size, ++p) {
    const T* page = base + static_cast<int64_t>(pages[p]) * kv.k_page;
    const int64_t n = std::min(kv.page_size, len - t0);
    for (int64_t h = 0; h < kv.heads; ++h) {
      __m512 q[GROUP][CHUNKS];
      for (int g = 0; g < GROUP; ++g) {
        for (int c = 0; c < CHUNKS; ++c) q[g][c] = _mm512_loadu_ps(qf + (h * GROUP + g) * D + 16 * c);
      }
      float* out = scores + h * GROUP * len + t0;
      for (int64_t i = 0; i < n; ++i) {
        const T* kr = page + i * kv.k_token + h * kv.k_head;
        __m512 k[CHUNKS];
        for (int c = 0; c < CHUNKS; ++c) k[c] = load16(kr + 16 * c);
        for (int g = 0; g < GROUP; ++g) {
          __m512 s = _mm512_mul_ps(q[g][0], k[0]);
          for (int c = 1; c < CHUNKS; ++c) s = _mm512_fmadd_ps(q[g][c], k[c], s);
          out[g * len + i] = _mm512_reduce_add_ps(s);
        }
      }
    }
  }
}

template <typename T, int CHUNKS, int GROUP>
void values_avx512(const float* scores, const KV& kv, const int32_t* pages, int64_t len, float* acc) {
  constexpr int D = 16 * CHUNKS;
  const T* base = static_cast<const T*>(kv.v);
  for (int64_t h = 0; h < kv.heads; ++h) {
    __m512 a[GROUP][CHUNKS];
    for (int g = 0; g < GROUP; ++g) {
      for (int c = 0; c < CHUNKS; ++c) a[g][c] = _mm512_setzero_ps();
    }
    const float* w = scores + h * GROUP * len;
    for (int64_t t0 = 0, p = 0; t0 < len; t0 += kv.page_size, ++p) {
      const T* page = base + static_cast<int64_t>(pages[p]) * kv.v_page + h * kv.v_head;
      const int64_t n = std::min(kv.page_size, len - t0);
      for (int64_t i = 0; i < n; ++i) {
        const T* vr = page + i * kv.v_token;
        __m512 v[CHUNKS];
        for (int c = 0; c < CHUNKS; ++c) v[c] = load16(vr + 16 * c);
        for (int g = 0; g < GROUP; ++g) {
          const __m512 wg = _mm512_set1_ps(w[g * len + t0 + i]);
          for (int c = 0; c < CHUNKS; ++c) a[g][c] = _mm512_fmadd_ps(wg, v[c], a[g][c]);
        }
      }
    }
    for (int g = 0; g < GROUP; ++g) {
      for (int c = 0; c < CHUNKS; ++c) _mm512_storeu_ps(acc + (h * GROUP + g) * D + 16 * c, a[g][c]);
    }
  }
}

#if defined(__AVX512BF16__)
// The bf16 scores pass with AVX512-BF16 dot products straight on the cached K (no widening): q heads of the
// group are read in pairs of bf16, 16 tokens of a page are reduced together by sum16.
template <int CHUNKS, int GROUP>
void scores_bf16dot(const at::BFloat16* q, int64_t q_head, const KV& kv, const int32_t* pages, int64_t len,
                    float* scores) {
  constexpr int PAIRS = CHUNKS / 2;  // 32 bf16 per dot-product instruction
  const at::BFloat16* base = static_cast<const at::BFloat16*>(kv.k);
  for (int64_t t0 = 0, p = 0; t0 < len; t0 += kv.page_size, ++p) {
    const at::BFloat16* page = base + static_cast<int64_t>(pages[p]) * kv.k_page;
    const int64_t n = std::min(kv.page_size, len - t0);
    for (int64_t h = 0; h < kv.heads; ++h) {
      for (int g = 0; g < GROUP; ++g) {
        __m512bh qv[PAIRS];
        const at::BFloat16* qg = q + (h * GROUP + g) * q_head;
        for (int c = 0; c < PAIRS; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qg + 32 * c);
        float* out = scores + (h * GROUP + g) * len + t0;
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
          const int64_t m = std::min<int64_t>(16, n - i0);
          __m512 s[16];
          for (int64_t i = 0; i < m; ++i) {
            const at::BFloat16* kr = page + (i0 + i) * kv.k_token + h * kv.k_head;
            s[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(kr));
            for (int c = 1; c < PAIRS; ++c) {
              s[i] = _mm512_dpbf16_ps(s[i], qv[c], (__m512bh)_mm512_loadu_si512(kr + 32 * c));
            }
          }
          if (m == 16) {
            _mm512_storeu_ps(out + i0, sum16(s));
          } else {
            for (int64_t i = 0; i < m; ++i) out[i0 + i] = _mm512_reduce_add_ps(s[i]);
          }
        }
      }
    }
  }
}
#endif

// Runs both passes with the softmax between them when (head_dim, group) has a compiled body; false otherwise.
template <typename T, int CHUNKS, int GROUP>
bool attend_avx512_at(const T* q, int64_t q_head, const float* qf, int64_t group, const KV& kv,
                      const int32_t* pages, int64_t len, float scale, float* scores, float* acc, float* inv_sum) {
  if (group != GROUP) {
    if constexpr (GROUP > 1) {
      return attend_avx512_at<T, CHUNKS, GROUP - 1>(q, q_head, qf, group, kv, pages, len, scale, scores, acc,
                                                    inv_sum);
    }
    return false;
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    scores_bf16dot<CHUNKS, GROUP>(q, q_head, kv, pages, len, scores);
  } else {
    scores_avx512<T, CHUNKS, GROUP>(qf, kv, pages, len, scores);
  }
#else
  scores_avx512<T, CHUNKS, GROUP>(qf, kv, pages, len, scores);
#endif
  softmax_rows(scores, kv.heads * GROUP, len, scale, inv_sum);
  values_avx512<T, CHUNKS, GROUP>(scores, kv, pages, len, acc);
  return true;
}

#elif defined(PDSERVE_AVX2)

// The AVX2 passes for head_dim = 8 * CHUNKS and GROUP query heads per kv head. 16 registers cannot hold a
// group's queries or accumulators, so the scores pass takes 8 tokens of a page per query head (8 sums in
// registers, K rows read from cache after the first head) and reduces them together with sum8, zeros standing
// in for tokens past the page's end; the values pass walks the tokens once per band of CB chunks, its GROUP x CB
// accumulators in registers. Every sum runs over its terms in the order the AVX-512 passes use per lane.
template <typename T, int CHUNKS, int GROUP>
void scores_avx2(const float* qf, const KV& kv, const int32_t* pages, int64_t len, float* scores) {
  constexpr int D = 8 * CHUNKS;
  const T* base = static_cast<const T*>(kv.k);
  for (int64_t t0 = 0, p = 0; t0 < len; t0 += kv.page_size, ++p) {
    const T* page = base + static_cast<int64_t>(pages[p]) * kv.k_page;
    const int64_t n = std::min(kv.page_size, len - t0);
    for (int64_t h = 0; h < kv.heads; ++h) {
      for (int64_t i0 = 0; i0 < n; i0 += 8) {
        const int64_t m = std::min<int64_t>(8, n - i0);
        const T* kr[8];
        for (int64_t i = 0; i < 8; ++i) kr[i] = page + (i0 + std::min(i, m - 1)) * kv.k_token + h * kv.k_head;
        for (int g = 0; g < GROUP; ++g) {
          const float* qg = qf + (h * GROUP + g) * D;
          __m256 s[8];
          for (int i = 0; i < 8; ++i) s[i] = _mm256_setzero_ps();
          for (int c = 0; c < CHUNKS; ++c) {
            const __m256 qc = _mm256_loadu_ps(qg + 8 * c);
            for (int i = 0; i < 8; ++i) s[i] = _mm256_fmadd_ps(qc, load8(kr[i] + 8 * c), s[i]);
          }
          for (int64_t i = m; i < 8; ++i) s[i] = _mm256_setzero_ps();
          float* out = scores + (h * GROUP + g) * len + t0 + i0;
          if (m == 8) {
            _mm256_storeu_ps(out, sum8(s));
          } else {
            alignas(32) float part[8];
            _mm256_store_ps(part, sum8(s));
            for (int64_t i = 0; i < m; ++i) out[i] = part[i];
          }
        }
      }
    }
  }
}

template <typename T, int CHUNKS, int GROUP>
void values_avx2(const float* scores, const KV& kv, const int32_t* pages, int64_t len, float* acc) {
  constexpr int D = 8 * CHUNKS;
  constexpr int CB = GROUP <= 1 ? 8 : GROUP <= 3 ? 4 : GROUP <= 6 ? 2 : 1;  // chunks per band
  static_assert(CHUNKS % CB == 0, "a band is a whole number of chunks");
  const T* base = static_cast<const T*>(kv.v);
  for (int64_t h = 0; h < kv.heads; ++h) {
    const float* w = scores + h * GROUP * len;
    for (int c0 = 0; c0 < CHUNKS; c0 += CB) {
      __m256 a[GROUP][CB];
      for (int g = 0; g < GROUP; ++g) {
        for (int c = 0; c < CB; ++c) a[g][c] = _mm256_setzero_ps();
      }
      for (int64_t t0 = 0, p = 0; t0 < len; t0 += kv.page_size, ++p) {
        const T* page = base + static_cast<int64_t>(pages[p]) * kv.v_page + h * kv.v_head + 8 * c0;
        const int64_t n = std::min(kv.page_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          const T* vr = page + i * kv.v_token;
          __m256 v[CB];
          for (int c = 0; c < CB; ++c) v[c] = load8(vr + 8 * c);
          for (int g = 0; g < GROUP; ++g) {
            const __m256 wg = _mm256_broadcast_ss(w + g * len + t0 + i);
            for (int c = 0; c < CB; ++c) a[g][c] = _mm256_fmadd_ps(wg, v[c], a[g][c]);
          }
        }
      }
      for (int g = 0; g < GROUP; ++g) {
        for (int c = 0; c < CB; ++c) _mm256_storeu_ps(acc + (h * GROUP + g) * D + 8 * (c0 + c), a[g][c]);
      }
    }
  }
}

template <typename T, int CHUNKS, int GROUP>
bool attend_avx2_at(int64_t group, const float* qf, const KV& kv, const int32_t* pages, int64_t len, float scale,
                    float* scores, float* acc, float* inv_sum) {
  if (group != GROUP) {
    if constexpr (GROUP > 1) {
      return attend_avx2_at<T, CHUNKS, GROUP - 1>(group, qf, kv, pages, len, scale, scores, acc, inv_sum);
    }
    return false;
  }
  scores_avx2<T, CHUNKS, GROUP>(qf, kv, pages, len, scores);
  softmax_rows(scores, kv.heads * GROUP, len, scale, inv_sum);
  values_avx2<T, CHUNKS, GROUP>(scores, kv, pages, len, acc);
  return true;
}
#endif

// Portable passes: the same order of operations, left to the compiler's vectorizer.
template <typename T>
void scores_portable(const float* qf, int64_t group, int64_t head_dim, const KV& kv, const int32_t* pages,
                     int64_t len, float* scores) {
  const T* base = static_cast<const T*>(kv.k);
  for (int64_t t0 = 0, p = 0; t0 < len; t0 += kv.page_size, ++p) {
    const T* page = base + static_cast<int64_t>(pages[p]) * kv.k_page;
    const int64_t n = std::min(kv.page_size, len - t0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < kv.heads; ++h) {
        const T* kr = page + i * kv.k_token + h * kv.k_head;
        for (int64_t g = h * group; g < (h + 1) * group; ++g) {
          const float* qg = qf + g * head_dim;
          float s = 0.0f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * to_f32(kr[d]);
          scores[g * len + t0 + i] = s;
        }
      }
    }
  }
}

template <typename T>
void values_portable(const float* scores, int64_t group, int64_t head_dim, const KV& kv, const int32_t* pages,
                     int64_t len, float* acc) {
  const T* base = static_cast<const T*>(kv.v);
  for (int64_t t0 = 0, p = 0; t0 < len; t0 += kv.page_size, ++p) {
    const T* page = base + static_cast<int64_t>(pages[p]) * kv.v_page;
    const int64_t n = std::min(kv.page_size, len - t0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t h = 0; h < kv.heads; ++h) {
        const T* vr = page + i * kv.v_token + h * kv.v_head;
        for (int64_t g = h * group; g < (h + 1) * group; ++g) {
          const float w = scores[g * len + t0 + i];
          float* ag = acc + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += w * to_f32(vr[d]);
        }
      }
    }
  }
}

// Per-thread buffers of attend_row, sized for the longest sequence of the call.
struct Scratch {
  std::vector<float> scores, qf, acc, inv_sum;
  Scratch(int64_t heads, int64_t head_dim, int64_t max_len)
      : scores(heads * max_len), qf(heads * head_dim), acc(heads * head_dim), inv_sum(heads) {}
};

// The query heads of one token that read kv.heads kv heads (`group` query heads each, `q_head` elements
// apart) attend to the first `len` tokens of their sequence; the result goes to `out`, heads `out_head` apart.
template <typename T>
void attend_row(const T* q, int64_t q_head, int64_t group, int64_t head_dim, float scale, const KV& kv,
                const int32_t* pages, int64_t len, Scratch& s, T* out, int64_t out_head) {
  const int64_t heads = kv.heads * group;
  float* qf = s.qf.data();
  float* acc = s.acc.data();
  float* scores = s.scores.data();
  for (int64_t g = 0; g < heads; ++g) {
    for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_f32(q[g * q_head + d]);
  }
  std::fill(acc, acc + heads * head_dim, 0.0f);
#if defined(__AVX512F__)
  // Groups of up to 8 query heads per kv head (every GQA model we serve) have compiled bodies.
  bool done = false;
  if (head_dim == 64) {
    done = attend_avx512_at<T, 4, 8>(q, q_head, qf, group, kv, pages, len, scale, scores, acc, s.inv_sum.data());
  } else if (head_dim == 128) {
    done = attend_avx512_at<T, 8, 8>(q, q_head, qf, group, kv, pages, len, scale, scores, acc, s.inv_sum.data());
  }
  if (!done) {
#elif defined(PDSERVE_AVX2)
  bool done = false;
  if (head_dim == 64) {
    done = attend_avx2_at<T, 8, 8>(group, qf, kv, pages, len, scale, scores, acc, s.inv_sum.data());
  } else if (head_dim == 128) {
    done = attend_avx2_at<T, 16, 8>(group, qf, kv, pages, len, scale, scores, acc, s.inv_sum.data());
  }
  if (!done) {
#else
  {
#endif
    scores_portable<T>(qf, group, head_dim, kv, pages, len, scores);
    softmax_rows(scores, heads, len, scale, s.inv_sum.data());
    values_portable<T>(scores, group, head_dim, kv, pages, len, acc);
  }
  for (int64_t g = 0; g < heads; ++g) {
    const float inv = s.inv_sum[g];
    for (int64_t d = 0; d < head_dim; ++d) out[g * out_head + d] = from_f32<T>(acc[g * head_dim + d] * inv);
  }
}

// The layer's K/V rows of kv heads [first, first + count).
KV layer_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t first, int64_t count, int64_t elem) {
  const char* k = static_cast<const char*>(k_cache.data_ptr()) + first * k_cache.stride(2) * elem;
  const char* v = static_cast<const char*>(v_cache.data_ptr()) + first * v_cache.stride(2) * elem;
  return KV{k, v, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), k_cache.size(1), count};
}

}  // namespace

void check_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens) {
  check_dtype(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, Hq, D] with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [P, S, Hk, D]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "caches must have q's dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "caches must be contiguous in head_dim");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "q and the caches disagree on head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.dim() == 2 && page_table.stride(1) == 1,
              "page_table must be int32 [B, max_pages]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens must be int32 [B]");
}

void check_pages(const at::Tensor& page_table, const int32_t* lens, int64_t batch, int64_t page_size,
                 int64_t num_pages) {
  const int32_t* table = page_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = (lens[b] + page_size - 1) / page_size;
    for (int64_t p = 0; p < used; ++p) {
      const int32_t page = table[b * page_table.stride(0) + p];
      TORCH_CHECK(page >= 0 && page < num_pages, "page ", page, " of sequence ", b, " is outside the pool of ",
                  num_pages, " pages");
    }
  }
}

void check_extend_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& page_table,
                         const at::Tensor& seq_lens, const at::Tensor& extend_lens, const at::Tensor& q_start) {
  TORCH_CHECK(extend_lens.scalar_type() == at::kInt && q_start.scalar_type() == at::kInt &&
              extend_lens.is_contiguous() && q_start.is_contiguous(), "extend_lens and q_start must be int32 [B]");
  const int64_t batch = seq_lens.numel(), tokens = q.size(0);
  TORCH_CHECK(extend_lens.numel() == batch && q_start.numel() == batch && page_table.size(0) == batch,
              "page_table, extend_lens and q_start need one entry per sequence");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* ext = extend_lens.data_ptr<int32_t>();
  const int32_t* start = q_start.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(ext[b] >= 0 && ext[b] <= lens[b] && lens[b] <= page_table.size(1) * k_cache.size(1) &&
                start[b] >= 0 && start[b] + ext[b] <= tokens, "extend lengths out of range");
  }
  check_pages(page_table, lens, batch, k_cache.size(1), k_cache.size(0));
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale) {
  check_attention_inputs(q, k_cache, v_cache, page_table, seq_lens);
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), group = num_heads / num_kv_heads;
  TORCH_CHECK(seq_lens.numel() == batch && page_table.size(0) == batch, "one page-table row and length per query");
  at::Tensor out = at::empty({batch, num_heads, head_dim}, q.options());
  if (batch == 0) return out;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int64_t table_stride = page_table.stride(0);
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= page_table.size(1) * k_cache.size(1), "seq_lens out of range");
    max_len = std::max<int64_t>(max_len, lens[b]);
  }
  check_pages(page_table, lens, batch, k_cache.size(1), k_cache.size(0));
  // One task per sequence reads each of its pages as one contiguous run (all kv heads); with fewer sequences
  // than threads, one task per (sequence, kv head) keeps every thread busy.
  const int64_t split = batch >= 2 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t heads_per_task = num_kv_heads / split;
  PDSERVE_DISPATCH(q.scalar_type(), [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * split, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(heads_per_task * group, head_dim, max_len);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / split, h = (item % split) * heads_per_task;
        const KV kv = layer_kv(k_cache, v_cache, h, heads_per_task, sizeof(scalar_t));
        attend_row(qp + b * q.stride(0) + h * group * q.stride(1), q.stride(1), group, head_dim,
                   static_cast<float>(scale), kv, table + b * table_stride, lens[b], scratch,
                   op + (b * num_heads + h * group) * head_dim, head_dim);
      }
    });
  });
  return out;
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& extend_lens,
                            const at::Tensor& q_start, double scale) {
  check_attention_inputs(q, k_cache, v_cache, page_table, seq_lens);
  check_extend_inputs(q, k_cache, page_table, seq_lens, extend_lens, q_start);
  const int64_t tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), group = num_heads / num_kv_heads;
  const int64_t batch = seq_lens.numel();
  at::Tensor out = at::empty({tokens, num_heads, head_dim}, q.options());
  if (tokens == 0) return out;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* ext = extend_lens.data_ptr<int32_t>();
  const int32_t* start = q_start.data_ptr<int32_t>();
  // Each query row's sequence and the number of keys it sees (causal, after the sequence's cached prefix).
  std::vector<int64_t> row_seq(tokens, -1), row_len(tokens, 0);
  int64_t max_len = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < ext[b]; ++i) {
      row_seq[start[b] + i] = b;
      row_len[start[b] + i] = lens[b] - ext[b] + i + 1;
    }
    max_len = std::max<int64_t>(max_len, lens[b]);
  }
  const int32_t* table = page_table.data_ptr<int32_t>();
  const int64_t table_stride = page_table.stride(0);
  PDSERVE_DISPATCH(q.scalar_type(), [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(num_heads, head_dim, max_len);
      const KV kv = layer_kv(k_cache, v_cache, 0, num_kv_heads, sizeof(scalar_t));
      for (int64_t j = begin; j < end; ++j) {
        // Interleave early and late rows: a causal row's cost grows with its position, and parallel_for
        // hands each thread one contiguous range.
        const int64_t r = (j % 2 == 0) ? j / 2 : tokens - 1 - j / 2;
        const int64_t b = row_seq[r];
        if (b < 0) continue;  // a row no sequence owns is left as it is (the torch twin does the same)
        attend_row(qp + r * q.stride(0), q.stride(1), group, head_dim, static_cast<float>(scale), kv,
                   table + b * table_stride, row_len[r], scratch, op + r * num_heads * head_dim, head_dim);
      }
    });
  });
  return out;
}

}  // namespace pdserve
