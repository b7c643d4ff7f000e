// Python bindings of Conveyor's CPU kernels (one extension module, several sources).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping);
std::tuple<torch::Tensor, torch::Tensor> argmax_rows(torch::Tensor x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("paged_decode", &paged_decode, "paged attention for decoding sequences (fp32 or bf16 cache)");
    m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (fp32 or bf16)");
    m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm(residual) (fp32 or bf16)");
    m.def("silu_mul", &silu_mul, "silu(gate) * up on a fused [T, 2I] input (fp32 or bf16)");
    m.def("rope_", &rope_, "rotate-half RoPE in place on [T, heads, d] (fp32 or bf16)");
    m.def("write_kv", &write_kv, "write new K and V rows into the paged caches through the slot mapping");
    m.def("argmax_rows", &argmax_rows, "greedy token per row: (first argmax, max or NaN if non-finite)");
}
