// One round of the tensor-parallel ranks' shared-memory all-reduce (contract: shared/tp_group.py, ShmGroup): this
// rank's partial sums widened to fp32 into its slot, its round number stored after them (release), the other
// ranks' round numbers spun on (acquire), then every rank's slot added in rank order, in fp32, into x. The same
// order on every rank gives every rank the same bits. The Python version of the round costs ~35 us of interpreter
// per call where a step makes two per layer; the spin is bounded, and past it Python waits with its liveness
// checks and calls shm_sum.
#include "common.h"

namespace pdserve {

namespace {

void widen(const at::Tensor& x, float* dst) {
  const int64_t n = x.numel();
  if (x.scalar_type() == at::kFloat) {
    std::memcpy(dst, x.data_ptr<float>(), n * sizeof(float));
  } else {
    const at::BFloat16* src = x.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

}  // namespace

// values: the round's slots as fp32 [size, >= n]; x: [n] fp32 or bf16, contiguous; written with the sum.
void shm_sum(at::Tensor x, const at::Tensor& values) {
  const int64_t n = x.numel(), size = values.size(0), stride = values.stride(0);
  const float* v = values.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    float* out = x.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      float total = v[i] + v[stride + i];
      for (int64_t r = 2; r < size; ++r) total += v[r * stride + i];
      out[i] = total;
    }
  } else {
    at::BFloat16* out = x.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < n; ++i) {
      float total = v[i] + v[stride + i];
      for (int64_t r = 2; r < size; ++r) total += v[r * stride + i];
      out[i] = static_cast<at::BFloat16>(total);
    }
  }
}

// own_slot: this rank's slot (fp32 view, >= n); values: the round's slots (fp32 [size, >= n]); seqs: the address of
// each rank's round number, this rank's at `rank`. Returns whether every rank arrived within `spin` checks (then x
// holds the sum); false: x untouched, the caller waits and calls shm_sum.
bool shm_all_reduce(at::Tensor x, at::Tensor own_slot, const at::Tensor& values, std::vector<int64_t> seqs,
                    int64_t rank, int64_t round, int64_t spin) {
  TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "shm_all_reduce: x must be contiguous fp32 or bf16");
  widen(x, own_slot.data_ptr<float>());
  __atomic_store_n(reinterpret_cast<int64_t*>(seqs[rank]), round, __ATOMIC_RELEASE);
  for (int64_t i = 0; i < spin; ++i) {
    bool all = true;
    for (const int64_t addr : seqs) {
      if (__atomic_load_n(reinterpret_cast<int64_t*>(addr), __ATOMIC_ACQUIRE) < round) {
        all = false;
        break;
      }
    }
    if (all) {
      shm_sum(x, values);
      return true;
    }
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return false;
}

}  // namespace pdserve
