// LoRA deltas of a step's rows, each under its own adapter, in one call per matmul ("SGMV" on the
// CPU): y[i] += Bt_g^T (A_g x[i]) for every row i of group g (rows of no group are the base model's
// and untouched). A_g is [R_g, K]; Bt_g is [R_g, N] (the adapter's B transposed, zero in the columns it
// does not adapt), so the second product is R_g axpys over contiguous rows of N.
//
// The rows come sorted by group (`order`, with `starts`: group g's rows are order[starts[g]:starts[g+1]]),
// and each thread takes blocks of up to kRows rows of one group: A_g and Bt_g are read once per block
// rather than once per row (at rank 8-24 they are 20-120 KB per matmul, from L2 at best). The torch
// path (conveyor/model/lora.py) runs a few ops per adapter and matmul: with 16 adapters a prefill step
// of the demo model spent 8 ms per matmul in them (1 s a step), this ~0.2 ms.
#include <torch/types.h>

#include <algorithm>
#include <vector>

#include "cpu_vec.h"
#include "kernels.h"
#include "team.h"

using conveyor::narrow;
using conveyor::widen;

namespace {

constexpr int kRows = 4;

template <typename T, int M>
void block(T* y, const T* x, const int32_t* rows, int64_t K, int64_t N, const T* a, const T* bt, int64_t R,
           std::vector<float>& h, std::vector<float>& acc) {
    h.assign(static_cast<size_t>(M) * R, 0.f);
    const T* xs[M];
    for (int m = 0; m < M; ++m) xs[m] = x + rows[m] * K;
    for (int64_t r = 0; r < R; ++r) {   // (A's row stays in L1 for the block's rows)
        const T* ar = a + r * K;
        for (int m = 0; m < M; ++m) {
            const T* xm = xs[m];
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < K; ++k) s += widen(ar[k]) * widen(xm[k]);
            h[m * R + r] = s;
        }
    }
    acc.resize(static_cast<size_t>(M) * N);
    for (int m = 0; m < M; ++m) {
        const T* ym = y + rows[m] * N;
        float* am = acc.data() + m * N;
#pragma omp simd
        for (int64_t n = 0; n < N; ++n) am[n] = widen(ym[n]);
    }
    for (int64_t r = 0; r < R; ++r) {
        const T* br = bt + r * N;
        float hr[M];
        for (int m = 0; m < M; ++m) hr[m] = h[m * R + r];
        for (int m = 0; m < M; ++m) {
            float* am = acc.data() + m * N;
            const float c = hr[m];
#pragma omp simd
            for (int64_t n = 0; n < N; ++n) am[n] += c * widen(br[n]);
        }
    }
    for (int m = 0; m < M; ++m) {
        T* ym = y + rows[m] * N;
        const float* am = acc.data() + m * N;
        for (int64_t n = 0; n < N; ++n) narrow(am[n], ym + n);
    }
}

template <typename T>
void sgmv(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& order, const torch::Tensor& starts,
          const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& bt) {
    const int64_t K = x.size(1), N = y.size(1), G = static_cast<int64_t>(a.size());
    const int32_t* ord = order.data_ptr<int32_t>();
    const int32_t* st = starts.data_ptr<int32_t>();
    TORCH_CHECK(starts.numel() == G + 1 && st[0] == 0 && st[G] == order.numel(), "starts: [G + 1], 0 .. len(order)");
    std::vector<const T*> ap(G), bp(G);
    std::vector<int64_t> ranks(G);
    struct Block { int64_t g, j0, j1; };
    std::vector<Block> blocks;
    for (int64_t g = 0; g < G; ++g) {
        const int64_t R = a[g].numel() ? a[g].size(0) : 0;
        TORCH_CHECK(st[g] <= st[g + 1], "starts must not decrease");
        if (R) {
            TORCH_CHECK(a[g].dim() == 2 && a[g].size(1) == K && a[g].is_contiguous() && a[g].scalar_type() == x.scalar_type(),
                        "A of group ", g, ": [R, K], contiguous, x's dtype");
            TORCH_CHECK(bt[g].dim() == 2 && bt[g].size(0) == R && bt[g].size(1) == N && bt[g].is_contiguous() &&
                            bt[g].scalar_type() == x.scalar_type(),
                        "Bt of group ", g, ": [R, N], contiguous, x's dtype");
            for (int64_t j = st[g]; j < st[g + 1]; j += kRows) blocks.push_back({g, j, std::min<int64_t>(j + kRows, st[g + 1])});
        }
        ap[g] = R ? a[g].data_ptr<T>() : nullptr;
        bp[g] = R ? bt[g].data_ptr<T>() : nullptr;
        ranks[g] = R;
    }
    for (int64_t j = 0; j < order.numel(); ++j) TORCH_CHECK(ord[j] >= 0 && ord[j] < x.size(0), "a row out of range");
    T* yp = y.data_ptr<T>();
    const T* xp = x.data_ptr<T>();
    conveyor::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
        std::vector<float> h, acc;
        for (int64_t b = b0; b < b1; ++b) {
            const Block& bl = blocks[b];
            const int32_t* rows = ord + bl.j0;
            const T* ag = ap[bl.g];
            const T* bg = bp[bl.g];
            const int64_t R = ranks[bl.g];
            switch (bl.j1 - bl.j0) {
                case 1: block<T, 1>(yp, xp, rows, K, N, ag, bg, R, h, acc); break;
                case 2: block<T, 2>(yp, xp, rows, K, N, ag, bg, R, h, acc); break;
                case 3: block<T, 3>(yp, xp, rows, K, N, ag, bg, R, h, acc); break;
                default: block<T, 4>(yp, xp, rows, K, N, ag, bg, R, h, acc); break;
            }
        }
    });
}

}  // namespace

// y: [T, N] (updated in place), x: [T, K]; order: int32, the rows under an adapter sorted by group;
// starts: int32 [G + 1], group g's rows are order[starts[g]:starts[g + 1]]; a[g]: [R_g, K], bt[g]:
// [R_g, N] (empty: group g does not adapt this matmul). One dtype (fp32 or bf16), all contiguous;
// products accumulate in fp32. A row appears at most once in `order`.
void lora_sgmv_(torch::Tensor y, torch::Tensor x, torch::Tensor order, torch::Tensor starts,
                std::vector<torch::Tensor> a, std::vector<torch::Tensor> bt) {
    TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x [T, K] and y [T, N]");
    TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && x.scalar_type() == y.scalar_type(), "contiguous, one dtype");
    TORCH_CHECK(order.scalar_type() == torch::kInt32 && order.is_contiguous() && starts.scalar_type() == torch::kInt32 &&
                    starts.is_contiguous(), "order and starts: int32");
    TORCH_CHECK(a.size() == bt.size(), "one A and one Bt per group");
    if (x.scalar_type() == torch::kBFloat16) sgmv<at::BFloat16>(y, x, order, starts, a, bt);
    else {
        TORCH_CHECK(x.scalar_type() == torch::kFloat32, "fp32 or bf16 only");
        sgmv<float>(y, x, order, starts, a, bt);
    }
}
