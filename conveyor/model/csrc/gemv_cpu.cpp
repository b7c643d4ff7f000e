// Small-batch matmul y = x W^T (+ b) that streams a plain row-major weight once, for decode steps
// of a few tokens, where a matmul is bound by reading the weight from memory. bf16 weights use
// AVX512-BF16 dot products where the CPU has them (each instruction: 32 bf16 pairs into 16 fp32
// sums), widened fp32 FMAs on other AVX-512 CPUs and a scalar loop elsewhere; fp32 weights use
// FMAs. Accumulation is in fp32; the output has x's dtype.
#include <torch/types.h>
#include <ATen/Parallel.h>

#include "cpu_vec.h"
#include "kernels.h"
#include "team.h"

#include <algorithm>

namespace {

using conveyor::narrow;
using conveyor::widen;

constexpr int kMaxM = 8;    // tokens per pass over the weight
// Weight rows in flight per inner loop: R x M accumulators stay in registers (of 32).
constexpr int rows_for(int M) { return M <= 4 ? 4 : 2; }
// Each row's stream is prefetched into L2 this far ahead: the hardware prefetchers alone kept
// ~0.8x of the bandwidth a plain sum over memory reaches, this ~0.95x (measured on a 2-core
// Xeon; 4-16 KiB all did about as well).
constexpr int64_t kPrefetchBytes = 8192;
// Whether one-token passes prefetch too. On an EPYC Zen5 a one-token pass streamed 8-10% faster
// on the hardware prefetchers alone, while passes of 2+ tokens were 20-50% slower without the
// software prefetch; on the Xeon it paid at one token as well. So it is a run-time choice, made
// by a probe at model build (linear.py) and set through set_gemv_prefetch_single. It never
// changes a result.
bool g_prefetch_single = true;

#if defined(__AVX512F__)
// Rows [n, n + R) against M token rows: 16-lane fp32 partial sums in acc[r][m].
template <typename T, int M, int R, bool PF>
inline void dot_block(const T* __restrict x, int64_t ldx, const T* __restrict w, int64_t K, __m512 (&acc)[R][M]);

#if defined(__AVX512BF16__)
template <int M, int R, bool PF>
inline void dot_block_bf16(const at::BFloat16* __restrict x, int64_t ldx, const at::BFloat16* __restrict w, int64_t K,
                           __m512 (&acc)[R][M]) {
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int r = 0; r < R; ++r)
            if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetchBytes, _MM_HINT_T1);
        __m512bh xv[M];
        for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
        for (int r = 0; r < R; ++r) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * K + k);
            for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv[m], wv);
        }
    }
    if (k < K) {   // tail: masked loads leave the missing pairs zero
        const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh xv[M];
        for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
        for (int r = 0; r < R; ++r) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
            for (int m = 0; m < M; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv[m], wv);
        }
    }
}
#endif

// Widened FMAs (fp32 weights, or bf16 on AVX-512 CPUs without bf16 dot products).
template <typename T, int M, int R, bool PF>
inline void dot_block_fma(const T* __restrict x, int64_t ldx, const T* __restrict w, int64_t K,
                          __m512 (&acc)[R][M]) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        for (int r = 0; r < R; ++r)
            if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetchBytes, _MM_HINT_T1);
        __m512 xv[M];
        for (int m = 0; m < M; ++m) xv[m] = conveyor::load16(x + m * ldx + k);
        for (int r = 0; r < R; ++r) {
            const __m512 wv = conveyor::load16(w + r * K + k);
            for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(xv[m], wv, acc[r][m]);
        }
    }
    for (; k < K; ++k)   // tail: lane 0
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < M; ++m)
                acc[r][m] = _mm512_add_ps(acc[r][m], _mm512_maskz_mov_ps(1, _mm512_set1_ps(widen(x[m * ldx + k]) *
                                                                                            widen(w[r * K + k]))));
}

template <typename T, int M, int R, bool PF>
inline void dot_block(const T* __restrict x, int64_t ldx, const T* __restrict w, int64_t K, __m512 (&acc)[R][M]) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
        dot_block_bf16<M, R, PF>(x, ldx, w, K, acc);
        return;
    }
#endif
    dot_block_fma<T, M, R, PF>(x, ldx, w, K, acc);
}
#endif

