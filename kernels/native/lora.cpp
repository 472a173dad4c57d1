// Multi-LoRA delta over a batch that mixes adapters (contract and pool layout: kernels/lora.py):
// y[t] += B_s (A_s x[t]) for every row t on an adapter slot s, one (A, B) pair per sub-module of the fused linear.
//
// The rows are grouped by slot first (a counting sort), so each slot's A and B are read once per call however
// its rows are spread through the batch, and nothing past a slot's rank is read. Two parallel passes:
//   shrink: h[row, j, k] = x[row] . A_s[j*R + k], rounded to the model dtype, one unit per (rows of a slot,
//           sub-module, 16 rank rows): the 16 A rows stay in L1 while the slot's rows stream past them;
//   expand: y[row, o] += sum_k h[row, j, k] B_s[o, k], one unit per (rows of a slot, 16 output columns): the
//           16 x 16 block of B is transposed once (lane = output column) and each row of the slot then costs
//           16 broadcast multiply-adds per 16 columns and 16 ranks.
// Products are fp32 multiply-adds on bf16 widened exactly (a shift or a mask per 32 values), except the bf16
// shrink on CPUs with AVX512-BF16, which takes VDPBF16PS (faster there: see dot_rows). Sums are fp32 in an order
// fixed by the shapes and the slot's rank alone, so a row's result does not depend on the batch or the number of
// threads. CPUs without AVX-512 (F, BW, VL) run the same passes as scalar loops.
#include "common.h"

#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

namespace pdserve {

namespace {

constexpr int64_t kRowChunk = 64;  // rows of one slot per unit: bounds the expand's accumulators
constexpr int64_t kBlock = 16;     // rank rows per shrink unit, output columns per expand unit
// A thread's least share of multiply-adds: below it the call stays on one thread (waking a second costs more).
constexpr int64_t kMinWorkPerThread = 1 << 16;

// Rows [begin, end) of the slot-sorted order, all on one slot, at most kRowChunk of them.
struct Task {
  int64_t slot, begin, end;
};

// Output columns [begin, begin + width) of sub-module j, width <= kBlock.
struct ColumnBlock {
  int64_t sub, begin, width;
};

struct Grouping {
  std::vector<int64_t> order;  // row ids of the rows on an adapter with a nonzero rank, grouped by slot
  std::vector<Task> tasks;
};

Grouping group_rows(const int32_t* row_slots, int64_t rows, const int32_t* ranks, int64_t slots, int64_t R) {
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(ranks[s] >= 0 && ranks[s] <= R, "ranks[", s, "] = ", ranks[s], " is outside [0, R = ", R, "]");
  }
  std::vector<int64_t> start(slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    const int32_t s = row_slots[t];
    TORCH_CHECK(s >= -1 && s < slots, "row_slots[", t, "] = ", s, " is outside [-1, ", slots, ")");
    if (s >= 0 && ranks[s] > 0) ++start[s + 1];
  }
  for (int64_t s = 0; s < slots; ++s) start[s + 1] += start[s];
  Grouping g;
  g.order.resize(start[slots]);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < rows; ++t) {
    const int32_t s = row_slots[t];
    if (s >= 0 && ranks[s] > 0) g.order[next[s]++] = t;
  }
  for (int64_t s = 0; s < slots; ++s) {
    for (int64_t b = start[s]; b < start[s + 1]; b += kRowChunk) {
      g.tasks.push_back({s, b, std::min(b + kRowChunk, start[s + 1])});
    }
  }
  return g;
}

// Grain for at::parallel_for over `units` that together do `work` multiply-adds.
int64_t grain_for(int64_t units, int64_t work) {
  const int64_t per_unit = std::max<int64_t>(1, work / std::max<int64_t>(1, units));
  return std::max<int64_t>(1, kMinWorkPerThread / per_unit);
}

