// Extend attention in bf16 on CPUs with AVX512-BF16 dot products, in tiles (contract:
// kernels/extend_attention.py).
//
// attention.cpp gives every query row a pass over the keys of its own, so that a row's bits never depend on
// its neighbours (the deterministic mode needs that); the new tokens of a prompt then read every key once per
// row, and attention over a long cached prefix costs as much as the whole rest of the layer. Here four query
// rows of one kv head (a new token's query heads, then the next token's) share every K and V vector they load,
// and each vector feeds a bf16 dot-product instruction whole: K and V of a (sequence, kv head) are first
// repacked into that instruction's operand layout (pairs of dims for the scores, pairs of keys for the
// weighted sum), then each tile takes its scores against all the keys it sees, an exact softmax over them
// (weights rounded to bf16, as the torch flash kernel's are) and the weighted sum of V, accumulating in fp32.
#include "attention.h"

#include <algorithm>
#include <atomic>
#include <vector>

namespace pdserve {

#if defined(__AVX512BF16__)
namespace {

constexpr int64_t ROWS = 4;   // query rows per tile
constexpr int64_t KEYS = 16;  // keys per vector of scores
// Packed K and V of the sequences handled together stay under this (one sequence may exceed it alone): the
// packing is as large as the part of the KV cache it copies.
constexpr int64_t PACK_BUDGET_BYTES = 16 << 20;

// One (sequence, kv head): where its K and V rows are, and where their packed copies go.
struct Head {
  int64_t b, h, len;
  int64_t start, prefix, rows;  // its sequence's first new token in q, cached tokens, query rows (tokens x group)
  __m512i* k;  // ceil(len / 16) blocks of D / 2 vectors: block j, vector p = dims 2p, 2p+1 of keys 16j..16j+15
  __m512i* v;  // ceil(len / 2) pairs of D / 16 vectors: pair j, vector c = dims 16c..16c+15 of keys 2j, 2j+1
};

// Four query rows of one Head: rows are (new token, query head of the kv head), token-major.
struct Tile {
  int64_t head;  // index into the Heads
  int64_t row;   // first row
  int64_t cost;  // keys seen by its last row
};

// The call's queries and output.
struct Rows {
  const uint16_t* q;
  int64_t q_token, q_head;
  uint16_t* out;
  int64_t out_token, group;
  float scale;
};

struct Layout {
  const uint16_t* k;
  const uint16_t* v;
  int64_t k_page, k_token, k_head, v_page, v_token, v_head, page_size, head_dim;
};

void pack(const Layout& kv, const int32_t* pages, const Head& hd) {
  const int64_t D = kv.head_dim, pairs = D / 2, chunks = D / 16, blocks = (hd.len + KEYS - 1) / KEYS;
  // K: 16 keys' words (a word = two adjacent dims) at a time, per word index; lanes past the end are zero.
  // Offsets are 64-bit: the layer's view strides over every layer of the pool, whose size has no bound here.
  const int32_t* kbase = reinterpret_cast<const int32_t*>(kv.k + hd.h * kv.k_head);
  alignas(64) int64_t offsets[KEYS];
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t n = std::min(KEYS, hd.len - j * KEYS);
    for (int64_t i = 0; i < KEYS; ++i) {
      const int64_t t = j * KEYS + std::min(i, n - 1);  // lanes past the end read the last key, masked off
      offsets[i] = (pages[t / kv.page_size] * kv.k_page + (t % kv.page_size) * kv.k_token) / 2;
    }
    const __m512i first = _mm512_load_si512(offsets), second = _mm512_load_si512(offsets + 8);
    const __mmask16 valid = n == KEYS ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512i step = _mm512_set1_epi64(p);
      const __m256i lo = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), __mmask8(valid),
                                                     _mm512_add_epi64(first, step), kbase, 4);
      const __m256i hi = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), __mmask8(valid >> 8),
                                                     _mm512_add_epi64(second, step), kbase, 4);
      hd.k[j * pairs + p] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
  }
  // V: two keys' rows interleaved word by word.
  const uint16_t* vbase = kv.v + hd.h * kv.v_head;
  auto v_row = [&](int64_t t) {
    return vbase + pages[t / kv.page_size] * kv.v_page + (t % kv.page_size) * kv.v_token;
  };
  for (int64_t j = 0; j < (hd.len + 1) / 2; ++j) {
    const uint16_t* even = v_row(2 * j);
    const uint16_t* odd = 2 * j + 1 < hd.len ? v_row(2 * j + 1) : nullptr;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + 16 * c)));
      const __m512i hi = odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + 16 * c)))
                             : _mm512_setzero_si512();
      hd.v[j * chunks + c] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
    }
  }
}

