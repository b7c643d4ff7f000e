// The entry points of Conveyor's CPU kernels (one extension module, several sources): bound to
// Python in bindings.cpp, and called from C++ by decode_layers_cpu.cpp.
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping);
std::tuple<torch::Tensor, torch::Tensor> argmax_rows(torch::Tensor x);
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor qgemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor qdequant(torch::Tensor w, int64_t K, at::ScalarType dtype);
torch::Tensor qembedding(torch::Tensor w, torch::Tensor ids, int64_t K, at::ScalarType dtype);
torch::Tensor qrepack(torch::Tensor w, int64_t K);
torch::Tensor krepack(torch::Tensor w, int64_t K, int64_t bytes);
bool quant_int8_native();
torch::Tensor linear_any(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
void set_gemv_prefetch_single(bool on);
bool gemv_prefetch_single();
std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    torch::Tensor x, std::vector<std::vector<torch::Tensor>> layers,
    std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches, torch::Tensor positions,
    std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin, std::vector<int64_t> windows,
    std::vector<torch::Tensor> slot_mappings, std::vector<torch::Tensor> block_tables, torch::Tensor context_lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool gelu);
