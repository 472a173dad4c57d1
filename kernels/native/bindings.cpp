// The Python module of the native CPU kernels. The attention ops release the GIL while they compute, so the
// worker's I/O threads can run meanwhile; the short ops (a few microseconds per layer) keep it: taking the GIL
// back after each would let the I/O threads' Python run first and stall the step behind it.
#include <torch/extension.h>

#include "common.h"

namespace pdserve {
std::vector<at::Tensor> rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                const c10::optional<at::Tensor>& residual);
bool int8_linear_supported();
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const at::Tensor& col_scale,
                       const at::Tensor& col_sum, const at::Tensor& sum128, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& inv_smooth);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t k,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                       bool fp32_output);
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t k, at::ScalarType dtype);
at::Tensor rotary_store_kv(const at::Tensor& qkv, const at::Tensor& cos_sin, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale);
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, const at::Tensor& extend_lens,
                            const at::Tensor& q_start, double scale);
bool tiled_extend_supported(int64_t head_dim);
at::Tensor extend_attention_tiled(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& page_table, const at::Tensor& seq_lens,
                                  const at::Tensor& extend_lens, const at::Tensor& q_start, double scale);
at::Tensor row_sums(const at::Tensor& x);
int64_t dense_pair(const at::Tensor& weight);
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& residual, bool fp32_out);
bool gemv_supported(const at::Tensor& weight);
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight);
void apply_token_mask(at::Tensor logits, const at::Tensor& bitmask);
void lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                std::vector<int64_t> out_offsets, const at::Tensor& row_slots, const at::Tensor& ranks);
std::vector<at::Tensor> quantize_rows(const at::Tensor& x, const c10::optional<at::Tensor>& inv_smooth);
at::Tensor dequantize_rows(const at::Tensor& acc, const at::Tensor& scale, const at::Tensor& zero,
                           const at::Tensor& col_scale, const at::Tensor& col_sum, const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& residual);

void shm_sum(at::Tensor x, const at::Tensor& values);
bool shm_all_reduce(at::Tensor x, at::Tensor own_slot, const at::Tensor& values, std::vector<int64_t> seqs,
                    int64_t rank, int64_t round, int64_t spin);

// The vector paths this build compiled (see common.h): what a log line or a test needs to name the build.
std::string isa() {
#if defined(__AVX512BF16__)
  return "avx512-bf16";
#elif defined(PDSERVE_AVX512)
  return "avx512";
#elif defined(PDSERVE_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}
}  // namespace pdserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("rmsnorm", &pdserve::rmsnorm, release());
  m.def("shm_sum", &pdserve::shm_sum, release());
  m.def("shm_all_reduce", &pdserve::shm_all_reduce, release());
  m.def("silu_and_mul", &pdserve::silu_and_mul, release());
  m.def("rotary_store_kv", &pdserve::rotary_store_kv, release());
  m.def("row_sums", &pdserve::row_sums, release());
  m.def("dense_pair", &pdserve::dense_pair);
  m.def("dense_linear", &pdserve::dense_linear, release());
  m.def("gemv_supported", &pdserve::gemv_supported);
  m.def("gemv", &pdserve::gemv, release());
  m.def("decode_attention", &pdserve::decode_attention, release());
  m.def("extend_attention", &pdserve::extend_attention, release());
  m.def("tiled_extend_supported", &pdserve::tiled_extend_supported);
  m.def("extend_attention_tiled", &pdserve::extend_attention_tiled, release());
  m.def("apply_token_mask", &pdserve::apply_token_mask, release());
  m.def("lora_apply", &pdserve::lora_apply, release());
  m.def("quantize_rows", &pdserve::quantize_rows, release());
  m.def("dequantize_rows", &pdserve::dequantize_rows, release());
  m.def("int8_linear_supported", &pdserve::int8_linear_supported);
  m.def("int8_linear", &pdserve::int8_linear, release());
  m.def("gguf_linear", &pdserve::gguf_linear, release());
  m.def("gguf_dequantize", &pdserve::gguf_dequantize, release());
  m.def("isa", &pdserve::isa);
}
