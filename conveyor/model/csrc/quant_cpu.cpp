// Matmuls computed from GGUF-quantized weights as stored (Q4_0, Q4_1, Q8_0): y = x W^T (+ b)
// with W kept in its blocks of 32 weights (an fp16 scale, for Q4_1 an fp16 minimum, and 4- or
// 8-bit codes), never a dense copy. A decode step is bound by reading the weights, and a Q4_1
// weight is 0.625 bytes against 2 (bf16) or 4 (fp32). Three kernels:
// - plain layout, fp32 activations: each block widened to fp32 in registers (AVX-512) and FMAs,
//   so the only difference from the dequantized fp32 model is the order of the sums;
// - plain layout, bf16 activations: each block widened, rounded to bf16 and bf16 dot products
//   (the dense bf16 GEMV's arithmetic on the dequantized bf16 weights);
// - the x16 layout (below): int8 dot products against activations as two int8 terms (VNNI).
// A plain row: ggml's blocks one after another along K. The type follows from the row's bytes
// per block of 32 (Q4_0: 18, Q4_1: 20, Q8_0: 34; x16: 16 times that per group of 16 rows).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_vec.h"
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using conveyor::narrow;
using conveyor::widen;

enum QType { kQ4_0 = 18, kQ4_1 = 20, kQ8_0 = 34 };   // bytes per block of 32 weights
constexpr int kBlock = 32;
constexpr int kMaxM = 8;    // tokens per pass over the weight
constexpr int64_t kPrefetchBytes = 2048;

// f(std::integral_constant<int, M>{}) for a pass of `count` (1..kMaxM) tokens: M a compile-time
// constant, so that a pass's accumulators stay in registers.
template <typename F>
inline void with_tokens(int64_t count, F&& f) {
    switch (std::min<int64_t>(kMaxM, count)) {
        case 1: f(std::integral_constant<int, 1>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 5: f(std::integral_constant<int, 5>{}); break;
        case 6: f(std::integral_constant<int, 6>{}); break;
        case 7: f(std::integral_constant<int, 7>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}

// f(mc, m, n0, n1): each thread's share of the N output rows (in blocks of 16: 576 rows in
// blocks of 64 split 5:4 between two threads), in passes of up to kMaxM tokens from token m.
template <typename F>
inline void row_passes(int64_t N, int64_t M, F&& f) {
    const int64_t block = 16, blocks = (N + block - 1) / block;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        const int64_t n0 = b0 * block, n1 = std::min(N, b1 * block);
        for (int64_t m = 0; m < M; m += kMaxM) with_tokens(M - m, [&](auto mc) { f(mc, m, n0, n1); });
    });
}

inline float half_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// One block's 32 weights as floats (the portable path, and the reference for the vector one).
template <int QT>
inline void dequant_block(const uint8_t* b, float* out) {
    const float d = half_at(b);
    if constexpr (QT == kQ8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
        for (int i = 0; i < kBlock; ++i) out[i] = d * q[i];
    } else {
        const float m = QT == kQ4_1 ? half_at(b + 2) : -8.f * d;
        const uint8_t* q = b + (QT == kQ4_1 ? 4 : 2);
        for (int i = 0; i < 16; ++i) {
            out[i] = std::fma((float)(q[i] & 0x0F), d, m);
            out[i + 16] = std::fma((float)(q[i] >> 4), d, m);
        }
    }
}

#if defined(__AVX512F__)
// One block as two 16-lane fp32 vectors (weights 0-15 and 16-31): the same values, bit for bit,
// as dequant_block.
template <int QT>
inline void dequant_block16(const uint8_t* b, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(half_at(b));
    if constexpr (QT == kQ8_0) {
        w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(b + 2)))));
        w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(b + 18)))));
    } else {
        const __m512 m = QT == kQ4_1 ? _mm512_set1_ps(half_at(b + 2)) : _mm512_set1_ps(-8.f * half_at(b));
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (QT == kQ4_1 ? 4 : 2)));
        const __m128i nib = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
        w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m);
        w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m);
    }
}