// Scores of the tile's rows against C vectors of keys (16 C keys from the block `k` points at).
template <int C, int PAIRS>
inline void scores(const int32_t* const q[ROWS], const __m512i* k, float* s, int64_t s_row) {
  __m512 acc[ROWS][C];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int p = 0; p < PAIRS; ++p) {
    __m512bh kv[C];
    for (int c = 0; c < C; ++c) kv[c] = (__m512bh)_mm512_load_si512(k + c * PAIRS + p);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh qr = (__m512bh)_mm512_set1_epi32(q[r][p]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qr, kv[c]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(s + r * s_row + c * KEYS, acc[r][c]);
}

// The weighted sum over `pairs` pairs of keys of 16 CH dims (from the chunk `v` points at), scaled by each
// row's 1 / sum and rounded to bf16.
template <int CH>
inline void values(const int32_t* const w[ROWS], const __m512i* v, int64_t chunks, int64_t pairs,
                   const float inv_sum[ROWS], uint16_t* const out[ROWS]) {
  __m512 acc[ROWS][CH];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CH; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh vv[CH];
    for (int c = 0; c < CH; ++c) vv[c] = (__m512bh)_mm512_load_si512(v + j * chunks + c);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh wr = (__m512bh)_mm512_set1_epi32(w[r][j]);
      for (int c = 0; c < CH; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wr, vv[c]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const __m512 inv = _mm512_set1_ps(inv_sum[r]);
    for (int c = 0; c < CH; ++c) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + 16 * c), (__m256i)rounded);
    }
  }
}

// Softmax of one row's first n scores (scaled), as bf16 weights in w up to `padded` (zeros past n); returns
// 1 / the sum of the rounded weights.
float softmax_row(const float* s, int64_t n, int64_t padded, float scale, uint16_t* w) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += KEYS) {
    const __mmask16 m = n - i >= KEYS ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + i));
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top) * scale);
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < padded; i += KEYS) {
    const int64_t left = std::max<int64_t>(0, n - i);
    const __mmask16 m = left >= KEYS ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive16(_mm512_fmsub_ps(_mm512_loadu_ps(s + i), vscale, shift)));
    const __m256bh rounded = _mm512_cvtneps_pbh(e);
    sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(rounded));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + i), (__m256i)rounded);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// Per-thread buffers: a tile's scores and weights over the longest sequence, a zero query for missing rows and
// a row that takes their output.
struct Scratch {
  std::vector<float> s;
  std::vector<uint16_t> w, zero_q, spare_out;
  Scratch(int64_t max_len, int64_t head_dim)
      : s(ROWS * max_len), w(ROWS * max_len), zero_q(head_dim, 0), spare_out(head_dim) {}
};

template <int PAIRS>
void run_tile(const Tile& tile, const Head& hd, const Rows& call, Scratch& sc) {
  constexpr int64_t D = 2 * PAIRS, CHUNKS = D / 16;
  const int32_t* qr[ROWS];
  uint16_t* outr[ROWS];
  int64_t seen[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) {
    const int64_t row = tile.row + r;
    if (row < hd.rows) {
      const int64_t t = row / call.group, head = hd.h * call.group + row % call.group;
      qr[r] = reinterpret_cast<const int32_t*>(call.q + (hd.start + t) * call.q_token + head * call.q_head);
      outr[r] = call.out + (hd.start + t) * call.out_token + head * D;
      seen[r] = hd.prefix + t + 1;
    } else {
      qr[r] = reinterpret_cast<const int32_t*>(sc.zero_q.data());
      outr[r] = sc.spare_out.data();
      seen[r] = 0;
    }
  }
  const int64_t vectors = (tile.cost + KEYS - 1) / KEYS, padded = vectors * KEYS;
  float* s = sc.s.data();
  const int64_t s_row = padded;
  int64_t j = 0;
  for (; j + 4 <= vectors; j += 4) scores<4, PAIRS>(qr, hd.k + j * PAIRS, s + j * KEYS, s_row);
  switch (vectors - j) {
    case 3: scores<3, PAIRS>(qr, hd.k + j * PAIRS, s + j * KEYS, s_row); break;
    case 2: scores<2, PAIRS>(qr, hd.k + j * PAIRS, s + j * KEYS, s_row); break;
    case 1: scores<1, PAIRS>(qr, hd.k + j * PAIRS, s + j * KEYS, s_row); break;
    default: break;
  }
  const int32_t* wr[ROWS];
  float inv_sum[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) {
    uint16_t* w = sc.w.data() + r * padded;
    inv_sum[r] = seen[r] > 0 ? softmax_row(s + r * s_row, seen[r], padded, call.scale, w) : 0.0f;
    if (seen[r] == 0) std::fill(w, w + padded, 0);
    wr[r] = reinterpret_cast<const int32_t*>(w);
  }
  const int64_t pairs = (tile.cost + 1) / 2;
  for (int64_t c = 0; c < CHUNKS; c += 4) {
    uint16_t* o[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) o[r] = outr[r] + 16 * c;
    values<4>(wr, hd.v + c, CHUNKS, pairs, inv_sum, o);
  }
}

}  // namespace

