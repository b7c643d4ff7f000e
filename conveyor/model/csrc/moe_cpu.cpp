// A mixture-of-experts MLP over a step's tokens in one call: the (token, expert) pairs grouped by
// expert, each expert the step touches runs once over its tokens -- gate/up, activation, down --
// and each token's outputs are summed with its routing weights. One OpenMP parallel region (a
// decode team, team.h) with a barrier between the phases, instead of ~6 torch ops and two kernel
// calls (each a fork and a join) per expert from Python. The same kernels (linear_raw: quantized,
// or the dense GEMV), the same activation rows and the same rounding of each product and sum as
// the Python loop (llama.py SparseMoE), so the same bits: out = 0; for each expert in ascending
// order, for each of its tokens t: out[t] += round(y * w), in the activations' dtype.
#include "kernels.h"
#include "rowops.h"
#include "team.h"

#include <ATen/ATen.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using conveyor::narrow;
using conveyor::widen;

inline void barrier() {
#if defined(_OPENMP)
#pragma omp barrier
#endif
}

// fp32 bits -> the nearest bf16's (ties to even; NaN -> the canonical quiet NaN), in fp32 bits:
// c10::BFloat16's rounding, written so that a loop of it vectorizes.
inline uint32_t bf16_bits(uint32_t u) {
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : rounded;
}

// out[c] = round(acc[c] + round(y[c] * w)) for c in [c0, c1), acc kept as that rounded value:
// torch's `out.add_(y * w)` (and index_add_) in T, each product and sum rounded to T, no fused
// multiply-add (the bits must be torch's).
__attribute__((optimize("no-fast-math", "fp-contract=off")))
void add_scaled(float* acc, const float* y, float w, float* out, int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
        const float p = y[c] * w;
        out[c] = acc[c] = acc[c] + p;
    }
}

__attribute__((optimize("no-fast-math", "fp-contract=off")))
void add_scaled(float* acc, const at::BFloat16* y, at::BFloat16 w, at::BFloat16* out, int64_t c0, int64_t c1) {
    const uint16_t* yb = reinterpret_cast<const uint16_t*>(y);
    uint16_t* ob = reinterpret_cast<uint16_t*>(out);
    const float wf = widen(w);
    for (int64_t c = c0; c < c1; ++c) {
        uint32_t u = (uint32_t)yb[c] << 16;
        float v;
        std::memcpy(&v, &u, 4);
        v *= wf;
        std::memcpy(&u, &v, 4);
        u = bf16_bits(u);
        std::memcpy(&v, &u, 4);
        v += acc[c];
        std::memcpy(&u, &v, 4);
        u = bf16_bits(u);
        std::memcpy(&acc[c], &u, 4);
        ob[c] = (uint16_t)(u >> 16);
    }
}