// Each lane rounded to bf16's precision (to nearest even) and kept as fp32: a bf16 model's
// weights, where the CPU has no bf16 dot products.
inline __m512 round_bf16(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
}

// Rows [n, n + R) against M fp32 token rows: 16-lane partial sums in acc[r][m]. With RoundW the
// weights are rounded to bf16 first (what a bf16 model multiplies).
template <int QT, int M, int R, bool RoundW = false>
inline void qdot_rows(const float* __restrict x, int64_t K, const uint8_t* __restrict w, int64_t row_bytes,
                      __m512 (&acc)[R][M]) {
    const int64_t nb = K / kBlock;
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < R; ++r)
            _mm_prefetch(reinterpret_cast<const char*>(w + r * row_bytes + b * QT) + kPrefetchBytes, _MM_HINT_T0);
        for (int r = 0; r < R; ++r) {
            __m512 w0, w1;
            dequant_block16<QT>(w + r * row_bytes + b * QT, w0, w1);
            if constexpr (RoundW) {
                w0 = round_bf16(w0);
                w1 = round_bf16(w1);
            }
            for (int m = 0; m < M; ++m) {
                const float* xb = x + m * K + b * kBlock;
                acc[r][m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[r][m]);
                acc[r][m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[r][m]);
            }
        }
    }
}
#endif

// Output rows [n0, n1) for M (<= kMaxM) fp32 token rows x; y in T.
template <int QT, int M, typename T>
void qgemv_rows(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, const T* bias, T* y, int64_t ldy,
                int64_t n0, int64_t n1) {
    constexpr bool RoundW = std::is_same_v<T, at::BFloat16>;
    int64_t n = n0;
#if defined(__AVX512F__)
    constexpr int R = M <= 2 ? 4 : 2;
    for (; n + R <= n1; n += R) {
        __m512 acc[R][M];
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
        qdot_rows<QT, M, R, RoundW>(x, K, w + n * row_bytes, row_bytes, acc);
        for (int r = 0; r < R; ++r) {
            const float b = bias ? widen(bias[n + r]) : 0.f;
            for (int m = 0; m < M; ++m) narrow(_mm512_reduce_add_ps(acc[r][m]) + b, y + m * ldy + n + r);
        }
    }
#endif
    float wb[kBlock];
    for (; n < n1; ++n) {   // leftover rows (and the portable path)
        float s[M] = {};
        for (int64_t b = 0; b < K / kBlock; ++b) {
            dequant_block<QT>(w + n * row_bytes + b * QT, wb);
            if constexpr (RoundW)
                for (int i = 0; i < kBlock; ++i) wb[i] = widen(at::BFloat16(wb[i]));
            for (int m = 0; m < M; ++m) {
                const float* xb = x + m * K + b * kBlock;
                float t = 0.f;
#pragma omp simd reduction(+ : t)
                for (int i = 0; i < kBlock; ++i) t += wb[i] * xb[i];
                s[m] += t;
            }
        }
        const float b = bias ? widen(bias[n]) : 0.f;
        for (int m = 0; m < M; ++m) narrow(s[m] + b, y + m * ldy + n);
    }
}