// Rows [n0, n1) of the output for M (<= kMaxM) token rows.
template <typename T, int M, bool PF = true, int R = rows_for(M)>
void gemv_rows(const T* x, int64_t ldx, const T* w, const T* bias, T* y, int64_t ldy, int64_t K, int64_t n0,
               int64_t n1) {
    int64_t n = n0;
#if defined(__AVX512F__)
    for (; n + R <= n1; n += R) {
        __m512 acc[R][M];
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
        dot_block<T, M, R, PF>(x, ldx, w + n * K, K, acc);
        for (int r = 0; r < R; ++r) {
            const float b = bias ? widen(bias[n + r]) : 0.f;
            for (int m = 0; m < M; ++m) narrow(_mm512_reduce_add_ps(acc[r][m]) + b, y + m * ldy + n + r);
        }
    }
#endif
    for (; n < n1; ++n) {   // leftover rows (and the portable path)
        const T* wr = w + n * K;
        for (int m = 0; m < M; ++m) {
            const T* xr = x + m * ldx;
            float s = bias ? widen(bias[n]) : 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < K; ++k) s += widen(xr[k]) * widen(wr[k]);
            narrow(s, y + m * ldy + n);
        }
    }
}

template <typename T>
void gemv_impl(const T* xp, int64_t M, int64_t K, const T* wp, int64_t N, const T* bias, T* yp, int64_t ldy) {
    // Each thread streams a contiguous share of the weight rows, split in blocks of 16 rows: 576
    // rows (the demo model's o and down projections) in blocks of 64 gave one of two threads 5
    // blocks of 9, and at batch 1 the layers' matmuls took 2-4% longer than with blocks of 16.
    const int64_t block = 16, blocks = (N + block - 1) / block;
    conveyor::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        const int64_t n0 = b0 * block, n1 = std::min(N, b1 * block);
        for (int64_t m = 0; m < M; m += kMaxM) {
            const T* xm = xp + m * K;
            T* ym = yp + m * ldy;
            switch (std::min<int64_t>(kMaxM, M - m)) {
                case 1:
                    if (g_prefetch_single) gemv_rows<T, 1, true>(xm, K, wp, bias, ym, ldy, K, n0, n1);
                    else gemv_rows<T, 1, false>(xm, K, wp, bias, ym, ldy, K, n0, n1);
                    break;
                case 2: gemv_rows<T, 2>(xm, K, wp, bias, ym, ldy, K, n0, n1); break;
                case 3: gemv_rows<T, 3>(xm, K, wp, bias, ym, ldy, K, n0, n1); break;
                case 4: gemv_rows<T, 4>(xm, K, wp, bias, ym, ldy, K, n0, n1); break;
                case 5: gemv_rows<T, 5>(xm, K, wp, bias, ym, ldy, K, n0, n1); break;
                case 6: gemv_rows<T, 6>(xm, K, wp, bias, ym, ldy, K, n0, n1); break;
                case 7: gemv_rows<T, 7>(xm, K, wp, bias, ym, ldy, K, n0, n1); break;
                default: gemv_rows<T, 8>(xm, K, wp, bias, ym, ldy, K, n0, n1); break;
            }
        }
    });
}

}  // namespace

// x: [M, K], w: [N, K], bias: [N] or None, all one dtype (fp32 or bf16), contiguous. Returns [M, N].
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K]");
    TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == w.scalar_type(), "contiguous, one dtype");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "fp32 or bf16 only");
    if (bias) TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == x.scalar_type() && bias->numel() == w.size(0),
                          "bias [N], x's dtype");
    auto y = torch::empty({x.size(0), w.size(0)}, x.options());
    if (x.scalar_type() == torch::kBFloat16)
        gemv_raw<at::BFloat16>(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), w.data_ptr<at::BFloat16>(), w.size(0),
                               bias ? bias->data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(), w.size(0));
    else
        gemv_raw<float>(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<float>(), w.size(0),
                        bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), w.size(0));
    return y;
}

template <typename T>
void gemv_raw(const T* x, int64_t M, int64_t K, const T* w, int64_t N, const T* bias, T* y, int64_t ldy) {
    gemv_impl<T>(x, M, K, w, N, bias, y, ldy);
}
template void gemv_raw<float>(const float*, int64_t, int64_t, const float*, int64_t, const float*, float*, int64_t);
template void gemv_raw<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, int64_t,
                                     const at::BFloat16*, at::BFloat16*, int64_t);


void set_gemv_prefetch_single(bool on) { g_prefetch_single = on; }
bool gemv_prefetch_single() { return g_prefetch_single; }
