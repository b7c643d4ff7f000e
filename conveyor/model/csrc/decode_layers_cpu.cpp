// The decoder layers of a decode step of a few tokens in one call: the same kernels, in the same
// order, as the Python layer loop (llama.py) with every matmul on the C++ GEMV -- so the same
// numbers -- without ~30 Python-level calls and torch ops per layer, which at batch 1 cost about
// a fifth of the step. A layer's weights may be GGUF-quantized (uint8, quant_cpu.cpp) or dense.
// Llama layers and Gemma 3's: norms after attention and the MLP too, GeGLU, a per-layer window and
// RoPE table, q/k/v in up to three pieces of different types (quant.QuantConcat).
#include "kernels.h"

#include <ATen/ATen.h>

namespace {

// A layer's tensors, in this order; an empty tensor where the model has none (biases, qk-norms,
// Gemma's extra norms, the second and third q/k/v pieces).
enum Slot {
    kInNorm, kQkv, kQkvBias, kO, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias, kQNorm, kKNorm,
    kQkvB, kQkvC, kAttnOutNorm, kMlpOutNorm, kSlots
};

c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
    return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

}  // namespace

// x: [M, hidden], the embeddings. Returns (last layer's MLP output, residual stream), as the
// Python loop. Per layer: its RoPE tables (cos, sin) and attention window (0: global). Slot
// mappings and block tables: one for every layer, or one per layer (layer groups with their own tables).
std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    torch::Tensor x, std::vector<std::vector<torch::Tensor>> layers,
    std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches, torch::Tensor positions,
    std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin, std::vector<int64_t> windows,
    std::vector<torch::Tensor> slot_mappings, std::vector<torch::Tensor> block_tables, torch::Tensor context_lens, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool gelu) {
    const size_t L = layers.size();
    TORCH_CHECK(k_caches.size() == L && v_caches.size() == L && cos.size() == L && sin.size() == L &&
                windows.size() == L, "one cache pair, RoPE table and window per layer");
    TORCH_CHECK((slot_mappings.size() == 1 || slot_mappings.size() == L) && block_tables.size() == slot_mappings.size(),
                "one slot mapping and block table, or one per layer");
    const int64_t M = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    torch::Tensor res;   // the residual stream: x itself before the first layer's norm
    for (size_t i = 0; i < L; ++i) {
        const auto& w = layers[i];
        TORCH_CHECK(w.size() == kSlots, "layer tensors");
        torch::Tensor h;
        if (res.defined()) {
            h = add_rms_norm(x, res, w[kInNorm], eps);
        } else {
            h = rms_norm(x, w[kInNorm], eps);
            res = x;
        }
        torch::Tensor qkv;
        if (w[kQkvB].numel()) {   // pieces of different types: side by side, the fused bias once
            std::vector<torch::Tensor> parts{linear_any(h, w[kQkv], c10::nullopt), linear_any(h, w[kQkvB], c10::nullopt)};
            if (w[kQkvC].numel()) parts.push_back(linear_any(h, w[kQkvC], c10::nullopt));
            qkv = at::cat(parts, -1);
            if (w[kQkvBias].numel()) qkv.add_(w[kQkvBias]);
        } else {
            qkv = linear_any(h, w[kQkv], maybe(w[kQkvBias]));
        }
        auto q = qkv.narrow(1, 0, q_size).view({M, num_heads, head_dim});
        auto k = qkv.narrow(1, q_size, kv_size).view({M, num_kv_heads, head_dim});
        auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({M, num_kv_heads, head_dim});
        if (w[kQNorm].numel()) {
            q = rms_norm(q.contiguous(), w[kQNorm], eps);
            k = rms_norm(k.contiguous(), w[kKNorm], eps);
        }
        rope_(q, positions, cos[i], sin[i]);
        rope_(k, positions, cos[i], sin[i]);
        const size_t t = slot_mappings.size() == 1 ? 0 : i;
        write_kv(k, v, k_caches[i], v_caches[i], slot_mappings[t]);
        auto attn = paged_decode(q, k_caches[i], v_caches[i], block_tables[t], context_lens, scale, windows[i])
                        .view({M, q_size});
        auto o = linear_any(attn, w[kO], c10::nullopt);
        if (w[kAttnOutNorm].numel()) o = rms_norm(o, w[kAttnOutNorm], eps);
        h = add_rms_norm(o, res, w[kPostNorm], eps);
        auto gate_up = linear_any(h, w[kGateUp], maybe(w[kGateUpBias]));
        torch::Tensor act;
        if (gelu) {
            auto halves = gate_up.chunk(2, -1);
            act = at::gelu(halves[0], "tanh") * halves[1];
        } else {
            act = silu_mul(gate_up);
        }
        x = linear_any(act, w[kDown], maybe(w[kDownBias]));
        if (w[kMlpOutNorm].numel()) x = rms_norm(x, w[kMlpOutNorm], eps);
    }
    return {x, res};
}