// Everything one pass needs, as raw pointers and strides (elements).
template <typename T>
struct Args {
  T* y;
  const T* x;
  const T* a;
  const T* b;
  float* h;  // [order, n_sub, Rp]: each row's rank activations rounded to T, zero past the rank up to Rp
  const int32_t* ranks;
  int64_t ys, xs, in, R, Rp, n_sub, a_slot, b_slot;
  const int64_t* order;
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
using bf16 = at::BFloat16;

// 32 consecutive values (those past `mask` zero) as two fp32 vectors: the halves for fp32, the even and the odd
// elements for bf16 (one load, a shift and a mask). A dot product splits both of its sides the same way.
struct Split {
  __m512 lo, hi;
};
inline Split load_split(const float* p, __mmask32 mask) {
  return {_mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), p),
          _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask >> 16), p + 16)};
}
inline Split load_split(const bf16* p, __mmask32 mask) {
  const __m512i v = _mm512_maskz_loadu_epi16(mask, p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
constexpr __mmask32 kAll = ~__mmask32{0};
inline __mmask32 chunk_mask(int64_t in, int64_t c) {
  const int64_t n = std::min<int64_t>(32, in - 32 * c);
  return n == 32 ? kAll : static_cast<__mmask32>((uint64_t{1} << n) - 1);
}

// x's row in the split layout, padded with zeros to whole chunks of 32: [chunk][lo 16 | hi 16].
template <typename T>
void split_row(const T* x, int64_t in, float* out) {
  for (int64_t c = 0; 32 * c < in; ++c) {
    const Split v = load_split(x + 32 * c, chunk_mask(in, c));
    _mm512_storeu_ps(out + 32 * c, v.lo);
    _mm512_storeu_ps(out + 32 * c + 16, v.hi);
  }
}

// acc[m][n] = 16 partial sums of xs[m] . a[n] (split rows of x; rows of A with stride `in`), each half of each
// sum its own chain: 4 * M independent multiply-adds per A row in flight.
template <int M, int N, typename T>
inline void dot_rows(const float* const* xs, const T* a, int64_t in, __m512 (&acc)[M][N]) {
  __m512 lo[M][N], hi[M][N];
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) lo[m][n] = hi[m][n] = _mm512_setzero_ps();
  }
  auto chunk = [&](int64_t c, __mmask32 mask) {
    Split w[N];
    for (int n = 0; n < N; ++n) w[n] = load_split(a + n * in + 32 * c, mask);
    for (int m = 0; m < M; ++m) {
      const __m512 xl = _mm512_loadu_ps(xs[m] + 32 * c), xh = _mm512_loadu_ps(xs[m] + 32 * c + 16);
      for (int n = 0; n < N; ++n) {
        lo[m][n] = _mm512_fmadd_ps(xl, w[n].lo, lo[m][n]);
        hi[m][n] = _mm512_fmadd_ps(xh, w[n].hi, hi[m][n]);
      }
    }
  };
  int64_t c = 0;
  for (; 32 * c + 32 <= in; ++c) chunk(c, kAll);  // a constant mask: plain loads
  if (32 * c < in) chunk(c, chunk_mask(in, c));
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) acc[m][n] = _mm512_add_ps(lo[m][n], hi[m][n]);
  }
}

#if defined(__AVX512BF16__)
// The same for bf16 rows of x as they are, with VDPBF16PS (32 products per instruction): 1.4x the split fp32
// multiply-adds on this kernel (measured on a Xeon at in = 576), and no split copy of x.
template <int M, int N>
inline void dot_rows(const bf16* const* xr, const bf16* a, int64_t in, __m512 (&acc)[M][N]) {
  for (int m = 0; m < M; ++m) {
    for (int n = 0; n < N; ++n) acc[m][n] = _mm512_setzero_ps();
  }
  auto chunk = [&](int64_t c, __mmask32 mask) {
    __m512bh w[N];
    for (int n = 0; n < N; ++n) w[n] = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + n * in + 32 * c);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[m] + 32 * c);
      for (int n = 0; n < N; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, w[n]);
    }
  };
  int64_t c = 0;
  for (; 32 * c + 32 <= in; ++c) chunk(c, kAll);
  if (32 * c < in) chunk(c, chunk_mask(in, c));
}
constexpr bool kDpbf16 = true;
#else
constexpr bool kDpbf16 = false;
#endif
// Whether the shrink multiplies split fp32 copies of x's rows (else the bf16 rows, with VDPBF16PS).
template <typename T>
constexpr bool kSplitX = !(kDpbf16 && std::is_same_v<T, bf16>);

