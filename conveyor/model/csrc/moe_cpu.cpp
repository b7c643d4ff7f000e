// One token through its k routed experts (a mixture-of-experts MLP at batch 1) in one call: the
// k experts' gate/up matmuls, their activations, their down matmuls and the weighted sum, in one
// OpenMP parallel region (a decode team, team.h) with a barrier between the phases, instead of
// ~5 torch ops and two kernel calls (each a fork and a join) per expert from Python. The same
// kernels (linear_raw: quantized or the dense GEMV), the same activation rows and the same
// rounding of each product and sum as the Python loop (llama.py SparseMoE), so the same bits:
// out = 0; for each expert e in ascending order: out += round(y_e * w_e), in the activations' dtype.
#include "kernels.h"
#include "rowops.h"
#include "team.h"

#include <ATen/ATen.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <vector>

namespace {

using conveyor::narrow;
using conveyor::widen;

inline void barrier() {
#if defined(_OPENMP)
#pragma omp barrier
#endif
}

// out[c] = round(out[c] + round(y[c] * w)) for c in [c0, c1): torch's `out.add_(y * w)` in T, each
// product and sum rounded (no fused multiply-add: the bits must be torch's).
template <typename T>
__attribute__((optimize("no-fast-math", "fp-contract=off")))
void add_scaled(float* acc, const T* y, T w, T* out, int64_t c0, int64_t c1, bool last) {
    const float wf = widen(w);
    for (int64_t c = c0; c < c1; ++c) {
        T p, s;
        narrow(widen(y[c]) * wf, &p);
        narrow(acc[c] + widen(p), &s);
        acc[c] = widen(s);
        if (last) out[c] = s;
    }
}

template <typename T>
torch::Tensor moe_token_impl(const torch::Tensor& x, const std::vector<torch::Tensor>& gate_up,
                             const std::vector<torch::Tensor>& down, const torch::Tensor& weights, bool gelu) {
    const int64_t H = x.size(1), k = (int64_t)gate_up.size();
    const auto dtype = x.scalar_type();
    const int64_t gu = linear_check(gate_up[0], H, dtype), inter = gu / 2;
    TORCH_CHECK(gu % 2 == 0, "gate/up of an even width");
    for (int64_t j = 0; j < k; ++j) {
        TORCH_CHECK(linear_check(gate_up[j], H, dtype) == gu, "experts of one width");
        TORCH_CHECK(linear_check(down[j], inter, dtype) == H, "down [hidden, intermediate]");
    }
    const auto opts = x.options();
    auto h = torch::empty({k, gu}, opts), act = torch::empty({k, inter}, opts), y = torch::empty({k, H}, opts);
    auto out = torch::empty({1, H}, opts);
    auto acc = torch::zeros({H}, opts.dtype(torch::kFloat32));
    const T* xp = x.data_ptr<T>();
    const T* wp = weights.data_ptr<T>();
    T *hp = h.data_ptr<T>(), *ap = act.data_ptr<T>(), *yp = y.data_ptr<T>(), *op = out.data_ptr<T>();
    float* accp = acc.data_ptr<float>();
#if defined(_OPENMP)
    const int slots_n = std::max(at::get_num_threads(), omp_get_max_threads());
#else
    const int slots_n = 1;
#endif
    std::vector<TeamScratch> scratch(slots_n);
    for (auto& s : scratch) {
        reserve_quant(s.quant, 1, std::max(H, inter));
        s.xf.resize(std::max(H, inter));
    }
#if defined(_OPENMP)
#pragma omp parallel num_threads(at::get_num_threads())
#endif
    {
#if defined(_OPENMP)
        const int id = omp_get_thread_num();
        const int size = omp_get_num_threads();
#else
        const int id = 0, size = 1;
#endif
        const conveyor::Team tm{id, size, &scratch[id]};
        conveyor::TeamScope scope(&tm);
        for (int64_t j = 0; j < k; ++j) linear_raw<T>(xp, 1, H, gate_up[j], nullptr, hp + j * gu, gu);
        barrier();
        conveyor::parallel_for(0, k, 1, [&](int64_t j0, int64_t j1) {
            for (int64_t j = j0; j < j1; ++j) {
                const T* g = hp + j * gu;
                if (gelu) conveyor::gelu_tanh_mul_row(g, g + inter, ap + j * inter, inter);
                else conveyor::silu_mul_row(g, g + inter, ap + j * inter, inter);
            }
        });
        barrier();
        for (int64_t j = 0; j < k; ++j) linear_raw<T>(ap + j * inter, 1, inter, down[j], nullptr, yp + j * H, H);
        barrier();
        conveyor::parallel_for(0, H, 64, [&](int64_t c0, int64_t c1) {
            for (int64_t j = 0; j < k; ++j) add_scaled<T>(accp, yp + j * H, wp[j], op, c0, c1, j == k - 1);
        });
    }
    return out;
}

}  // namespace

// x: [1, H] (fp32 or bf16); gate_up[j]: [2I, H] and down[j]: [H, I] of the token's k experts in
// ascending expert order (quantized as linear_raw takes them, or dense in x's dtype); weights: [k]
// routing weights in x's dtype, in the same order. Returns [1, H]: sum_j w_j down_j(act(gate_up_j x)).
torch::Tensor moe_token(torch::Tensor x, std::vector<torch::Tensor> gate_up, std::vector<torch::Tensor> down,
                        torch::Tensor weights, bool gelu) {
    TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "x [1, H], contiguous");
    TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size(), "one gate/up and one down per expert");
    TORCH_CHECK(weights.dim() == 1 && weights.numel() == (int64_t)gate_up.size() && weights.is_contiguous() &&
                weights.scalar_type() == x.scalar_type(), "weights [k] in x's dtype");
    if (x.scalar_type() == torch::kBFloat16) return moe_token_impl<at::BFloat16>(x, gate_up, down, weights, gelu);
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "fp32 or bf16 x only");
    return moe_token_impl<float>(x, gate_up, down, weights, gelu);
}