#if defined(__AVX512BF16__)
// bf16 activations: each block widened, rounded to bf16 (the dequantized bf16 model's weights,
// bit for bit) and multiplied with bf16 dot products, pairs summed into fp32 lanes -- the
// arithmetic of the dense bf16 GEMV (gemv_cpu.cpp) on the same weights.
template <int QT, int M>
void qgemv_rows_bf16(const at::BFloat16* x, int64_t K, const uint8_t* w, int64_t row_bytes,
                     const at::BFloat16* bias, at::BFloat16* y, int64_t ldy, int64_t n0, int64_t n1) {
    constexpr int R = M <= 2 ? 4 : 2;
    const int64_t nb = K / kBlock;
    int64_t n = n0;
    for (; n + R <= n1; n += R) {
        __m512 acc[R][M];
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
        const uint8_t* wr = w + n * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            for (int r = 0; r < R; ++r)
                _mm_prefetch(reinterpret_cast<const char*>(wr + r * row_bytes + b * QT) + kPrefetchBytes, _MM_HINT_T0);
            for (int r = 0; r < R; ++r) {
                __m512 w0, w1;
                dequant_block16<QT>(wr + r * row_bytes + b * QT, w0, w1);
                const __m512bh wv = _mm512_cvtne2ps_pbh(w1, w0);
                for (int m = 0; m < M; ++m)
                    acc[r][m] = _mm512_dpbf16_ps(acc[r][m], (__m512bh)_mm512_loadu_si512(x + m * K + b * kBlock), wv);
            }
        }
        for (int r = 0; r < R; ++r) {
            const float bb = bias ? widen(bias[n + r]) : 0.f;
            for (int m = 0; m < M; ++m) narrow(_mm512_reduce_add_ps(acc[r][m]) + bb, y + m * ldy + n + r);
        }
    }
    float wb[kBlock];
    for (; n < n1; ++n) {   // leftover rows
        float s[M] = {};
        for (int64_t b = 0; b < nb; ++b) {
            dequant_block<QT>(w + n * row_bytes + b * QT, wb);
            for (int m = 0; m < M; ++m)
                for (int i = 0; i < kBlock; ++i) s[m] += widen(at::BFloat16(wb[i])) * widen(x[m * K + b * kBlock + i]);
        }
        const float bb = bias ? widen(bias[n]) : 0.f;
        for (int m = 0; m < M; ++m) narrow(s[m] + bb, y + m * ldy + n);
    }
}

template <int QT>
void qgemv_bf16_impl(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes,
                     const at::BFloat16* bias, at::BFloat16* y) {
    row_passes(N, M, [&](auto mc, int64_t m, int64_t n0, int64_t n1) {
        qgemv_rows_bf16<QT, decltype(mc)::value>(x + m * K, K, w, row_bytes, bias, y + m * N, N, n0, n1);
    });
}
#endif

template <int QT, typename T>
void qgemv_impl(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes, const T* bias,
                T* y) {
    row_passes(N, M, [&](auto mc, int64_t m, int64_t n0, int64_t n1) {
        qgemv_rows<QT, decltype(mc)::value>(x + m * K, K, w, row_bytes, bias, y + m * N, N, n0, n1);
    });
}

// ---- The x16 layout: 16 rows interleaved block by block, for int8 dot products -------------
// With AVX512-VNNI one instruction multiplies 64 unsigned by 64 signed bytes and adds them in
// groups of 4 into 16 int32 lanes. Laid out so that lane j is row j, a block of 16 rows is
// 8 such instructions against 4 activation bytes broadcast to every lane, and the 16 rows'
// scales are one 32-byte load: the per-block bookkeeping that dominates the fp32 kernel above
// (two scale broadcasts, code widening, a dequantizing FMA per 16 weights and row) is paid once
// per 16 rows. Group g, block b at (g * nb + b) * 16 * QT bytes (the same bytes as the rows):
//   16 fp16 scales (row j at 2j); Q4_1: then 16 fp16 minima;
//   the codes in 64-byte chunks, bytes 4j..4j+3 of a chunk being row j's:
//     Q4_0/Q4_1: 4 chunks, chunk c = the row's code bytes 4c..4c+3 (low nibbles: weights 4c..4c+3,
//                high nibbles: weights 16+4c..16+4c+3, as ggml packs them);
//     Q8_0: 8 chunks, chunk t = weights 4t..4t+3, each + 128 (unsigned).
// Activations are rounded per token and block of 32 to two int8 terms (quantize_x): that, not
// the weights, is this path's only rounding beyond the fp32 one's.
constexpr int kRows = 16;

constexpr int header_bytes(int QT) { return QT == kQ4_1 ? 4 : 2; }

struct QInfo {
    int qt;       // bytes per plain block of 32: kQ4_0, kQ4_1 or kQ8_0
    bool x16;     // interleaved layout
    int64_t N;    // output features
};