// h[m][0, 16) for the M rows xr of x (split rows, or bf16 rows for VDPBF16PS) and the 16 A rows from a (those from
// rows_a on give zero): two A rows at a time, the 16 sums of a row reduced together and rounded to T.
template <int M, typename X, typename T>
void shrink_rows(const X* const* xr, const T* a, int64_t rows_a, int64_t in, float* const* h) {
  __m512 sums[M][kBlock];
  for (int64_t k = 0; k < kBlock; k += 2) {
    if (k + 1 < rows_a) {
      __m512 acc[M][2];
      dot_rows<M, 2>(xr, a + k * in, in, acc);
      for (int m = 0; m < M; ++m) sums[m][k] = acc[m][0], sums[m][k + 1] = acc[m][1];
    } else if (k < rows_a) {
      __m512 acc[M][1];
      dot_rows<M, 1>(xr, a + k * in, in, acc);
      for (int m = 0; m < M; ++m) sums[m][k] = acc[m][0], sums[m][k + 1] = _mm512_setzero_ps();
    } else {
      for (int m = 0; m < M; ++m) sums[m][k] = sums[m][k + 1] = _mm512_setzero_ps();
    }
  }
  T* as_t = nullptr;
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(h[m], round_to(as_t, sum16(sums[m])));
}

// h for rank rows [k0, k0 + 16) of sub-module j and the task's rows, 4 rows at a time. scratch: the calling
// thread's room for the task's split rows.
template <typename T>
void shrink(const Args<T>& p, const Task& task, int64_t j, int64_t k0, float* scratch) {
  const int64_t rows_a = std::min<int64_t>(kBlock, p.ranks[task.slot] - k0);
  const T* a = p.a + task.slot * p.a_slot + (j * p.R + k0) * p.in;
  const int64_t padded = (p.in + 31) / 32 * 32;
  constexpr bool split = kSplitX<T>;
  using X = std::conditional_t<split, float, T>;
  for (int64_t i = task.begin; i < task.end && split; ++i) {
    split_row(p.x + p.order[i] * p.xs, p.in, scratch + (i - task.begin) * padded);
  }
  for (int64_t i = task.begin; i < task.end; i += 4) {
    const X* xr[4];
    float* h[4];
    const int64_t n = std::min<int64_t>(4, task.end - i);
    for (int64_t m = 0; m < n; ++m) {
      if constexpr (split) {
        xr[m] = scratch + (i + m - task.begin) * padded;
      } else {
        xr[m] = p.x + p.order[i + m] * p.xs;
      }
      h[m] = p.h + ((i + m) * p.n_sub + j) * p.Rp + k0;
    }
    switch (n) {
      case 1: shrink_rows<1>(xr, a, rows_a, p.in, h); break;
      case 2: shrink_rows<2>(xr, a, rows_a, p.in, h); break;
      case 3: shrink_rows<3>(xr, a, rows_a, p.in, h); break;
      default: shrink_rows<4>(xr, a, rows_a, p.in, h); break;
    }
  }
}