bool tiled_extend_supported(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

at::Tensor extend_attention_tiled(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& page_table, const at::Tensor& seq_lens,
                                  const at::Tensor& extend_lens, const at::Tensor& q_start, double scale) {
  check_attention_inputs(q, k_cache, v_cache, page_table, seq_lens);
  check_extend_inputs(q, k_cache, page_table, seq_lens, extend_lens, q_start);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "the tiled extend attention takes bfloat16");
  const int64_t tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  TORCH_CHECK(tiled_extend_supported(head_dim), "the tiled extend attention has no body for head_dim ", head_dim);
  const int64_t num_kv_heads = k_cache.size(2), group = num_heads / num_kv_heads;
  const int64_t batch = seq_lens.numel();
  at::Tensor out = at::empty({tokens, num_heads, head_dim}, q.options());
  if (tokens == 0) return out;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* ext = extend_lens.data_ptr<int32_t>();
  const int32_t* start = q_start.data_ptr<int32_t>();
  const int32_t* table = page_table.data_ptr<int32_t>();
  const Layout kv{static_cast<const uint16_t*>(k_cache.data_ptr()), static_cast<const uint16_t*>(v_cache.data_ptr()),
                  k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
                  v_cache.stride(2), k_cache.size(1), head_dim};
  const Rows call{static_cast<const uint16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
                  static_cast<uint16_t*>(out.data_ptr()), num_heads * head_dim, group, static_cast<float>(scale)};
  const int64_t pairs = head_dim / 2, chunks = head_dim / 16;
  auto packed_vectors = [&](int64_t len) { return (len + KEYS - 1) / KEYS * pairs + (len + 1) / 2 * chunks; };

  for (int64_t first = 0; first < batch;) {
    // The sequences [first, last) whose packed K and V fit the budget together (at least one).
    int64_t last = first, vectors = 0, max_len = 0;
    while (last < batch && (last == first || vectors + num_kv_heads * packed_vectors(lens[last]) <=
                                                 PACK_BUDGET_BYTES / 64)) {
      if (ext[last] > 0) {
        vectors += num_kv_heads * packed_vectors(lens[last]);
        max_len = std::max<int64_t>(max_len, lens[last]);
      }
      ++last;
    }
    if (vectors == 0) {
      first = last;
      continue;
    }
    at::Tensor buffer = at::empty({vectors * 64 + 64}, at::kByte);
    __m512i* base = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(buffer.data_ptr()) + 63) & ~uintptr_t(63));
    std::vector<Head> heads;
    std::vector<Tile> tiles;
    for (int64_t b = first, offset = 0; b < last; ++b) {
      if (ext[b] == 0) continue;
      const int64_t k_vectors = (lens[b] + KEYS - 1) / KEYS * pairs;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t rows = ext[b] * group, prefix = lens[b] - ext[b];
        heads.push_back(Head{b, h, lens[b], start[b], prefix, rows, base + offset, base + offset + k_vectors});
        offset += packed_vectors(lens[b]);
        for (int64_t row = 0; row < rows; row += ROWS) {
          const int64_t last_row = std::min(row + ROWS, rows) - 1;
          tiles.push_back(Tile{static_cast<int64_t>(heads.size()) - 1, row, prefix + last_row / group + 1});
        }
      }
    }
    at::parallel_for(0, static_cast<int64_t>(heads.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) pack(kv, table + heads[i].b * page_table.stride(0), heads[i]);
    });
    // Costliest tiles first, handed out one at a time: causal tiles differ in cost up to the prompt's length.
    std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      Scratch sc((max_len + KEYS - 1) / KEYS * KEYS, head_dim);
      for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(tiles.size());) {
        const Tile& tile = tiles[i];
        if (head_dim == 64) {
          run_tile<32>(tile, heads[tile.head], call, sc);
        } else {
          run_tile<64>(tile, heads[tile.head], call, sc);
        }
      }
    });
    first = last;
  }
  return out;
}

#else

bool tiled_extend_supported(int64_t) { return false; }

at::Tensor extend_attention_tiled(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "the tiled extend attention needs a CPU with AVX512-BF16");
}

#endif

}  // namespace pdserve