QInfo qinfo(const torch::Tensor& w, int64_t K) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
                "a quantized weight is a contiguous uint8 [N, row_bytes] tensor");
    TORCH_CHECK(K > 0 && K % kBlock == 0, "quantized weights need K a multiple of 32, got ", K);
    const int64_t nb = K / kBlock;
    TORCH_CHECK(w.size(1) % nb == 0, "row bytes ", w.size(1), " do not divide into ", nb, " blocks");
    int64_t bs = w.size(1) / nb;
    const bool x16 = bs % kRows == 0;
    if (x16) bs /= kRows;
    TORCH_CHECK(bs == kQ4_0 || bs == kQ4_1 || bs == kQ8_0, "unknown block size ", bs, " (Q4_0, Q4_1, Q8_0 only)");
    return {(int)bs, x16, x16 ? w.size(0) * kRows : w.size(0)};
}

// Row n's block b as plain bytes: in place for the plain layout, gathered into `tmp` for x16.
template <int QT>
inline const uint8_t* plain_block(const uint8_t* w, bool x16, int64_t nb, int64_t n, int64_t b, uint8_t* tmp) {
    if (!x16) return w + (n * nb + b) * QT;
    const uint8_t* blk = w + ((n / kRows) * nb + b) * kRows * QT;
    const int j = (int)(n % kRows), hdr = header_bytes(QT);
    std::memcpy(tmp, blk + 2 * j, 2);
    if (QT == kQ4_1) std::memcpy(tmp + 2, blk + 2 * kRows + 2 * j, 2);
    const uint8_t* codes = blk + kRows * hdr;
    for (int c = 0; c < (QT == kQ8_0 ? 8 : 4); ++c)
        for (int i = 0; i < 4; ++i) tmp[hdr + 4 * c + i] = codes[c * 64 + 4 * j + i] ^ (QT == kQ8_0 ? 0x80 : 0);
    return tmp;
}

template <int QT>
void repack_impl(const uint8_t* src, uint8_t* dst, int64_t N, int64_t nb) {
    const int hdr = header_bytes(QT);
    at::parallel_for(0, N / kRows, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t b = 0; b < nb; ++b) {
                uint8_t* o = dst + (g * nb + b) * kRows * QT;
                uint8_t* codes = o + kRows * hdr;
                for (int j = 0; j < kRows; ++j) {
                    const uint8_t* blk = src + ((g * kRows + j) * nb + b) * QT;
                    std::memcpy(o + 2 * j, blk, 2);
                    if (QT == kQ4_1) std::memcpy(o + 2 * kRows + 2 * j, blk + 2, 2);
                    for (int c = 0; c < (QT == kQ8_0 ? 8 : 4); ++c)
                        for (int i = 0; i < 4; ++i)
                            codes[c * 64 + 4 * j + i] = blk[hdr + 4 * c + i] ^ (QT == kQ8_0 ? 0x80 : 0);
                }
            }
    });
}

// Activations per token and block of 32 as two int8 terms, x ~ d q + d2 q2: q = round(x / d),
// d = max|x| / 127, then the remainder q2 = round((x - d q) / d2), d2 = d / 254 (|x - d q| <= d / 2).
// One int8 term alone (llama.cpp's scheme) moved the demo model's logits by a mean KL of 0.017 and
// changed 6% of its greedy tokens against the dequantized model; with the second the rounding is
// max|x| / 64516 per block, below bf16's. Each term is its own dot product with the same codes.
// qsum, qsum2: sums of q, q2 (the codes' offset); sum: the exact sum of x (Q4_1's minimum).
struct QuantX {
    std::vector<int8_t> q, q2;
    std::vector<float> d, d2, sum;
    std::vector<int32_t> qsum, qsum2;
};

// One block of 32 activations (r: its index in the QuantX arrays).
inline void quantize_block(const float* xb, QuantX& X, int64_t r) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(x0)), _mm512_reduce_max_ps(_mm512_abs_ps(x1)));
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
#else
    float amax = 0.f, sum = 0.f;
    for (int i = 0; i < kBlock; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        sum += xb[i];
    }