// out[q] lane c = dword q of rows[c]: a 16 x 8 transpose of 32-bit values. Rows c and c + 8 share a register,
// then the 8 x 8 transpose of each 256-bit half at once.
inline void transpose16x8(const __m256i (&rows)[16], __m512i (&out)[8]) {
  __m512i z[8], t[8], u[8];
  for (int c = 0; c < 8; ++c) z[c] = _mm512_inserti64x4(_mm512_castsi256_si512(rows[c]), rows[c + 8], 1);
  for (int c = 0; c < 8; c += 2) {  // per 128-bit lane: rows c, c + 1 interleaved
    t[c] = _mm512_unpacklo_epi32(z[c], z[c + 1]);
    t[c + 1] = _mm512_unpackhi_epi32(z[c], z[c + 1]);
  }
  for (int c = 0; c < 8; c += 4) {  // per 128-bit lane: one dword of 4 rows
    for (int q = 0; q < 2; ++q) {
      u[c + 2 * q] = _mm512_unpacklo_epi64(t[c + q], t[c + q + 2]);
      u[c + 2 * q + 1] = _mm512_unpackhi_epi64(t[c + q], t[c + q + 2]);
    }
  }
  // u[q] lane L (+2 for rows 8-15) holds dword 4L + q of rows 0-3, u[q + 4] the same of rows 4-7.
  const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int q = 0; q < 4; ++q) {
    out[q] = _mm512_permutex2var_epi64(u[q], low, u[q + 4]);
    out[q + 4] = _mm512_permutex2var_epi64(u[q], high, u[q + 4]);
  }
}

// tile[k] lane c = B[c][k0 + k] for the first `width` rows of B (row stride R) and k < 16; rows past `width`
// and columns from `rank` on read as zero.
inline void transpose_block(const bf16* b, int64_t R, int64_t width, int64_t k0, int64_t rank, __m512 (&tile)[16]) {
  const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, rank - k0)) - 1);
  __m256i rows[16];
  for (int c = 0; c < 16; ++c) {
    rows[c] = c < width ? _mm256_maskz_loadu_epi16(mask, b + c * R + k0) : _mm256_setzero_si256();
  }
  __m512i pairs[8];  // lane c of pairs[q]: B[c][k0 + 2q] (low half) and B[c][k0 + 2q + 1]
  transpose16x8(rows, pairs);
  for (int q = 0; q < 8; ++q) {
    tile[2 * q] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs[q], 16));
    tile[2 * q + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs[q], _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
}
inline void transpose_block(const float* b, int64_t R, int64_t width, int64_t k0, int64_t rank, __m512 (&tile)[16]) {
  for (int half = 0; half < 2; ++half) {
    const int64_t k = k0 + 8 * half;
    const __mmask8 mask = static_cast<__mmask8>((1u << std::clamp<int64_t>(rank - k, 0, 8)) - 1);
    __m256i rows[16];
    for (int c = 0; c < 16; ++c) {
      rows[c] = c < width ? _mm256_castps_si256(_mm256_maskz_loadu_ps(mask, b + c * R + k)) : _mm256_setzero_si256();
    }
    __m512i ranks[8];
    transpose16x8(rows, ranks);
    for (int q = 0; q < 8; ++q) tile[8 * half + q] = _mm512_castsi512_ps(ranks[q]);
  }
}

