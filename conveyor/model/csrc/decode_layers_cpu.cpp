// The decoder layers of a decode step of a few tokens in one call: the same kernels, in the same
// order, as the Python layer loop (llama.py) with every matmul on the C++ GEMV -- so the same
// numbers -- without ~30 Python-level calls and torch ops per layer. A layer's weights may be
// GGUF-quantized (uint8, quant_cpu.cpp) or dense. Llama layers and Gemma 3's: norms after
// attention and the MLP too, GeGLU, a per-layer window and RoPE table, q/k/v in up to three pieces
// of different types (quant.QuantConcat).
//
// The whole loop is one OpenMP parallel region (a decode team, team.h): each kernel computes the
// calling thread's share of its rows, and the threads meet at a barrier where a phase needs the
// whole of the previous one's output -- six per layer -- instead of a fork and a join per kernel
// (~6 per layer) and a dozen tensor allocations. Work too small to share (norms, the residual,
// the MLP's activation, a quantized matmul's int8 input) is done by every thread for itself, into
// its own buffers, which saves the barrier it would otherwise need; RoPE and the cache writes by
// the first thread. Every buffer is made and every operand checked before the region: inside it
// nothing allocates or throws (an exception cannot leave an OpenMP region).
#include "kernels.h"
#include "rowops.h"
#include "team.h"

#include <ATen/ATen.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <cstring>

