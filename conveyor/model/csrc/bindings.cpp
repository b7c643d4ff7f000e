// Python bindings of Conveyor's CPU kernels (one extension module, several sources).
// Only this file includes torch's Python bindings, and not torch/extension.h (all of the C++ API):
// the kernels include torch/types.h. A first build took 66 s on 2 cores instead of 102 (2026-12-05).
#include <torch/python.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("paged_decode", &paged_decode, "paged attention for decoding sequences (fp32 or bf16 cache)");
    m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (fp32 or bf16)");
    m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm(residual) (fp32 or bf16)");
    m.def("silu_mul", &silu_mul, "silu(gate) * up on a fused [T, 2I] input (fp32 or bf16)");
    m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu(gate, tanh approximation) * up on a fused [T, 2I] input (GeGLU)");
    m.def("rope_", &rope_, "rotate-half RoPE in place on [T, heads, d] (fp32 or bf16)");
    m.def("write_kv", &write_kv, "write new K and V rows into the paged caches through the slot mapping");
    m.def("gemv", &gemv, "x W^T (+ b) for a few token rows, streaming a plain row-major weight (fp32 or bf16)");
    m.def("qgemv", &qgemv, "x W^T (+ b) from a GGUF-quantized weight as stored (Q4_0, Q4_1, Q5_0, Q8_0; K-quants Q2_K-Q6_K in the x16 layout), any token count");
    m.def("qdequant", &qdequant, "a GGUF-quantized weight (either layout) to a dense fp32 or bf16 tensor");
    m.def("qembedding", &qembedding, "rows of a GGUF-quantized table (an embedding lookup), widened");
    m.def("qrepack", &qrepack, "a GGUF-quantized weight in the x16 layout of the int8 (AVX512-VNNI) kernel");
    m.def("krepack", &krepack, "a GGUF K-quant weight (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) in the 3-D x16 layout of the int8 kernel");
    m.def("quant_int8_native", &quant_int8_native, "whether the x16 layout runs on int8 dot products here (AVX512-VNNI or AVX2)");
    m.def("int8_amx", &int8_amx, "whether steps of int8_amx_tokens() tokens or more run the x16 layout on AMX tiles here");
    m.def("set_int8_amx", &set_int8_amx, "AMX tiles for the x16 layout's large steps on or off (the same results either way)");
    m.def("int8_amx_tokens", &int8_amx_tokens, "the fewest tokens of a step the x16 layout runs on AMX tiles");
    m.def("set_gemv_prefetch_single", &set_gemv_prefetch_single, "software prefetch in one-token GEMV passes (speed only)");
    m.def("gemv_prefetch_single", &gemv_prefetch_single, "whether one-token GEMV passes prefetch");
    m.def("set_attn_prefetch", &set_attn_prefetch, "tokens ahead attention asks for K/V rows into L2 (speed only)");
    m.def("attn_prefetch", &attn_prefetch, "tokens ahead paged attention asks for K/V rows into L2");
    m.def("decode_layers", &decode_layers, "every decoder layer of a decode step of a few tokens, matmuls on the GEMV");
    m.def("lora_sgmv_", &lora_sgmv_, "y[i] += (A_g x[i]) Bt_g for each row i of LoRA group g (rows sorted by group; in place; one call per matmul)");
    m.def("moe_experts", &moe_experts, "a MoE MLP over a step's tokens grouped by expert (gate/up, activation, down, weighted sums) in one call");
    m.def("argmax_rows", &argmax_rows, "greedy token per row: (first argmax, max or NaN if non-finite)");
}
