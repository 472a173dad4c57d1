// What the attention kernels (attention.cpp, extend_tiled.cpp) share: the checks of their common inputs.
#pragma once

#include "common.h"

namespace pdserve {

// q [T, Hq, D], caches [P, S, Hk, D] in q's dtype and contiguous in D, page_table int32 [B, max_pages],
// seq_lens int32 [B].
void check_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens);

// Every page a sequence reads must lie in the pool: a bad page table must raise, never read past it.
void check_pages(const at::Tensor& page_table, const int32_t* lens, int64_t batch, int64_t page_size,
                 int64_t num_pages);

// extend_lens and q_start (int32 [B]) within the sequences and the packed queries: raises otherwise.
void check_extend_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& page_table,
                         const at::Tensor& seq_lens, const at::Tensor& extend_lens, const at::Tensor& q_start);

}  // namespace pdserve