namespace {

using conveyor::narrow;
using conveyor::widen;

// A layer's tensors, in this order; an empty tensor where the model has none (biases, qk-norms,
// Gemma's extra norms, the second and third q/k/v pieces).
enum Slot {
    kInNorm, kQkv, kQkvBias, kO, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias, kQNorm, kKNorm,
    kQkvB, kQkvC, kAttnOutNorm, kMlpOutNorm, kSlots
};

inline void barrier() {
#if defined(_OPENMP)
#pragma omp barrier
#endif
}

template <typename T>
const T* ptr_or_null(const torch::Tensor& t) {
    return t.numel() ? t.data_ptr<T>() : nullptr;
}

// Everything a step needs, checked before the threads start: inside the region no call may throw.
struct Shapes {
    int64_t M, hid, H, KVH, hd, q_size, kv_size, qkv_w, max_inter;
    float eps, scale;
    bool gelu;
};

// A layer's matmul widths: the q/k/v pieces' (0: no such piece) and the MLP's intermediate size.
struct Widths {
    int64_t qkv[3];
    int64_t inter;
};

Widths check_layer(const std::vector<torch::Tensor>& w, const Shapes& s, at::ScalarType dt) {
    Widths out{{0, 0, 0}, 0};
    TORCH_CHECK(w.size() == kSlots, "layer tensors");
    auto vec = [&](int slot, int64_t n, const char* what) {
        if (!w[slot].numel()) return;
        TORCH_CHECK(w[slot].is_contiguous() && w[slot].scalar_type() == dt && w[slot].numel() == n, what,
                    ": contiguous, the activations' dtype, ", n, " values");
    };
    vec(kInNorm, s.hid, "input norm");
    vec(kPostNorm, s.hid, "post-attention norm");
    TORCH_CHECK(w[kInNorm].numel() && w[kPostNorm].numel(), "the layer's norms");
    vec(kQNorm, s.hd, "q norm");
    vec(kKNorm, s.hd, "k norm");
    TORCH_CHECK(!w[kQNorm].numel() == !w[kKNorm].numel(), "q and k norms together");
    vec(kAttnOutNorm, s.hid, "attention output norm");
    vec(kMlpOutNorm, s.hid, "MLP output norm");
    TORCH_CHECK(!w[kQkvC].numel() || w[kQkvB].numel(), "a third q/k/v piece without a second");
    int64_t n = 0;
    for (int p = 0; p < 3; ++p) {
        const auto& piece = w[p == 0 ? kQkv : p == 1 ? kQkvB : kQkvC];
        if (piece.numel()) n += out.qkv[p] = linear_check(piece, s.hid, dt);
    }
    TORCH_CHECK(n == s.qkv_w, "q/k/v output features ", n, ", expected ", s.qkv_w);
    vec(kQkvBias, s.qkv_w, "q/k/v bias");
    TORCH_CHECK(linear_check(w[kO], s.q_size, dt) == s.hid, "o projection shape");
    const int64_t gu = linear_check(w[kGateUp], s.hid, dt);
    TORCH_CHECK(gu % 2 == 0, "gate/up output features");
    out.inter = gu / 2;
    vec(kGateUpBias, gu, "gate/up bias");
    TORCH_CHECK(linear_check(w[kDown], out.inter, dt) == s.hid, "down projection shape");
    vec(kDownBias, s.hid, "down bias");
    return out;
}

template <typename T>
std::tuple<torch::Tensor, torch::Tensor> run_layers(
    const torch::Tensor& x, const std::vector<std::vector<torch::Tensor>>& layers, const std::vector<torch::Tensor>& k_caches,
    const std::vector<torch::Tensor>& v_caches, const int64_t* pos, const std::vector<torch::Tensor>& cos,
    const std::vector<torch::Tensor>& sin, const std::vector<int64_t>& windows, const std::vector<torch::Tensor>& slots,
    const std::vector<torch::Tensor>& tables, const int64_t* lens, const std::vector<Widths>& widths, const Shapes& s) {
    const int64_t L = (int64_t)layers.size(), M = s.M, hid = s.hid, hd = s.hd, H = s.H, KVH = s.KVH;
    const int64_t G = H / KVH, half = hd / 2, qkv_w = s.qkv_w;
    auto opts = x.options();
    // Shared buffers: the residual stream (two, alternating: a phase reads one while the first
    // thread writes the other), q/k/v, attention output, o, gate/up, the MLP's output.
    torch::Tensor res[2] = {torch::empty({M, hid}, opts), torch::empty({M, hid}, opts)};
    auto qkv = torch::empty({M, qkv_w}, opts), attn = torch::empty({M, s.q_size}, opts);
    auto o = torch::empty({M, hid}, opts), gate_up = torch::empty({M, 2 * s.max_inter}, opts);
    auto xo = torch::empty({M, hid}, opts);
    T *qkv_p = qkv.data_ptr<T>(), *attn_p = attn.data_ptr<T>(), *o_p = o.data_ptr<T>(), *gu_p = gate_up.data_ptr<T>();
    T* xo_p = xo.data_ptr<T>();
    T* res_p[2] = {res[0].data_ptr<T>(), res[1].data_ptr<T>()};
    const T* x_p = x.data_ptr<T>();
    // Attention work items: (sequence, KV head, a share of its G query heads). One item per KV head
    // reads each K/V row once for all G heads, which outweighs an uneven share (demo model, one
    // sequence, 3 KV heads on 2 threads: 4.8 us a layer at 128 tokens of context against 7.4 with
    // the 9 query heads shared out one by one; 25 against 53 us at 1024), so the G heads are split
    // only where there are fewer KV heads than threads. A head's numbers do not depend on the heads
    // computed beside it: the same bits either way.
    const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
    int64_t splits = 1;
    while (M * KVH * splits < threads && splits < G) {
        do ++splits;
        while (G % splits);
    }
    const int64_t per_item = G / splits, items = M * KVH * splits;
    const AttnItemFn<T> attend = attn_item_kernel<T>(hd, per_item, G);
    // Every thread's own buffers, made here (inside the region nothing allocates): torch's, for
    // the same 64-byte alignment as the shared buffers whose rows the first thread computes into
    // (a vectorized loop may take another path on another alignment, and the bits must agree).
#if defined(_OPENMP)
    const int slots_n = std::max(threads, omp_get_max_threads());
#else
    const int slots_n = 1;
#endif
    int64_t max_len = 1, max_k = std::max({hid, s.q_size, s.max_inter});
    for (int64_t m = 0; m < M; ++m) max_len = std::max(max_len, lens[m]);
    std::vector<torch::Tensor> own_h, own_r, own_xn, own_act;
    std::vector<TeamScratch> scratch(slots_n);
    for (int t = 0; t < slots_n; ++t) {
        own_h.push_back(torch::empty({M, hid}, opts));
        own_r.push_back(torch::empty({M, hid}, opts));
        own_xn.push_back(torch::empty({std::max(M * hid, hd)}, opts));
        own_act.push_back(torch::empty({M, s.max_inter}, opts));
        reserve_quant(scratch[t].quant, M, max_k);
        scratch[t].xf.resize(M * max_k);
        scratch[t].attn.scores.reserve(per_item * max_len);
        scratch[t].attn.acc.reserve(per_item * hd);
        scratch[t].attn.row.reserve(hd);
    }
    auto own_floats = torch::empty({slots_n, 2, per_item * hd}, opts.dtype(torch::kFloat32));

#if defined(_OPENMP)
#pragma omp parallel
#endif
    {
#if defined(_OPENMP)
        const int id = omp_get_thread_num(), size = omp_get_num_threads();
#else
        const int id = 0, size = 1;
#endif
        const conveyor::Team tm{id, size, &scratch[id]};
        conveyor::TeamScope scope(&tm);
        const bool first = id == 0;
        T *h = own_h[id].data_ptr<T>(), *r = own_r[id].data_ptr<T>(), *xn = own_xn[id].data_ptr<T>();
        T* act = own_act[id].data_ptr<T>();
        float* qf = own_floats.data_ptr<float>() + 2 * id * per_item * hd;
        float* of = qf + per_item * hd;
        const T* res_cur = x_p;   // the residual stream so far (the embeddings before the first layer)
        int next = 0;             // the shared residual buffer written next
        // h = norm(residual + src) per row, the new residual also to res_p[next] (by the first thread).
        auto add_norm = [&](const T* src, const T* w) {
            T* rr = first ? res_p[next] : r;
            std::memcpy(rr, res_cur, M * hid * sizeof(T));
            for (int64_t m = 0; m < M; ++m) {
                conveyor::add_row(rr + m * hid, src + m * hid, hid);
                conveyor::rms_row(rr + m * hid, w, h + m * hid, hid, s.eps);
            }
            res_cur = res_p[next];   // (read only after the next barrier, once the first thread wrote it)
            next ^= 1;
        };
        auto norm_rows = [&](const T* src, const T* w, T* out) {
            for (int64_t m = 0; m < M; ++m) conveyor::rms_row(src + m * hid, w, out + m * hid, hid, s.eps);
        };
        for (int64_t i = 0; i < L; ++i) {
            const auto& w = layers[i];
            // Input norm (the first layer: of the embeddings, which are the residual).
            if (i == 0) {
                norm_rows(x_p, w[kInNorm].data_ptr<T>(), h);
            } else {
                const T* src = xo_p;
                if (layers[i - 1][kMlpOutNorm].numel()) {   // Gemma: the previous MLP's output normed
                    norm_rows(xo_p, layers[i - 1][kMlpOutNorm].data_ptr<T>(), xn);
                    src = xn;
                }
                add_norm(src, w[kInNorm].data_ptr<T>());
            }
            // q/k/v: pieces of different types side by side, their bias added once afterwards.
            const bool pieces = w[kQkvB].numel() > 0;
            for (int p = 0, col = 0; p < 3 && widths[i].qkv[p]; col += widths[i].qkv[p++])
                linear_raw<T>(h, M, hid, w[p == 0 ? kQkv : p == 1 ? kQkvB : kQkvC],
                              pieces ? nullptr : ptr_or_null<T>(w[kQkvBias]), qkv_p + col, qkv_w);
            barrier();
            // q/k norms, RoPE, the new K/V rows into the cache.
            const size_t t = slots.size() == 1 ? 0 : i;
            const int64_t* slot = slots[t].data_ptr<int64_t>();
            T* kc = k_caches[i].data_ptr<T>();
            T* vc = v_caches[i].data_ptr<T>();
            const int64_t head_stride = k_caches[i].size(1) * k_caches[i].size(2) * hd;
            if (first) {
                const float *cp = cos[i].data_ptr<float>(), *sp = sin[i].data_ptr<float>();
                const T* qn = ptr_or_null<T>(w[kQNorm]);
                const T* kn = ptr_or_null<T>(w[kKNorm]);
                for (int64_t m = 0; m < M; ++m) {
                    T* row = qkv_p + m * qkv_w;
                    if (pieces && w[kQkvBias].numel()) conveyor::add_row(row, w[kQkvBias].data_ptr<T>(), qkv_w);
                    for (int64_t j = 0; j < H + KVH; ++j) {
                        T* v = row + j * hd;
                        if (qn) {
                            conveyor::rms_row(v, j < H ? qn : kn, xn, hd, s.eps);
                            std::memcpy(v, xn, hd * sizeof(T));
                        }
                        conveyor::rope_row(v, cp + pos[m] * half, sp + pos[m] * half, half);
                    }
                    for (int64_t j = 0; j < KVH; ++j) {
                        std::memcpy(kc + j * head_stride + slot[m] * hd, row + (H + j) * hd, hd * sizeof(T));
                        std::memcpy(vc + j * head_stride + slot[m] * hd, row + (H + KVH + j) * hd, hd * sizeof(T));
                    }
                }
            }
            barrier();
            // Attention.
            {
                const int64_t* table = tables[t].data_ptr<int64_t>();
                const int64_t mb = tables[t].size(1), bs = k_caches[i].size(2), window = windows[i];
                conveyor::parallel_for(0, items, 1, [&](int64_t b, int64_t e) {
                    for (int64_t item = b; item < e; ++item) {
                        const int64_t seq = item / (KVH * splits), kvh = item % (KVH * splits) / splits;
                        const int64_t q0 = kvh * G + item % splits * per_item;
                        const T* qs = qkv_p + seq * qkv_w + q0 * hd;
                        for (int64_t k = 0; k < per_item * hd; ++k) qf[k] = widen(qs[k]);
                        const int64_t len = lens[seq], start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
                        attend(qf, kc + kvh * head_stride, vc + kvh * head_stride, table + seq * mb, start, len, bs,
                               hd, per_item, of, s.scale, tm.scratch->attn);
                        T* out = attn_p + seq * s.q_size + q0 * hd;
                        for (int64_t k = 0; k < per_item * hd; ++k) narrow(of[k], out + k);
                    }
                });
            }
            barrier();
            linear_raw<T>(attn_p, M, s.q_size, w[kO], nullptr, o_p, hid);
            barrier();
            // Post-attention norm (Gemma: the attention output normed first).
            const T* src = o_p;
            if (w[kAttnOutNorm].numel()) {
                norm_rows(o_p, w[kAttnOutNorm].data_ptr<T>(), xn);
                src = xn;
            }
            add_norm(src, w[kPostNorm].data_ptr<T>());
            const int64_t inter = widths[i].inter, gu = 2 * inter;
            linear_raw<T>(h, M, hid, w[kGateUp], ptr_or_null<T>(w[kGateUpBias]), gu_p, gu);
            barrier();
            for (int64_t m = 0; m < M; ++m) {   // the MLP's activation, every thread for itself
                const T* g = gu_p + m * gu;
                if (s.gelu) conveyor::gelu_tanh_mul_row(g, g + inter, act + m * inter, inter);
                else conveyor::silu_mul_row(g, g + inter, act + m * inter, inter);
            }
            linear_raw<T>(act, M, inter, w[kDown], ptr_or_null<T>(w[kDownBias]), xo_p, hid);
            barrier();
        }
    }
    torch::Tensor out = xo;
    if (layers.back()[kMlpOutNorm].numel()) out = rms_norm(xo, layers.back()[kMlpOutNorm], s.eps);
    // The first layer adds to the residual once, every later one twice: 2L - 1 writes alternating
    // from res[0], so the last one went to res[0].
    return {out, res[0]};
}

}  // namespace