#endif
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    const float d2 = d / 254.f, id2 = amax > 0.f ? 1.f / d2 : 0.f;
    int8_t* q = X.q.data() + r * kBlock;
    int8_t* q2 = X.q2.data() + r * kBlock;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // Rounded to nearest even (the MXCSR default), as std::nearbyint.
    const __m512 vd = _mm512_set1_ps(d), vid = _mm512_set1_ps(id), vid2 = _mm512_set1_ps(id2);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i qs = _mm512_setzero_si512(), q2s = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
        const __m512 xv = h ? x1 : x0;
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(xv, vid));
        const __m512 rem = _mm512_sub_ps(xv, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(v)));
        const __m512i v2 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(rem, vid2))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtsepi32_epi8(v));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + 16 * h), _mm512_cvtsepi32_epi8(v2));
        qs = _mm512_add_epi32(qs, v);
        q2s = _mm512_add_epi32(q2s, v2);
    }
    X.qsum[r] = _mm512_reduce_add_epi32(qs);
    X.qsum2[r] = _mm512_reduce_add_epi32(q2s);
#else
    int32_t qsum = 0, qsum2 = 0;
    for (int i = 0; i < kBlock; ++i) {
        const int v = (int)std::nearbyint(xb[i] * id);
        const int v2 = std::clamp((int)std::nearbyint((xb[i] - d * (float)v) * id2), -127, 127);
        q[i] = (int8_t)v;
        q2[i] = (int8_t)v2;
        qsum += v;
        qsum2 += v2;
    }
    X.qsum[r] = qsum;
    X.qsum2[r] = qsum2;
#endif
    X.d[r] = d;
    X.d2[r] = d2;
    X.sum[r] = sum;
}

QuantX quantize_x(const float* x, int64_t M, int64_t K) {
    const int64_t nb = K / kBlock, n = M * nb;
    QuantX X{std::vector<int8_t>(M * K), std::vector<int8_t>(M * K), std::vector<float>(n), std::vector<float>(n),
             std::vector<float>(n), std::vector<int32_t>(n), std::vector<int32_t>(n)};
    at::parallel_for(0, n, 256, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) quantize_block(x + r * kBlock, X, r);
    });
    return X;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHaveVnni = true;

