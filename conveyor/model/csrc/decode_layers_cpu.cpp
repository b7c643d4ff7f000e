// The decoder layers of a decode step of a few tokens in one call: the same kernels, in the same
// order, as the Python layer loop (llama.py) with every matmul on the C++ GEMV -- so the same
// numbers -- without ~30 Python-level calls and torch ops per layer, which at batch 1 cost about
// a fifth of the step. A layer's weights may be GGUF-quantized (uint8, quant_cpu.cpp) or dense.
#include "kernels.h"

namespace {

// A layer's tensors, in this order; an empty tensor where the model has none (biases, qk-norms).
enum Slot { kInNorm, kQkv, kQkvBias, kO, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias, kQNorm, kKNorm, kSlots };

c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
    return t.numel() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

}  // namespace

// x: [M, hidden], the embeddings. Returns (last layer's MLP output, residual stream), as the
// Python loop.
std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    torch::Tensor x, std::vector<std::vector<torch::Tensor>> layers,
    std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches, torch::Tensor positions,
    torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
    TORCH_CHECK(layers.size() == k_caches.size() && layers.size() == v_caches.size(), "one cache pair per layer");
    const int64_t M = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    torch::Tensor res;   // the residual stream: x itself before the first layer's norm
    for (size_t i = 0; i < layers.size(); ++i) {
        const auto& w = layers[i];
        TORCH_CHECK(w.size() == kSlots, "layer tensors");
        torch::Tensor h;
        if (res.defined()) {
            h = add_rms_norm(x, res, w[kInNorm], eps);
        } else {
            h = rms_norm(x, w[kInNorm], eps);
            res = x;
        }
        auto qkv = linear_any(h, w[kQkv], maybe(w[kQkvBias]));
        auto q = qkv.narrow(1, 0, q_size).view({M, num_heads, head_dim});
        auto k = qkv.narrow(1, q_size, kv_size).view({M, num_kv_heads, head_dim});
        auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({M, num_kv_heads, head_dim});
        if (w[kQNorm].numel()) {
            q = rms_norm(q.contiguous(), w[kQNorm], eps);
            k = rms_norm(k.contiguous(), w[kKNorm], eps);
        }
        rope_(q, positions, cos, sin);
        rope_(k, positions, cos, sin);
        write_kv(k, v, k_caches[i], v_caches[i], slot_mapping);
        auto attn = paged_decode(q, k_caches[i], v_caches[i], block_tables, context_lens, scale, 0).view({M, q_size});
        h = add_rms_norm(linear_any(attn, w[kO], c10::nullopt), res, w[kPostNorm], eps);
        x = linear_any(silu_mul(linear_any(h, w[kGateUp], maybe(w[kGateUpBias]))), w[kDown], maybe(w[kDownBias]));
    }
    return {x, res};
}