// x: [M, hidden], the embeddings of M sequences' new tokens (one each). Returns (last layer's MLP
// output, residual stream), as the Python loop. Per layer: its RoPE tables (cos, sin) and attention
// window (0: global). Slot mappings and block tables: one for every layer, or one per layer (layer
// groups with their own tables).
std::tuple<torch::Tensor, torch::Tensor> decode_layers(
    torch::Tensor x, std::vector<std::vector<torch::Tensor>> layers,
    std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches, torch::Tensor positions,
    std::vector<torch::Tensor> cos, std::vector<torch::Tensor> sin, std::vector<int64_t> windows,
    std::vector<torch::Tensor> slot_mappings, std::vector<torch::Tensor> block_tables, torch::Tensor context_lens, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, bool gelu) {
    const size_t L = layers.size();
    TORCH_CHECK(L > 0, "at least one layer");
    TORCH_CHECK(k_caches.size() == L && v_caches.size() == L && cos.size() == L && sin.size() == L &&
                windows.size() == L, "one cache pair, RoPE table and window per layer");
    TORCH_CHECK((slot_mappings.size() == 1 || slot_mappings.size() == L) && block_tables.size() == slot_mappings.size(),
                "one slot mapping and block table, or one per layer");
    const auto dt = x.scalar_type();
    TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16, "fp32 or bf16 activations");
    TORCH_CHECK(x.dim() == 2 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim % 2 == 0, "shapes");
    x = x.contiguous();
    Shapes s{x.size(0), x.size(1), num_heads, num_kv_heads, head_dim, num_heads * head_dim, num_kv_heads * head_dim,
             (num_heads + 2 * num_kv_heads) * head_dim, 0, (float)eps, (float)scale, gelu};
    std::vector<Widths> widths;
    for (const auto& w : layers) {
        widths.push_back(check_layer(w, s, dt));
        s.max_inter = std::max(s.max_inter, widths.back().inter);
    }
    for (size_t i = 0; i < L; ++i) {
        for (const auto* c : {&k_caches[i], &v_caches[i]})
            TORCH_CHECK(c->is_contiguous() && c->scalar_type() == dt && c->dim() == 4 && c->size(0) == num_kv_heads &&
                            c->size(3) == head_dim, "caches [kv heads, blocks, block size, head dim] in the activations' dtype");
        for (const auto* t : {&cos[i], &sin[i]})
            TORCH_CHECK(t->is_contiguous() && t->scalar_type() == torch::kFloat32 && t->dim() == 2 &&
                            t->size(1) == head_dim / 2 && t->size(0) == cos[i].size(0),
                        "fp32 RoPE tables [positions, head_dim / 2]");
    }
    auto pos = positions.to(torch::kInt64).contiguous();
    auto lens = context_lens.to(torch::kInt64).contiguous();
    TORCH_CHECK(pos.numel() == s.M && lens.numel() == s.M, "one position and context length per token");
    const int64_t* pp = pos.data_ptr<int64_t>();
    const int64_t* lp = lens.data_ptr<int64_t>();
    int64_t table_len = cos[0].size(0);
    for (const auto& c : cos) table_len = std::min(table_len, c.size(0));
    for (int64_t m = 0; m < s.M; ++m)
        TORCH_CHECK(pp[m] >= 0 && pp[m] < table_len && lp[m] > 0, "position beyond the RoPE tables or empty context");
    for (size_t t = 0; t < slot_mappings.size(); ++t) {
        slot_mappings[t] = slot_mappings[t].to(torch::kInt64).contiguous();
        block_tables[t] = block_tables[t].to(torch::kInt64).contiguous();
        TORCH_CHECK(slot_mappings[t].numel() == s.M && block_tables[t].dim() == 2 && block_tables[t].size(0) == s.M,
                    "a slot and a block table row per token");
    }
    if (dt == torch::kFloat32)
        return run_layers<float>(x, layers, k_caches, v_caches, pp, cos, sin, windows, slot_mappings, block_tables, lp,
                                 widths, s);
    return run_layers<at::BFloat16>(x, layers, k_caches, v_caches, pp, cos, sin, windows, slot_mappings, block_tables, lp,
                                    widths, s);
}