inline __m512 load_row(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load_row(const bf16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
inline void store_row(float* p, __mmask16 mask, __m512 x) { _mm512_mask_storeu_ps(p, mask, x); }
inline void store_row(bf16* p, __mmask16 mask, __m512 x) {
  const __m512i bits = _mm512_castps_si512(round_to(p, x));
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

template <typename T>
void expand(const Args<T>& p, const Task& task, const ColumnBlock& cb) {
  const int64_t rank = p.ranks[task.slot];
  const T* b = p.b + task.slot * p.b_slot + cb.begin * p.R;
  const int64_t n = task.end - task.begin;
  __m512 acc[kRowChunk];
  for (int64_t i = 0; i < n; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < rank; k0 += 16) {
    __m512 tile[16];
    transpose_block(b, p.R, cb.width, k0, rank, tile);
    // h past the rank is zero up to the next multiple of 16, so all 16 ranks can be taken.
    for (int64_t i = 0; i < n; ++i) {
      const float* h = p.h + ((task.begin + i) * p.n_sub + cb.sub) * p.Rp + k0;
      __m512 even = acc[i], odd = _mm512_setzero_ps();  // two chains: half the latency of one
      for (int k = 0; k < 16; k += 2) {
        even = _mm512_fmadd_ps(_mm512_set1_ps(h[k]), tile[k], even);
        odd = _mm512_fmadd_ps(_mm512_set1_ps(h[k + 1]), tile[k + 1], odd);
      }
      acc[i] = _mm512_add_ps(even, odd);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << cb.width) - 1);
  for (int64_t i = 0; i < n; ++i) {
    T* y = p.y + p.order[task.begin + i] * p.ys + cb.begin;
    store_row(y, mask, _mm512_add_ps(load_row(y, mask), round_to(y, acc[i])));
  }
}

#else  // portable passes
// Without AVX-512 (an AVX2 build) the compiler vectorizes these loops differently for different row counts, and
// fused multiply-adds in some versions but not others made a row's result depend on the batch (measured on the
// x86-64-v3 build): plain multiplies and adds keep every version to one order and one rounding per step.
#pragma GCC optimize("fp-contract=off")

template <typename T>
constexpr bool kSplitX = false;

template <typename T>
void shrink(const Args<T>& p, const Task& task, int64_t j, int64_t k0, float*) {
  const int64_t rank = p.ranks[task.slot];
  const T* a = p.a + task.slot * p.a_slot + (j * p.R + k0) * p.in;
  for (int64_t i = task.begin; i < task.end; ++i) {
    const T* x = p.x + p.order[i] * p.xs;
    float* h = p.h + (i * p.n_sub + j) * p.Rp + k0;
    for (int64_t k = 0; k < kBlock; ++k) {
      float sum = 0.0f;
      for (int64_t c = 0; k0 + k < rank && c < p.in; ++c) sum += to_f32(x[c]) * to_f32(a[k * p.in + c]);
      h[k] = to_f32(from_f32<T>(sum));
    }
  }
}

template <typename T>
void expand(const Args<T>& p, const Task& task, const ColumnBlock& cb) {
  const int64_t rank = p.ranks[task.slot];
  const T* b = p.b + task.slot * p.b_slot + cb.begin * p.R;
  for (int64_t i = task.begin; i < task.end; ++i) {
    const float* h = p.h + (i * p.n_sub + cb.sub) * p.Rp;
    T* y = p.y + p.order[i] * p.ys + cb.begin;
    for (int64_t c = 0; c < cb.width; ++c) {
      float sum = 0.0f;
      for (int64_t k = 0; k < rank; ++k) sum += h[k] * to_f32(b[c * p.R + k]);
      y[c] = from_f32<T>(to_f32(y[c]) + to_f32(from_f32<T>(sum)));  // the delta rounded to T, then added
    }
  }
}

#endif

template <typename T>
void lora_apply_typed(const Args<T>& p, const Grouping& g, const std::vector<ColumnBlock>& blocks) {
  const int64_t tasks = static_cast<int64_t>(g.tasks.size());
  int64_t rank_rows = 0;  // rows x rank of the call: the work of both passes is proportional
  for (const Task& task : g.tasks) rank_rows += (task.end - task.begin) * p.ranks[task.slot];
  int64_t most_rows = 0;
  for (const Task& task : g.tasks) most_rows = std::max(most_rows, task.end - task.begin);
  const int64_t out = blocks.empty() ? 0 : blocks.back().begin + blocks.back().width;

  // Shrink: unit = (task, sub-module, 16 rank rows); rank rows past the slot's rank are skipped.
  const int64_t kblocks = (p.R + kBlock - 1) / kBlock;
  const int64_t shrink_units = tasks * p.n_sub * kblocks;
  at::parallel_for(0, shrink_units, grain_for(shrink_units, rank_rows * p.n_sub * p.in),
                   [&](int64_t begin, int64_t end) {
    // Room for a task's split rows (see shrink); no zeroing, every value is written before it is read.
    std::unique_ptr<float[]> scratch(kSplitX<T> ? new float[most_rows * ((p.in + 31) / 32 * 32)] : nullptr);
    for (int64_t u = begin; u < end; ++u) {
      const Task& task = g.tasks[u / (p.n_sub * kblocks)];
      const int64_t j = u / kblocks % p.n_sub, k0 = u % kblocks * kBlock;
      if (k0 < p.ranks[task.slot]) shrink(p, task, j, k0, scratch.get());
    }
  });

  // Expand: unit = (task, 16 output columns of one sub-module).
  const int64_t nb = static_cast<int64_t>(blocks.size());
  const int64_t expand_units = tasks * nb;
  at::parallel_for(0, expand_units, grain_for(expand_units, rank_rows * out), [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) expand(p, g.tasks[u / nb], blocks[u % nb]);
  });
}

}  // namespace

void lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                std::vector<int64_t> out_offsets, const at::Tensor& row_slots, const at::Tensor& ranks) {
  check_dtype(x, "x");
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&y), &lora_a, &lora_b}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->device().is_cpu(),
                "y, lora_a and lora_b must be CPU tensors of x's dtype ", x.scalar_type());
  }
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, in] with contiguous rows");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0), "y must be [T, out] with contiguous rows");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_b.dim() == 3 && lora_b.is_contiguous(),
              "lora_a and lora_b must be contiguous [S, n_sub * R, in] and [S, out, R]");
  const int64_t slots = lora_a.size(0), in = x.size(1), out = y.size(1), R = lora_b.size(2);
  const int64_t n_sub = static_cast<int64_t>(out_offsets.size()) - 1;
  TORCH_CHECK(n_sub >= 1 && out_offsets.front() == 0 && out_offsets.back() == out &&
              std::is_sorted(out_offsets.begin(), out_offsets.end()),
              "out_offsets must rise from 0 to out = ", out, " in n_sub + 1 steps");
  TORCH_CHECK(lora_a.size(1) == n_sub * R && lora_a.size(2) == in && lora_b.size(0) == slots && lora_b.size(1) == out,
              "lora_a ", lora_a.sizes(), " and lora_b ", lora_b.sizes(), " must be [S, n_sub * R, in] and "
              "[S, out, R] with n_sub = ", n_sub, ", in = ", in, ", out = ", out);
  for (const at::Tensor* t : {&row_slots, &ranks}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous() && t->device().is_cpu(),
                "row_slots and ranks must be contiguous int32 CPU vectors");
  }
  TORCH_CHECK(row_slots.size(0) == x.size(0) && ranks.size(0) == slots,
              "row_slots must have one entry per row of x and ranks one per slot");

  const Grouping g = group_rows(row_slots.data_ptr<int32_t>(), x.size(0), ranks.data_ptr<int32_t>(), slots, R);
  if (g.order.empty()) return;
  std::vector<ColumnBlock> blocks;
  for (int64_t j = 0; j < n_sub; ++j) {
    for (int64_t c = out_offsets[j]; c < out_offsets[j + 1]; c += kBlock) {
      blocks.push_back({j, c, std::min(kBlock, out_offsets[j + 1] - c)});
    }
  }
  const int64_t Rp = (R + kBlock - 1) / kBlock * kBlock;
  at::Tensor h = at::empty({static_cast<int64_t>(g.order.size()), n_sub, Rp}, x.options().dtype(at::kFloat));
  PDSERVE_DISPATCH(x.scalar_type(), [&] {
    const Args<scalar_t> p{y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), lora_a.data_ptr<scalar_t>(),
                           lora_b.data_ptr<scalar_t>(), h.data_ptr<float>(), ranks.data_ptr<int32_t>(),
                           y.stride(0), x.stride(0), in, R, Rp, n_sub, lora_a.stride(0), lora_b.stride(0),
                           g.order.data()};
    lora_apply_typed(p, g, blocks);
  });
}

}  // namespace pdserve