template <typename T>
torch::Tensor moe_experts_impl(const torch::Tensor& x, const torch::Tensor& tokens, const std::vector<int64_t>& counts,
                               const std::vector<torch::Tensor>& gate_up, const std::vector<torch::Tensor>& down,
                               const torch::Tensor& weights, bool gelu) {
    const int64_t T_ = x.size(0), H = x.size(1), U = (int64_t)gate_up.size(), P = tokens.numel();
    const auto dtype = x.scalar_type();
    const int64_t gu = linear_check(gate_up[0], H, dtype), inter = gu / 2;
    TORCH_CHECK(gu % 2 == 0, "gate/up of an even width");
    std::vector<int64_t> starts(U + 1, 0);
    int64_t most = 1;
    for (int64_t u = 0; u < U; ++u) {
        TORCH_CHECK(linear_check(gate_up[u], H, dtype) == gu, "experts of one width");
        TORCH_CHECK(linear_check(down[u], inter, dtype) == H, "down [hidden, intermediate]");
        TORCH_CHECK(counts[u] > 0, "an expert with no token");
        starts[u + 1] = starts[u] + counts[u];
        most = std::max(most, counts[u]);
    }
    TORCH_CHECK(starts[U] == P, "the counts add up to the (token, expert) pairs");
    const int64_t* tp = tokens.data_ptr<int64_t>();
    for (int64_t p = 0; p < P; ++p) TORCH_CHECK(tp[p] >= 0 && tp[p] < T_, "token index out of range");
    const auto opts = x.options();
    auto xg = torch::empty({P, H}, opts), h = torch::empty({P, gu}, opts), act = torch::empty({P, inter}, opts);
    auto y = torch::empty({P, H}, opts), out = torch::zeros({T_, H}, opts);
    auto acc = torch::zeros({T_, H}, opts.dtype(torch::kFloat32));
    const T* xp = x.data_ptr<T>();
    const T* wp = weights.data_ptr<T>();
    T *xgp = xg.data_ptr<T>(), *hp = h.data_ptr<T>(), *ap = act.data_ptr<T>(), *yp = y.data_ptr<T>();
    T* op = out.data_ptr<T>();
    float* accp = acc.data_ptr<float>();
    const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
#if defined(_OPENMP)
    const int slots_n = std::max(threads, omp_get_max_threads());
#else
    const int slots_n = 1;
#endif
    std::vector<TeamScratch> scratch(slots_n);   // (inside the region nothing allocates)
    for (auto& s : scratch) {
        reserve_quant(s.quant, most, std::max(H, inter));
        s.xf.resize(most * std::max(H, inter));
    }
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
#endif
    {
#if defined(_OPENMP)
        const int id = omp_get_thread_num(), size = omp_get_num_threads();
#else
        const int id = 0, size = 1;
#endif
        const conveyor::Team tm{id, size, &scratch[id]};
        conveyor::TeamScope scope(&tm);
        conveyor::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {   // each pair's token, grouped by expert
            for (int64_t p = p0; p < p1; ++p) std::memcpy(xgp + p * H, xp + tp[p] * H, H * sizeof(T));
        });
        barrier();
        for (int64_t u = 0; u < U; ++u)
            linear_raw<T>(xgp + starts[u] * H, counts[u], H, gate_up[u], nullptr, hp + starts[u] * gu, gu);
        barrier();
        conveyor::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
            for (int64_t p = p0; p < p1; ++p) {
                const T* g = hp + p * gu;
                if (gelu) conveyor::gelu_tanh_mul_row(g, g + inter, ap + p * inter, inter);
                else conveyor::silu_mul_row(g, g + inter, ap + p * inter, inter);
            }
        });
        barrier();
        for (int64_t u = 0; u < U; ++u)
            linear_raw<T>(ap + starts[u] * inter, counts[u], inter, down[u], nullptr, yp + starts[u] * H, H);
        barrier();
        conveyor::parallel_for(0, H, 64, [&](int64_t c0, int64_t c1) {   // pairs in order: experts ascending
            for (int64_t p = 0; p < P; ++p)
                add_scaled(accp + tp[p] * H, yp + p * H, wp[p], op + tp[p] * H, c0, c1);
        });
    }
    return out;
}

}  // namespace

// x: [T, H] (fp32 or bf16); the step's (token, expert) pairs grouped by expert, experts ascending:
// tokens [P] (int64, each pair's row of x), counts [U] (pairs per expert, each > 0), gate_up[u]
// [2I, H] and down[u] [H, I] of those U experts (quantized as linear_raw takes them, or dense in x's
// dtype), weights [P] (each pair's routing weight, x's dtype). Returns [T, H]: per token the sum of
// its experts' down(act(gate_up x)) times their weights, in the pairs' order.
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor tokens, std::vector<int64_t> counts,
                          std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down, torch::Tensor weights,
                          bool gelu) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x [T, H], contiguous");
    TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size() && gate_up.size() == counts.size(),
                "one gate/up, one down and one count per expert");
    TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous(), "tokens [P] int64");
    TORCH_CHECK(weights.dim() == 1 && weights.numel() == tokens.numel() && weights.is_contiguous() &&
                weights.scalar_type() == x.scalar_type(), "weights [P] in x's dtype");
    if (x.scalar_type() == torch::kBFloat16)
        return moe_experts_impl<at::BFloat16>(x, tokens, counts, gate_up, down, weights, gelu);
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "fp32 or bf16 x only");
    return moe_experts_impl<float>(x, tokens, counts, gate_up, down, weights, gelu);
}
