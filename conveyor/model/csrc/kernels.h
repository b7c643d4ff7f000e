// The entry points of Conveyor's CPU kernels (one extension module, several sources): bound to
// Python in bindings.cpp, and called from C++ by decode_layers_cpu.cpp.
#pragma once

#include <torch/types.h>

#include <tuple>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up);
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
bool int8_amx();
void set_int8_amx(bool on);
int64_t int8_amx_tokens();
void set_gemv_prefetch_single(bool on);
bool gemv_prefetch_single();
void set_attn_prefetch(int64_t tokens);
int64_t attn_prefetch();
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor tokens, std::vector<int64_t> counts,
                          std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down, torch::Tensor weights,
                          bool gelu);
void lora_sgmv_(torch::Tensor y, torch::Tensor x, torch::Tensor order, torch::Tensor starts,
                std::vector<torch::Tensor> a, std::vector<torch::Tensor> bt);
std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    torch::Tensor x, std::vector<std::vector<torch::Tensor>> layers,
    std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches, torch::Tensor positions,
    std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin, std::vector<int64_t> windows,
    std::vector<torch::Tensor> slot_mappings, std::vector<torch::Tensor> block_tables, torch::Tensor context_lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool gelu);

// ---- Raw entry points for the decode loop: no allocation, no torch op; inside a decode team
// (team.h) each computes the calling thread's share. Operands are checked by the caller first.

// y (rows ldy apart) = x W^T (+ bias), x: M rows of K (contiguous), a plain dense weight [N, K]; T fp32 or bf16.
template <typename T>
void gemv_raw(const T* x, int64_t M, int64_t K, const T* w, int64_t N, const T* bias, T* y, int64_t ldy);
// The same for any decode-layer weight: quantized (uint8, either layout) or dense in T.
template <typename T>
void linear_raw(const T* x, int64_t M, int64_t K, const torch::Tensor& w, const T* bias, T* y, int64_t ldy);
// Throws unless linear_raw takes w for K inputs in `dtype`; returns its output features.
int64_t linear_check(const torch::Tensor& w, int64_t K, at::ScalarType dtype);

// Per-thread buffers of the attention kernels.
struct AttnScratch {
    std::vector<float> scores, acc, row;
};

// A matmul's activations as two int8 terms per block of 32 (quant_cpu.cpp, quantize_into):
// q, q2 and per block their scales d, d2, the exact sum of x, and the sums of q, q2 (over the
// block and its first 16).
struct QuantActs {
    std::vector<int8_t> q, q2;
    std::vector<float> d, d2, sum;
    std::vector<int32_t> qsum, qsum2, qsum_lo, qsum2_lo;
};
// Grows X's buffers to hold M rows of K activations (no allocation when they already do).
void reserve_quant(QuantActs& X, int64_t M, int64_t K);

// The buffers a thread of a decode team reuses inside the region, sized before it starts so that
// nothing in the region allocates (decode_layers_cpu.cpp).
struct TeamScratch {
    QuantActs quant;          // a quantized matmul's input as int8 terms
    std::vector<float> xf;    // a bf16 input widened for the quantized kernels
    AttnScratch attn;
};
// Decode attention of G query heads (qs: G rows of d, fp32) sharing one KV head (kh, vh: that
// head of the caches [num_blocks, block_size, d]) for one sequence (table: its block table)
// over its tokens [first, L): fp32 outputs, G rows of d, to out.
template <typename T>
using AttnItemFn = void (*)(const float* qs, const T* kh, const T* vh, const int64_t* table, int64_t first, int64_t L,
                            int64_t bs, int64_t d, int64_t G, float* out, float scale, AttnScratch& scratch);
// The kernel for `heads` of the G query heads of a KV head of d dims, giving each head the bits
// paged_decode gives it (which computes all G together).
template <typename T>
AttnItemFn<T> attn_item_kernel(int64_t d, int64_t heads, int64_t G);