// One group of 16 output rows for M tokens.
template <int QT, int M, typename T>
inline void x16_group(const QuantX& X, int64_t m0, int64_t nb, const uint8_t* wg, const T* bias, T* y, int64_t ldy,
                      int64_t n0) {
    constexpr int hdr = header_bytes(QT);
    constexpr int off = QT == kQ4_0 ? 8 : QT == kQ8_0 ? 128 : 0;   // the codes' unsigned offset
    const int64_t K = nb * kBlock;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wg + b * kRows * QT;
        for (int l = 0; l < kRows * QT; l += 64)   // the block 8 ahead
            _mm_prefetch(reinterpret_cast<const char*>(blk) + 8 * kRows * QT + l, _MM_HINT_T0);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
        __m512 mw = _mm512_setzero_ps();
        if constexpr (QT == kQ4_1)
            mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2 * kRows)));
        const uint8_t* cp = blk + kRows * hdr;
        __m512i codes[8];
        if constexpr (QT == kQ8_0) {
            for (int t = 0; t < 8; ++t) codes[t] = _mm512_loadu_si512(cp + 64 * t);
        } else {
            for (int c = 0; c < 4; ++c) {
                const __m512i raw = _mm512_loadu_si512(cp + 64 * c);
                codes[c] = _mm512_and_si512(raw, nib);
                codes[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
            }
        }
        for (int m = 0; m < M; ++m) {
            const int64_t r = (m0 + m) * nb + b;
            const int32_t* xw = reinterpret_cast<const int32_t*>(X.q.data() + (m0 + m) * K + b * kBlock);
            const int32_t* xw2 = reinterpret_cast<const int32_t*>(X.q2.data() + (m0 + m) * K + b * kBlock);
            // Two chains per term (quads 0-3 and 4-7): half the dependent latency per block.
            const __m512i z = _mm512_setzero_si512();
            __m512i a = _mm512_dpbusd_epi32(z, codes[0], _mm512_set1_epi32(xw[0]));
            __m512i b = _mm512_dpbusd_epi32(z, codes[4], _mm512_set1_epi32(xw[4]));
            __m512i a2 = _mm512_dpbusd_epi32(z, codes[0], _mm512_set1_epi32(xw2[0]));
            __m512i b2 = _mm512_dpbusd_epi32(z, codes[4], _mm512_set1_epi32(xw2[4]));
            for (int t = 1; t < 4; ++t) {
                a = _mm512_dpbusd_epi32(a, codes[t], _mm512_set1_epi32(xw[t]));
                b = _mm512_dpbusd_epi32(b, codes[t + 4], _mm512_set1_epi32(xw[t + 4]));
                a2 = _mm512_dpbusd_epi32(a2, codes[t], _mm512_set1_epi32(xw2[t]));
                b2 = _mm512_dpbusd_epi32(b2, codes[t + 4], _mm512_set1_epi32(xw2[t + 4]));
            }
            a = _mm512_add_epi32(a, b);
            a2 = _mm512_add_epi32(a2, b2);
            if constexpr (off != 0) {
                a = _mm512_sub_epi32(a, _mm512_set1_epi32(off * X.qsum[r]));
                a2 = _mm512_sub_epi32(a2, _mm512_set1_epi32(off * X.qsum2[r]));
            }
            const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2), _mm512_set1_ps(X.d2[r]),
                                             _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(X.d[r])));
            acc[m] = _mm512_fmadd_ps(v, dw, acc[m]);
            if constexpr (QT == kQ4_1) acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(X.sum[r]), acc[m]);
        }
    }
    alignas(64) float out[kRows];
    for (int m = 0; m < M; ++m) {
        _mm512_store_ps(out, acc[m]);
        T* ym = y + (m0 + m) * ldy + n0;
        for (int j = 0; j < kRows; ++j) narrow(out[j] + (bias ? widen(bias[n0 + j]) : 0.f), ym + j);
    }
}

template <int QT, typename T>
void x16_impl(const QuantX& X, int64_t M, int64_t K, const uint8_t* w, int64_t N, const T* bias, T* y) {
    const int64_t nb = K / kBlock, gbytes = nb * kRows * QT;
    at::parallel_for(0, N / kRows, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t m = 0; m < M; m += kMaxM)
                with_tokens(M - m, [&](auto mc) {
                    x16_group<QT, decltype(mc)::value>(X, m, nb, w + g * gbytes, bias, y, N, g * kRows);
                });
    });
}
#else
constexpr bool kHaveVnni = false;
#endif

// The x16 layout without VNNI (a file repacked elsewhere): the int8 arithmetic, scalar.
template <int QT, typename T>
void x16_portable(const QuantX& X, int64_t M, int64_t K, const uint8_t* w, int64_t N, const T* bias, T* y) {
    const int64_t nb = K / kBlock;
    const int off = QT == kQ4_0 ? 8 : QT == kQ8_0 ? 128 : 0;
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        uint8_t tmp[kQ8_0];
        for (int64_t n = n0; n < n1; ++n)
            for (int64_t m = 0; m < M; ++m) {
                float s = 0.f;
                for (int64_t b = 0; b < nb; ++b) {
                    const uint8_t* blk = plain_block<QT>(w, true, nb, n, b, tmp);
                    const int8_t* xq = X.q.data() + m * K + b * kBlock;
                    const int8_t* xq2 = X.q2.data() + m * K + b * kBlock;
                    int32_t dot = 0, dot2 = 0;
                    for (int i = 0; i < kBlock; ++i) {
                        int code;
                        if (QT == kQ8_0) code = (int)reinterpret_cast<const int8_t*>(blk + 2)[i] + 128;
                        else {
                            const uint8_t byte = blk[header_bytes(QT) + (i % 16)];
                            code = i < 16 ? (byte & 0x0F) : (byte >> 4);
                        }
                        dot += code * xq[i];
                        dot2 += code * xq2[i];
                    }
                    const int64_t r = m * nb + b;
                    s += ((float)(dot - off * X.qsum[r]) * X.d[r] + (float)(dot2 - off * X.qsum2[r]) * X.d2[r]) *
                         half_at(blk);
                    if (QT == kQ4_1) s += half_at(blk + 2) * X.sum[r];
                }
                narrow(s + (bias ? widen(bias[n]) : 0.f), y + m * N + n);
            }
    });
}

template <int QT, typename T>
void qgemv_typed(const QInfo& info, const float* x, int64_t M, int64_t K, const uint8_t* w, const T* bias, T* y) {
    if (!info.x16) {
        qgemv_impl<QT, T>(x, M, K, w, info.N, (K / kBlock) * QT, bias, y);
        return;
    }
    const QuantX X = quantize_x(x, M, K);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    x16_impl<QT, T>(X, M, K, w, info.N, bias, y);
#else
    x16_portable<QT, T>(X, M, K, w, info.N, bias, y);
#endif
}

template <typename T>
void dispatch_qgemv(const QInfo& info, const float* x, int64_t M, int64_t K, const uint8_t* w, const T* bias, T* y) {
    switch (info.qt) {
        case kQ4_0: qgemv_typed<kQ4_0, T>(info, x, M, K, w, bias, y); break;
        case kQ4_1: qgemv_typed<kQ4_1, T>(info, x, M, K, w, bias, y); break;
        default: qgemv_typed<kQ8_0, T>(info, x, M, K, w, bias, y); break;
    }
}

// Rows `ids` (all rows when ids is null) of a quantized weight, widened to T.
template <int QT, typename T>
void dequant_impl(const uint8_t* w, bool x16, int64_t K, const int64_t* ids, int64_t rows, T* out) {
    const int64_t nb = K / kBlock;
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
        alignas(64) float wb[kBlock];
        uint8_t tmp[kQ8_0];
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t n = ids ? ids[r] : r;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* blk = plain_block<QT>(w, x16, nb, n, b, tmp);
#if defined(__AVX512F__)
                __m512 w0, w1;
                dequant_block16<QT>(blk, w0, w1);
                _mm512_store_ps(wb, w0);
                _mm512_store_ps(wb + 16, w1);
#else
                dequant_block<QT>(blk, wb);
#endif
                T* o = out + r * K + b * kBlock;
#pragma omp simd
                for (int i = 0; i < kBlock; ++i) narrow(wb[i], o + i);
            }
        }
    });
}

torch::Tensor dequant_rows(const torch::Tensor& w, int64_t K, const int64_t* ids, int64_t rows, at::ScalarType dtype) {
    const QInfo info = qinfo(w, K);
    TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "fp32 or bf16 output only");
    auto out = torch::empty({rows, K}, torch::TensorOptions().dtype(dtype));
    const uint8_t* wp = w.data_ptr<uint8_t>();
    auto run = [&](auto* o) {
        using T = std::remove_pointer_t<decltype(o)>;
        switch (info.qt) {
            case kQ4_0: dequant_impl<kQ4_0, T>(wp, info.x16, K, ids, rows, o); break;
            case kQ4_1: dequant_impl<kQ4_1, T>(wp, info.x16, K, ids, rows, o); break;
            default: dequant_impl<kQ8_0, T>(wp, info.x16, K, ids, rows, o); break;
        }
    };
    if (dtype == torch::kBFloat16) run(out.data_ptr<at::BFloat16>());
    else run(out.data_ptr<float>());
    return out;
}

}  // namespace

// x: [M, K] fp32 or bf16; w: [N, row_bytes] uint8 in GGUF blocks, or [N / 16, 16 * row_bytes] in
// the x16 layout (qrepack); bias: [N] in x's dtype or None. Returns [M, N] in x's dtype. With bf16
// x and the plain layout the weights are rounded to bf16 (a bf16 model's weights: the dense bf16
// copy, the GEMV and this kernel then differ only in summation order); the x16 layout always
// keeps them exact and rounds the activations (two int8 terms).
torch::Tensor qgemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    TORCH_CHECK(x.dim() == 2, "x [M, K]");
    const int64_t M = x.size(0), K = x.size(1);
    const QInfo info = qinfo(w, K);
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "fp32 or bf16 x only");
    if (bias) TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == x.scalar_type() && bias->numel() == info.N,
                          "bias [N], x's dtype");
    auto y = torch::empty({M, info.N}, x.options());
    const uint8_t* wp = w.data_ptr<uint8_t>();
#if defined(__AVX512BF16__)
    if (x.scalar_type() == torch::kBFloat16 && !info.x16) {
        const auto xc = x.contiguous();
        const auto* xp = xc.data_ptr<at::BFloat16>();
        const auto* bp = bias ? bias->data_ptr<at::BFloat16>() : nullptr;
        auto* yp = y.data_ptr<at::BFloat16>();
        const int64_t rb = (K / kBlock) * info.qt;
        switch (info.qt) {
            case kQ4_0: qgemv_bf16_impl<kQ4_0>(xp, M, K, wp, info.N, rb, bp, yp); break;
            case kQ4_1: qgemv_bf16_impl<kQ4_1>(xp, M, K, wp, info.N, rb, bp, yp); break;
            default: qgemv_bf16_impl<kQ8_0>(xp, M, K, wp, info.N, rb, bp, yp); break;
        }
        return y;
    }
#endif
    const auto xf = x.to(torch::kFloat32).contiguous();
    if (x.scalar_type() == torch::kBFloat16)
        dispatch_qgemv<at::BFloat16>(info, xf.data_ptr<float>(), M, K, wp,
                                     bias ? bias->data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>());
    else
        dispatch_qgemv<float>(info, xf.data_ptr<float>(), M, K, wp, bias ? bias->data_ptr<float>() : nullptr,
                              y.data_ptr<float>());
    return y;
}

// A quantized weight (either layout) -> [N, K] in `dtype` (fp32 or bf16).
torch::Tensor qdequant(torch::Tensor w, int64_t K, at::ScalarType dtype) {
    return dequant_rows(w, K, nullptr, qinfo(w, K).N, dtype);
}

// Rows `ids` (int64, any shape) of a quantized table -> [ids.numel(), K]: an embedding lookup.
torch::Tensor qembedding(torch::Tensor w, torch::Tensor ids, int64_t K, at::ScalarType dtype) {
    const QInfo info = qinfo(w, K);
    const auto flat = ids.to(torch::kInt64).contiguous().view(-1);
    const int64_t* p = flat.data_ptr<int64_t>();
    for (int64_t i = 0; i < flat.numel(); ++i)
        TORCH_CHECK(p[i] >= 0 && p[i] < info.N, "token id ", p[i], " out of range [0, ", info.N, ")");
    return dequant_rows(w, K, p, flat.numel(), dtype);
}

// Plain [N, row_bytes] -> the x16 layout [N / 16, 16 * row_bytes] (N a multiple of 16): the same
// bytes, reordered for the int8 kernel.
torch::Tensor qrepack(torch::Tensor w, int64_t K) {
    const QInfo info = qinfo(w, K);
    TORCH_CHECK(!info.x16, "already in the x16 layout");
    TORCH_CHECK(info.N % kRows == 0, "x16 needs a multiple of 16 rows, got ", info.N);
    auto out = torch::empty({info.N / kRows, kRows * w.size(1)}, w.options());
    const int64_t nb = K / kBlock;
    switch (info.qt) {
        case kQ4_0: repack_impl<kQ4_0>(w.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), info.N, nb); break;
        case kQ4_1: repack_impl<kQ4_1>(w.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), info.N, nb); break;
        default: repack_impl<kQ8_0>(w.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), info.N, nb); break;
    }
    return out;
}

// Whether the x16 layout runs on int8 dot products here (else a scalar loop: never chosen).
bool quant_int8_native() { return kHaveVnni; }

// The matmul of a decode layer: quantized (uint8) weights to qgemv, dense ones to gemv.
torch::Tensor linear_any(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    return w.scalar_type() == torch::kUInt8 ? qgemv(x, w, bias) : gemv(x, w, bias);
}
