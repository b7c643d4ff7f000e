// Matmuls computed from GGUF-quantized weights as stored (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): y = x W^T (+ b)
// with W kept in its blocks of 32 weights (an fp16 scale, for Q4_1 and Q5_1 an fp16 minimum, and 4-,
// 5- or 8-bit codes; Q5_0's and Q5_1's fifth bits are one 32-bit word per block), never a dense copy. A decode step is bound by reading the weights, and a Q4_1
// weight is 0.625 bytes against 2 (bf16) or 4 (fp32). Three kernels:
// - plain layout, fp32 activations: each block widened to fp32 in registers (AVX-512) and FMAs,
//   so the only difference from the dequantized fp32 model is the order of the sums;
// - plain layout, bf16 activations: each block widened, rounded to bf16 and bf16 dot products
//   (the dense bf16 GEMV's arithmetic on the dequantized bf16 weights);
// - the x16 layout (below): int8 dot products against activations as two int8 terms (VNNI;
//   steps of 16+ tokens on AMX-INT8 tiles where the CPU has them, the same integers and bits).
// A plain row: ggml's blocks one after another along K. The type follows from the row's bytes
// per block of 32 (Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34; x16: 16 times that per group of 16 rows).
#include <torch/types.h>
#include <ATen/Parallel.h>

#include "cpu_vec.h"
#include "kernels.h"
#include "team.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// The int8 kernel of the x16 layout in vector code: AVX512-VNNI, or AVX2 (8 rows at a time).
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define CONVEYOR_INT8_VECTOR 1
#else
#define CONVEYOR_INT8_VECTOR 0
#endif
// ... and its large steps on AMX-INT8 tiles (x16_amx, defined only here: every other build, AVX-512
// without AMX included, must not name it; tests/model/test_kernel_builds.py compiles each ISA's build).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define CONVEYOR_INT8_AMX 1
#else
#define CONVEYOR_INT8_AMX 0
#endif

namespace {

using conveyor::narrow;
using conveyor::widen;

constexpr bool kInt8Vector = CONVEYOR_INT8_VECTOR;
constexpr bool kHaveAmx = CONVEYOR_INT8_AMX;

enum QType { kQ4_0 = 18, kQ4_1 = 20, kQ5_0 = 22, kQ5_1 = 24, kQ8_0 = 34 };   // bytes per block of 32 weights
constexpr int kBlock = 32;
constexpr int kMaxM = 8;    // tokens per pass over the weight
constexpr int64_t kAmxMinTokens = 16;   // steps this large take AMX tiles where there are
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

// f(mc, m) for tokens [first, M) in passes of up to kMaxM from token m (mc: with_tokens' constant).
template <typename F>
inline void token_passes(int64_t first, int64_t M, F&& f) {
    for (int64_t m = first; m < M; m += kMaxM) with_tokens(M - m, [&](auto mc) { f(mc, m); });
}

// f(std::integral_constant<int, QT>{}) for the block type `qt` (one of QType).
template <typename F>
inline void with_qtype(int qt, F&& f) {
    switch (qt) {
        case kQ4_0: f(std::integral_constant<int, kQ4_0>{}); break;
        case kQ4_1: f(std::integral_constant<int, kQ4_1>{}); break;
        case kQ5_0: f(std::integral_constant<int, kQ5_0>{}); break;
        case kQ5_1: f(std::integral_constant<int, kQ5_1>{}); break;
        default: f(std::integral_constant<int, kQ8_0>{}); break;
    }
}

// Where a plain block's codes start (after its scale, Q4_1's / Q5_1's minimum, Q5_0's / Q5_1's fifth bits).
constexpr int code_offset(int QT) { return QT == kQ4_1 ? 4 : QT == kQ5_0 ? 6 : QT == kQ5_1 ? 8 : 2; }
// Types with a minimum per block (weight = scale * code + minimum) and with fifth code bits, and
// where a plain block's fifth bits (a 32-bit word, bit i: weight i) start.
constexpr bool block_min(int QT) { return QT == kQ4_1 || QT == kQ5_1; }
constexpr bool has_fifth(int QT) { return QT == kQ5_0 || QT == kQ5_1; }
constexpr int fifth_offset(int QT) { return QT == kQ5_1 ? 4 : 2; }
// A code's unsigned offset: weight = scale * (code - offset) (+ minimum, Q4_1).
constexpr int code_zero(int QT) { return QT == kQ4_0 ? 8 : QT == kQ5_0 ? 16 : QT == kQ8_0 ? 128 : 0; }

inline uint32_t u32_at(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// f(mc, m, n0, n1): each thread's share of the N output rows (in blocks of 16: 576 rows in
// blocks of 64 split 5:4 between two threads), in passes of up to kMaxM tokens from token m.
template <typename F>
inline void row_passes(int64_t N, int64_t M, F&& f) {
    const int64_t block = 16, blocks = (N + block - 1) / block;
    conveyor::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        const int64_t n0 = b0 * block, n1 = std::min(N, b1 * block);
        token_passes(0, M, [&](auto mc, int64_t m) { f(mc, m, n0, n1); });
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
        const float m = block_min(QT) ? half_at(b + 2) : -(float)code_zero(QT) * d;
        const uint8_t* q = b + code_offset(QT);
        const uint32_t qh = has_fifth(QT) ? u32_at(b + fifth_offset(QT)) : 0;   // bit i: weight i's fifth bit
        for (int i = 0; i < 16; ++i) {
            out[i] = std::fma((float)((q[i] & 0x0F) | (((qh >> i) & 1) << 4)), d, m);
            out[i + 16] = std::fma((float)((q[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)), d, m);
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
        const __m512 m = block_min(QT) ? _mm512_set1_ps(half_at(b + 2))
                                     : _mm512_set1_ps(-(float)code_zero(QT) * half_at(b));
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + code_offset(QT)));
        const __m128i nib = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
        __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), c1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
        if constexpr (has_fifth(QT)) {   // + 16 where the fifth bit is set
            const uint32_t qh = u32_at(b + fifth_offset(QT));
            const __m512 sixteen = _mm512_set1_ps(16.f);
            c0 = _mm512_mask_add_ps(c0, (__mmask16)(qh & 0xFFFF), c0, sixteen);
            c1 = _mm512_mask_add_ps(c1, (__mmask16)(qh >> 16), c1, sixteen);
        }
        w0 = _mm512_fmadd_ps(c0, d, m);
        w1 = _mm512_fmadd_ps(c1, d, m);
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
                     const at::BFloat16* bias, at::BFloat16* y, int64_t ldy) {
    row_passes(N, M, [&](auto mc, int64_t m, int64_t n0, int64_t n1) {
        qgemv_rows_bf16<QT, decltype(mc)::value>(x + m * K, K, w, row_bytes, bias, y + m * ldy, ldy, n0, n1);
    });
}
#endif

template <int QT, typename T>
void qgemv_impl(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, int64_t row_bytes, const T* bias,
                T* y, int64_t ldy) {
    row_passes(N, M, [&](auto mc, int64_t m, int64_t n0, int64_t n1) {
        qgemv_rows<QT, decltype(mc)::value>(x + m * K, K, w, row_bytes, bias, y + m * ldy, ldy, n0, n1);
    });
}

// ---- The x16 layout: 16 rows interleaved block by block, for int8 dot products -------------
// With AVX512-VNNI one instruction multiplies 64 unsigned by 64 signed bytes and adds them in
// groups of 4 into 16 int32 lanes. Laid out so that lane j is row j, a block of 16 rows is
// 8 such instructions against 4 activation bytes broadcast to every lane, and the 16 rows'
// scales are one 32-byte load: the per-block bookkeeping that dominates the fp32 kernel above
// (two scale broadcasts, code widening, a dequantizing FMA per 16 weights and row) is paid once
// per 16 rows. Group g, block b at (g * nb + b) * 16 * QT bytes (the same bytes as the rows):
//   16 fp16 scales (row j at 2j); Q4_1, Q5_1: then 16 fp16 minima;
//   the codes in 64-byte chunks, bytes 4j..4j+3 of a chunk being row j's:
//     Q4_0/Q4_1/Q5_0/Q5_1: 4 chunks, chunk c = the row's code bytes 4c..4c+3 (low nibbles: weights
//                4c..4c+3, high nibbles: weights 16+4c..16+4c+3, as ggml packs them); Q5_0/Q5_1: then
//                a fifth chunk, bytes 4j..4j+3 = row j's 32 fifth bits (its block's word);
//     Q8_0: 8 chunks, chunk t = weights 4t..4t+3, each + 128 (unsigned).
// Activations are rounded per token and block of 32 to two int8 terms (quantize_into): that, not
// the weights, is this path's only rounding beyond the fp32 one's.
constexpr int kRows = 16;

constexpr int header_bytes(int QT) { return block_min(QT) ? 4 : 2; }

struct QInfo {
    int qt;       // bytes per plain block of 32: one of QType
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
    TORCH_CHECK(bs == kQ4_0 || bs == kQ4_1 || bs == kQ5_0 || bs == kQ5_1 || bs == kQ8_0, "unknown block size ", bs,
                " (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 only)");
    return {(int)bs, x16, x16 ? w.size(0) * kRows : w.size(0)};
}

// Row n's block b as plain bytes: in place for the plain layout, gathered into `tmp` for x16.
template <int QT>
inline const uint8_t* plain_block(const uint8_t* w, bool x16, int64_t nb, int64_t n, int64_t b, uint8_t* tmp) {
    if (!x16) return w + (n * nb + b) * QT;
    const uint8_t* blk = w + ((n / kRows) * nb + b) * kRows * QT;
    const int j = (int)(n % kRows), hdr = header_bytes(QT), co = code_offset(QT);
    std::memcpy(tmp, blk + 2 * j, 2);
    if (block_min(QT)) std::memcpy(tmp + 2, blk + 2 * kRows + 2 * j, 2);
    const uint8_t* codes = blk + kRows * hdr;
    for (int c = 0; c < (QT == kQ8_0 ? 8 : 4); ++c)
        for (int i = 0; i < 4; ++i) tmp[co + 4 * c + i] = codes[c * 64 + 4 * j + i] ^ (QT == kQ8_0 ? 0x80 : 0);
    if (has_fifth(QT)) std::memcpy(tmp + fifth_offset(QT), codes + 4 * 64 + 4 * j, 4);
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
                    if (block_min(QT)) std::memcpy(o + 2 * kRows + 2 * j, blk + 2, 2);
                    for (int c = 0; c < (QT == kQ8_0 ? 8 : 4); ++c)
                        for (int i = 0; i < 4; ++i)
                            codes[c * 64 + 4 * j + i] = blk[code_offset(QT) + 4 * c + i] ^ (QT == kQ8_0 ? 0x80 : 0);
                    if (has_fifth(QT)) std::memcpy(codes + 4 * 64 + 4 * j, blk + fifth_offset(QT), 4);
                }
            }
    });
}

// Activations per token and block of 32 as two int8 terms, x ~ d q + d2 q2: q = round(x / d),
// d = max|x| / 127, then the remainder q2 = round((x - d q) / d2), d2 = d / 254 (|x - d q| <= d / 2).
// One int8 term alone (llama.cpp's scheme) moved the demo model's logits by a mean KL of 0.017 and
// changed 6% of its greedy tokens against the dequantized model; with the second the rounding is
// max|x| / 64516 per block, below bf16's. Each term is its own dot product with the same codes.
// qsum, qsum2: sums of q, q2 (the codes' offset); qsum_lo, qsum2_lo: the same over the block's
// first 16 (Q6_K's, Q3_K's and Q2_K's scales are per 16 weights); sum: the exact sum of x (Q4_1's, Q4_K's
// minimum).
using QuantX = QuantActs;   // (kernels.h)

// One block of 32 activations (r: its index in the QuantX arrays).
inline void quantize_block(const float* xb, QuantX& X, int64_t r) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(x0)), _mm512_reduce_max_ps(_mm512_abs_ps(x1)));
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
#elif defined(__AVX2__) && defined(__FMA__)
    // x[0..8), x[8..16), x[16..24), x[24..32); the sum in _mm512_reduce_add_ps's order (halves of
    // x0 + x1, then of that, ...), so that X.sum has the AVX-512 path's bits.
    __m256 xv[4];
    for (int i = 0; i < 4; ++i) xv[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 m8 = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, xv[0]), _mm256_andnot_ps(sign, xv[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, xv[2]), _mm256_andnot_ps(sign, xv[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
    __m256 lo16 = _mm256_add_ps(xv[0], xv[2]), hi16 = _mm256_add_ps(xv[1], xv[3]);
    asm("" : "+x"(lo16), "+x"(hi16));   // -ffast-math would otherwise sum (xv2 + xv3) + (xv0 + xv1)
    const __m256 s8 = _mm256_add_ps(hi16, lo16);
    const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
    const __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(1, 0, 3, 2)));
    const float sum = _mm_cvtss_f32(s2) + _mm_cvtss_f32(_mm_shuffle_ps(s2, s2, 1));
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
        if (h == 0) {
            X.qsum_lo[r] = _mm512_reduce_add_epi32(v);
            X.qsum2_lo[r] = _mm512_reduce_add_epi32(v2);
        }
    }
    X.qsum[r] = _mm512_reduce_add_epi32(qs);
    X.qsum2[r] = _mm512_reduce_add_epi32(q2s);
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 vd = _mm256_set1_ps(d), vid = _mm256_set1_ps(id), vid2 = _mm256_set1_ps(id2);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i v[4], v2[4];
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(xv[i], vid));
        const __m256 rem = _mm256_sub_ps(xv[i], _mm256_mul_ps(vd, _mm256_cvtepi32_ps(v[i])));
        v2[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(rem, vid2))));
    }
    // 32 int32 lanes (all within +-127) to 32 bytes in order: packs interleave 128-bit lanes.
    auto bytes = [](const __m256i (&w)[4]) {
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
        return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    };
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes(v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q2), bytes(v2));
    auto hsum = [](__m256i a) {
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
        return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
    };
    X.qsum_lo[r] = hsum(_mm256_add_epi32(v[0], v[1]));
    X.qsum2_lo[r] = hsum(_mm256_add_epi32(v2[0], v2[1]));
    X.qsum[r] = X.qsum_lo[r] + hsum(_mm256_add_epi32(v[2], v[3]));
    X.qsum2[r] = X.qsum2_lo[r] + hsum(_mm256_add_epi32(v2[2], v2[3]));
#else
    int32_t qsum = 0, qsum2 = 0;
    for (int i = 0; i < kBlock; ++i) {
        const int v = (int)std::nearbyint(xb[i] * id);
        const int v2 = std::clamp((int)std::nearbyint((xb[i] - d * (float)v) * id2), -127, 127);
        q[i] = (int8_t)v;
        q2[i] = (int8_t)v2;
        qsum += v;
        qsum2 += v2;
        if (i == 15) {
            X.qsum_lo[r] = qsum;
            X.qsum2_lo[r] = qsum2;
        }
    }
    X.qsum[r] = qsum;
    X.qsum2[r] = qsum2;
#endif
    X.d[r] = d;
    X.d2[r] = d2;
    X.sum[r] = sum;
}

}  // namespace

void reserve_quant(QuantActs& X, int64_t M, int64_t K) {
    const int64_t n = M * (K / kBlock);
    if ((int64_t)X.q.size() < M * K) {
        X.q.resize(M * K);
        X.q2.resize(M * K);
    }
    if ((int64_t)X.d.size() < n)
        for (auto* v : {&X.d, &X.d2, &X.sum}) v->resize(n);
    if ((int64_t)X.qsum.size() < n)
        for (auto* v : {&X.qsum, &X.qsum2, &X.qsum_lo, &X.qsum2_lo}) v->resize(n);
}

namespace {

// x's M rows of K quantized into X. In a decode team every thread quantizes all of x for itself,
// into its own buffers (sized before the region); elsewhere into a fresh X (a prefill's can be
// tens of MB, not to be kept).
void quantize_into(const float* x, int64_t M, int64_t K, QuantX& X) {
    const int64_t n = M * (K / kBlock);
    reserve_quant(X, M, K);
    if (conveyor::team()) {
        for (int64_t r = 0; r < n; ++r) quantize_block(x + r * kBlock, X, r);
    } else {
        at::parallel_for(0, n, 256, [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; ++r) quantize_block(x + r * kBlock, X, r);
        });
    }
}

// Calls f(X) with x quantized (see quantize_into for where X lives).
template <typename F>
inline void with_quantized(const float* x, int64_t M, int64_t K, F&& f) {
    if (const conveyor::Team* tm = conveyor::team()) {
        QuantX& own = tm->scratch->quant;
        quantize_into(x, M, K, own);
        f(static_cast<const QuantX&>(own));
    } else {
        QuantX fresh;
        quantize_into(x, M, K, fresh);
        f(static_cast<const QuantX&>(fresh));
    }
}

// A token's scales of one block (QuantX's d, d2, sum, qsum, qsum2 at its row r).
struct BlockScales {
    float d, d2, sum;
    int32_t qsum, qsum2;
};
inline BlockScales scales_at(const QuantX& X, int64_t r) { return {X.d[r], X.d2[r], X.sum[r], X.qsum[r], X.qsum2[r]}; }

// f(mc, m, g): group g of 16 rows for tokens [m, m + mc), groups shared out over the threads.
template <typename F>
inline void group_passes(int64_t N, int64_t M, F&& f) {
    conveyor::parallel_for(0, N / kRows, 1, [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g)
            token_passes(0, M, [&](auto mc, int64_t m) { f(mc, m, g); });
    });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// A group's 16 output rows of M tokens (lane j: row n0 + j), plus the bias, into y.
template <int M, typename T>
inline void store_group(const __m512 (&acc)[M], const T* bias, T* y, int64_t ldy, int64_t m0, int64_t n0) {
    alignas(64) float out[kRows];
    for (int m = 0; m < M; ++m) {
        _mm512_store_ps(out, acc[m]);
        T* ym = y + (m0 + m) * ldy + n0;
        for (int j = 0; j < kRows; ++j) narrow(out[j] + (bias ? widen(bias[n0 + j]) : 0.f), ym + j);
    }
}

// A block's codes for a group's 16 rows as 8 vectors, vector t holding in lane j row j's weights
// 4t..4t+3 as unsigned bytes -- the operand of VNNI's dot products, and stored one after another
// the B tile of AMX's (8 rows of 64 bytes).
template <int QT>
inline void block_codes(const uint8_t* cp, __m512i (&codes)[8]) {
    if constexpr (QT == kQ8_0) {
        for (int t = 0; t < 8; ++t) codes[t] = _mm512_loadu_si512(cp + 64 * t);
    } else {
        const __m512i nib = _mm512_set1_epi8(0x0F);
        for (int c = 0; c < 4; ++c) {
            const __m512i raw = _mm512_loadu_si512(cp + 64 * c);
            codes[c] = _mm512_and_si512(raw, nib);
            codes[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
        }
        if constexpr (has_fifth(QT)) {
            // Lane j's word holds row j's fifth bits; chunk c's byte i is weight 4c + i (low
            // nibbles) or 16 + 4c + i (high): bits 4c..4c+3 of the word go to bit 4 of bytes 0..3.
            // Multiplying 4 bits by 1 + 2^7 + 2^14 + 2^21 puts bit i at 8i (no carries).
            const __m512i qh = _mm512_loadu_si512(cp + 64 * 4);
            const __m512i four = _mm512_set1_epi32(0xF), spread = _mm512_set1_epi32(0x00204081),
                          ones = _mm512_set1_epi32(0x01010101);
            auto fifth = [&](__m512i bits) {
                return _mm512_slli_epi32(
                    _mm512_and_si512(_mm512_mullo_epi32(_mm512_and_si512(bits, four), spread), ones), 4);
            };
            for (int t = 0; t < 8; ++t) codes[t] = _mm512_or_si512(codes[t], fifth(_mm512_srli_epi32(qh, 4 * t)));
        }
    }
}

// A token's term of one block for a group's 16 rows (lane j: row j), added to acc: a, a2 the
// exact int32 dot products of the codes with q, q2. Whichever unit computed a and a2 (VNNI, AMX),
// this is the one place their sums are scaled, so a token's result does not depend on which did.
template <int QT>
inline __m512 block_term(__m512i a, __m512i a2, const BlockScales& x, __m512 dw, __m512 mw, __m512 acc) {
    constexpr int off = code_zero(QT);
    if constexpr (off != 0) {
        a = _mm512_sub_epi32(a, _mm512_set1_epi32(off * x.qsum));
        a2 = _mm512_sub_epi32(a2, _mm512_set1_epi32(off * x.qsum2));
    }
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2), _mm512_set1_ps(x.d2),
                                     _mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(x.d)));
    acc = _mm512_fmadd_ps(v, dw, acc);
    if constexpr (block_min(QT)) acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.sum), acc);
    return acc;
}

// A block's 16 fp16 scales (and Q4_1's minima) as fp32 lanes.
template <int QT>
inline void block_scales(const uint8_t* blk, __m512& dw, __m512& mw) {
    dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    mw = _mm512_setzero_ps();
    if constexpr (block_min(QT)) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2 * kRows)));
}

// One group of 16 output rows for M tokens.
template <int QT, int M, typename T>
inline void x16_group(const QuantX& X, int64_t m0, int64_t nb, const uint8_t* wg, const T* bias, T* y, int64_t ldy,
                      int64_t n0) {
    constexpr int hdr = header_bytes(QT);
    const int64_t K = nb * kBlock;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = wg + b * kRows * QT;
        // Passes of a few tokens are bound by memory: the block 32 ahead (10-17 KB) into L2 keeps
        // more lines in flight per core (single stream: demo model 2-16%, Gemma 3 270M 2% faster
        // than 8 ahead into L1; docs/performance.md). Passes of 8 tokens lost 2-4% so: 8 into L1.
        for (int l = 0; l < kRows * QT; l += 64) {
            const char* ahead = reinterpret_cast<const char*>(blk) + (M <= 4 ? 32 : 8) * kRows * QT + l;
            if constexpr (M <= 4) _mm_prefetch(ahead, _MM_HINT_T1);
            else _mm_prefetch(ahead, _MM_HINT_T0);
        }
        __m512 dw, mw;
        block_scales<QT>(blk, dw, mw);
        __m512i codes[8];
        block_codes<QT>(blk + kRows * hdr, codes);
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
            acc[m] = block_term<QT>(_mm512_add_epi32(a, b), _mm512_add_epi32(a2, b2), scales_at(X, r), dw, mw, acc[m]);
        }
    }
    store_group<M>(acc, bias, y, ldy, m0, n0);
}

// ---- AMX: the same int32 dot products, tiles of tokens at a time -----------------------------
// An AMX tile multiply (TDPBSUD) takes an A tile of 16 rows of 32 signed bytes against a B tile of
// 8 rows of 64 unsigned bytes, row t holding in bytes 4j..4j+3 weight row j's codes 4t..4t+3 --
// exactly block_codes' 8 vectors -- and adds the exact int32 dot products into a 16 x 16 tile. An A
// tile here is 8 tokens' q rows then their q2 rows (pack_tiles), so one multiply gives both terms
// of 8 tokens for 16 weight rows; four run per step of the loop (2 A tiles x 2 groups of 16 rows).
// K per multiply is one block of 32, since every block has its own scales: the int32 sums are stored
// and scaled by block_term lane by lane as on VNNI, so each token's output is the VNNI kernel's, bit
// for bit, whichever path a step takes (tests/model/test_quant.py). Only whole pairs of A tiles (16
// tokens) run here; the rest of a step's tokens run on VNNI. Measured alone (benchmarks/gemm_shapes.py).
#if CONVEYOR_INT8_AMX
constexpr int64_t kTileTokens = 8;    // tokens per A tile (their q rows, then their q2 rows)
constexpr int64_t kAmxPass = 64;      // tokens per pass over two groups' weights (acc: 64 x 32 floats)

// Linux lends a process AMX's tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_permitted() {
    static const bool ok = [] {
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return ok;
}

// Tiles 0, 1: A (two tiles of 8 tokens); 2, 3: B (two groups' codes); 4-7: C (A0 B0, A0 B1, A1 B0,
// A1 B1). A constant in memory: GCC 12 dropped the stores of a config built on the stack before
// LDTILECFG, which then faulted. Loaded by each thread at the start of its share (the configuration
// is per thread, and oneDNN loads its own).
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
const TileConfig kTiles = {1, 0, {}, {kBlock, kBlock, 64, 64, 64, 64, 64, 64}, {16, 16, 8, 8, 16, 16, 16, 16}};

// The A tiles and scales of tokens [0, Mt): per 8 tokens and block, 16 rows of 32 bytes (q of
// each token, then q2) and the 8 tokens' BlockScales.
struct TilePack {
    std::vector<int8_t> q;
    std::vector<BlockScales> scales;
};
void pack_tiles(const QuantX& X, int64_t Mt, int64_t K, TilePack& P) {
    const int64_t nb = K / kBlock;
    P.q.resize(Mt * K * 2);
    P.scales.resize(Mt * nb);
    at::parallel_for(0, Mt / kTileTokens, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
            for (int64_t b = 0; b < nb; ++b) {
                int8_t* o = P.q.data() + (t * nb + b) * 2 * kTileTokens * kBlock;
                for (int64_t i = 0; i < kTileTokens; ++i) {
                    const int64_t m = t * kTileTokens + i;
                    std::memcpy(o + kBlock * i, X.q.data() + m * K + b * kBlock, kBlock);
                    std::memcpy(o + kBlock * (kTileTokens + i), X.q2.data() + m * K + b * kBlock, kBlock);
                    P.scales[(t * nb + b) * kTileTokens + i] = scales_at(X, m * nb + b);
                }
            }
    });
}

template <int QT, typename T>
void x16_amx(const QuantX& X, int64_t M, int64_t K, const uint8_t* w, int64_t N, const T* bias, T* y, int64_t ldy) {
    constexpr int hdr = header_bytes(QT);
    constexpr int64_t kTileBytes = 2 * kTileTokens * kBlock;
    const int64_t nb = K / kBlock, gbytes = nb * kRows * QT, groups = N / kRows;
    const int64_t Mt = M / (2 * kTileTokens) * (2 * kTileTokens);
    TilePack P;
    pack_tiles(X, Mt, K, P);
    conveyor::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
        _tile_loadconfig(&kTiles);
        alignas(64) uint8_t cbuf[2][8 * 64];
        alignas(64) int32_t sums[2][4][16 * kRows];   // two steps' C tiles (one being scaled)
        alignas(64) float acc[kAmxPass][2 * kRows];
        for (int64_t pr = p0; pr < p1; ++pr) {
            const int64_t g = 2 * pr;
            const int ng = g + 1 < groups ? 2 : 1;   // an odd group count leaves one alone
            for (int64_t m0 = 0; m0 < Mt; m0 += kAmxPass) {
                const int64_t m1 = std::min(Mt, m0 + kAmxPass);
                std::memset(acc, 0, sizeof(acc));
                // The C tiles of step (m, b) are scaled during the next step's multiplies.
                int pending = -1;
                int64_t pm = 0, pb = 0;
                __m512 pdw[2], pmw[2];
                auto scale = [&](int set, int64_t m, int64_t b, const __m512 (&dw)[2], const __m512 (&mw)[2]) {
                    for (int h = 0; h < 2; ++h)
                        for (int gg = 0; gg < ng; ++gg) {
                            const int32_t* c = sums[set][2 * h + gg];
                            const BlockScales* sc = P.scales.data() + ((m / kTileTokens + h) * nb + b) * kTileTokens;
                            for (int64_t i = 0; i < kTileTokens; ++i) {
                                float* a = acc[m - m0 + h * kTileTokens + i] + gg * kRows;
                                _mm512_store_ps(a, block_term<QT>(_mm512_load_si512(c + kRows * i),
                                                                  _mm512_load_si512(c + kRows * (kTileTokens + i)),
                                                                  sc[i], dw[gg], mw[gg], _mm512_load_ps(a)));
                            }
                        }
                };
                int set = 0;
                for (int64_t b = 0; b < nb; ++b) {
                    __m512 dw[2] = {}, mw[2] = {};
                    for (int gg = 0; gg < ng; ++gg) {
                        const uint8_t* blk = w + (g + gg) * gbytes + b * kRows * QT;
                        for (int l = 0; l < kRows * QT; l += 64)
                            _mm_prefetch(reinterpret_cast<const char*>(blk) + 2 * kRows * QT + l, _MM_HINT_T0);
                        block_scales<QT>(blk, dw[gg], mw[gg]);
                        if constexpr (QT != kQ8_0) {   // Q8_0's codes are stored as the B tile
                            __m512i codes[8];
                            block_codes<QT>(blk + kRows * hdr, codes);
                            for (int t = 0; t < 8; ++t) _mm512_store_si512(cbuf[gg] + 64 * t, codes[t]);
                        }
                    }
                    auto codes_at = [&](int gg) -> const void* {
                        return QT == kQ8_0 ? static_cast<const void*>(w + (g + gg) * gbytes + b * kRows * QT + kRows * hdr)
                                           : static_cast<const void*>(cbuf[gg]);
                    };
                    // GCC 12's tile loads are asm without a memory operand: keep the cbuf stores before them.
                    asm volatile("" ::: "memory");
                    _tile_loadd(2, codes_at(0), 64);
                    if (ng == 2) _tile_loadd(3, codes_at(ng - 1), 64);
                    for (int64_t m = m0; m < m1; m += 2 * kTileTokens) {
                        const int8_t* a0 = P.q.data() + ((m / kTileTokens) * nb + b) * kTileBytes;
                        _tile_loadd(0, a0, kBlock);
                        _tile_loadd(1, a0 + nb * kTileBytes, kBlock);
                        _tile_zero(4);
                        _tile_zero(6);
                        _tile_dpbsud(4, 0, 2);
                        _tile_dpbsud(6, 1, 2);
                        if (ng == 2) {
                            _tile_zero(5);
                            _tile_zero(7);
                            _tile_dpbsud(5, 0, 3);
                            _tile_dpbsud(7, 1, 3);
                        }
                        if (pending >= 0) scale(pending, pm, pb, pdw, pmw);
                        _tile_stored(4, sums[set][0], 64);
                        _tile_stored(6, sums[set][2], 64);
                        if (ng == 2) {
                            _tile_stored(5, sums[set][1], 64);
                            _tile_stored(7, sums[set][3], 64);
                        }
                        pending = set;
                        pm = m;
                        pb = b;
                        for (int gg = 0; gg < 2; ++gg) {
                            pdw[gg] = dw[gg];
                            pmw[gg] = mw[gg];
                        }
                        set ^= 1;
                    }
                }
                scale(pending, pm, pb, pdw, pmw);
                for (int64_t m = m0; m < m1; ++m)
                    for (int gg = 0; gg < ng; ++gg) {
                        const int64_t n0 = (g + gg) * kRows;
                        T* ym = y + m * ldy + n0;
                        for (int j = 0; j < kRows; ++j)
                            narrow(acc[m - m0][gg * kRows + j] + (bias ? widen(bias[n0 + j]) : 0.f), ym + j);
                    }
            }
            for (int gg = 0; gg < ng; ++gg)   // the tokens short of a pair of tiles: VNNI
                token_passes(Mt, M, [&](auto mc, int64_t m) {
                    x16_group<QT, decltype(mc)::value>(X, m, nb, w + (g + gg) * gbytes, bias, y, ldy, (g + gg) * kRows);
                });
        }
        _tile_release();
    });
}
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ---- AVX2 (no AVX-512): the same int32 dot products, 8 rows at a time -------------------------
// A group's 16 rows run as two halves of 8 (rows 8h..8h+7: bytes 32h..32h+31 of every 64-byte chunk,
// scales 8h..8h+7), each over the whole K (the second half's bytes come from L1/L2). AVX2 has no
// u8 x s8 dot product into int32: _mm256_maddubs_epi16 multiplies codes by activations and adds
// pairs into int16 (saturating), _mm256_madd_epi16 by ones adds pairs of those into int32. The
// int16 sums are exact while they fit: a pair is at most 2 x 127 x the largest code, so up to
// 32767 / (254 x max code) chunks are summed in int16 before widening (codes of up to 5 bits: all
// 4 chunks of a half-block; Q6_K's 6 bits: 2). Q8_0's codes (0..255) would overflow a pair: they run as
// signed weights w = code - 128 with llama.cpp's sign trick (|w| x sign(w) x), at most 2 x 128 x 127.
// The int32 sums are the VNNI path's, and they are scaled by the same operations lane by lane, so
// each output is the VNNI kernel's to the bit (tests/model/test_quant_avx2.py).
// With AVX-VNNI (the VEX-encoded vpdpbusd of Alder Lake, Sierra Forest, Zen 5 and later Xeons) the
// dot products run as on AVX512-VNNI, 8 lanes wide: no int16 step, Q8_0's codes unsigned.
#if defined(__AVXVNNI__)
constexpr bool kSignedQ8 = false;
#else
constexpr bool kSignedQ8 = true;   // Q8_0 as signed weights, the sign trick (vpmaddubsw would saturate)
#endif

// Chunks summed in int16 before widening, for codes of at most `max_code`.
constexpr int int16_chunks(int max_code) { return 32767 / (254 * max_code) >= 4 ? 4 : 32767 / (254 * max_code); }

// Sum over chunks [t0, t0 + 4) of a half's 8 rows (codes) against a token's 4-byte groups xw:
// int32 lanes, exact. Signed: codes are signed weights (Q8_0) and mags their magnitudes, the sign
// trick applies (mags is read only then).
template <int Chunks, bool Signed = false>
inline __m256i dot_quad8(const __m256i* codes, const __m256i* mags, const int32_t* xw, int t0) {
    __m256i sum = _mm256_setzero_si256();
#if defined(__AVXVNNI__)
    static_assert(!Signed, "AVX-VNNI multiplies unsigned codes");
    for (int c = t0; c < t0 + 4; ++c) sum = _mm256_dpbusd_avx_epi32(sum, codes[c], _mm256_set1_epi32(xw[c]));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    for (int t = t0; t < t0 + 4; t += Chunks) {
        __m256i s16 = _mm256_setzero_si256();
        for (int c = t; c < t + Chunks; ++c) {
            const __m256i x = _mm256_set1_epi32(xw[c]);
            s16 = _mm256_add_epi16(s16, Signed ? _mm256_maddubs_epi16(mags[c], _mm256_sign_epi8(x, codes[c]))
                                               : _mm256_maddubs_epi16(codes[c], x));
        }
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(s16, ones));
    }
#endif
    return sum;
}

// A 64-byte chunk's half h (rows 8h..8h+7).
inline __m256i chunk_half(const uint8_t* chunk, int h) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * h));
}
// 8 fp16 values (rows 8h..8h+7 of a 16-row array of fp16 at p) as fp32 lanes.
inline __m256 halves8(const uint8_t* p, int h) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
}
// Lanes where `bits` has `bit` set: `add` added to codes (a fifth or third code bit), else codes.
inline __m256i add_where(__m256i codes, __m256i bits, __m256i bit, __m256i add) {
    return _mm256_add_epi8(codes, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bits, bit), bit), add));
}

// A half's 8 output rows of M tokens (lane j: row n0 + j), plus the bias, into y.
template <int M, typename T>
inline void store_half(const __m256 (&acc)[M], const T* bias, T* y, int64_t ldy, int64_t m0, int64_t n0) {
    alignas(32) float out[8];
    for (int m = 0; m < M; ++m) {
        _mm256_store_ps(out, acc[m]);
        T* ym = y + (m0 + m) * ldy + n0;
        for (int j = 0; j < 8; ++j) narrow(out[j] + (bias ? widen(bias[n0 + j]) : 0.f), ym + j);
    }
}

// A block's codes for half h of a group as 8 vectors (vector t: in lane j row 8h + j's weights
// 4t..4t+3); Q8_0's as signed weights (kSignedQ8).
template <int QT>
inline void block_codes8(const uint8_t* cp, int h, __m256i (&codes)[8]) {
    if constexpr (QT == kQ8_0) {
        const __m256i flip = _mm256_set1_epi8(kSignedQ8 ? (char)0x80 : 0);
        for (int t = 0; t < 8; ++t) codes[t] = _mm256_xor_si256(chunk_half(cp + 64 * t, h), flip);
    } else {
        const __m256i nib = _mm256_set1_epi8(0x0F);
        for (int c = 0; c < 4; ++c) {
            const __m256i raw = chunk_half(cp + 64 * c, h);
            codes[c] = _mm256_and_si256(raw, nib);
            codes[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
        }
        if constexpr (has_fifth(QT)) {   // as block_codes (VNNI): bits 4c..4c+3 of a row's word to bit 4 of bytes 0..3
            const __m256i qh = chunk_half(cp + 64 * 4, h);
            const __m256i four = _mm256_set1_epi32(0xF), spread = _mm256_set1_epi32(0x00204081),
                          ones = _mm256_set1_epi32(0x01010101);
            for (int t = 0; t < 8; ++t) {
                const __m256i bits = _mm256_and_si256(_mm256_srli_epi32(qh, 4 * t), four);
                codes[t] = _mm256_or_si256(codes[t], _mm256_slli_epi32(
                                                         _mm256_and_si256(_mm256_mullo_epi32(bits, spread), ones), 4));
            }
        }
    }
}

// block_term (VNNI) for 8 rows: a, a2 the exact dot products (Q8_0's of signed weights: centred).
template <int QT>
inline __m256 block_term8(__m256i a, __m256i a2, const BlockScales& x, __m256 dw, __m256 mw, __m256 acc) {
    constexpr int off = QT == kQ8_0 && kSignedQ8 ? 0 : code_zero(QT);
    if constexpr (off != 0) {
        a = _mm256_sub_epi32(a, _mm256_set1_epi32(off * x.qsum));
        a2 = _mm256_sub_epi32(a2, _mm256_set1_epi32(off * x.qsum2));
    }
    const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a2), _mm256_set1_ps(x.d2),
                                     _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(x.d)));
    acc = _mm256_fmadd_ps(v, dw, acc);
    if constexpr (block_min(QT)) acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.sum), acc);
    return acc;
}

// One group of 16 output rows for M tokens, half by half.
template <int QT, int M, typename T>
inline void x16_group(const QuantX& X, int64_t m0, int64_t nb, const uint8_t* wg, const T* bias, T* y, int64_t ldy,
                      int64_t n0) {
    constexpr int hdr = header_bytes(QT);
    constexpr int chunks = QT == kQ8_0 ? 1 : int16_chunks(has_fifth(QT) ? 31 : 15);
    const int64_t K = nb * kBlock;
    for (int h = 0; h < 2; ++h) {
        __m256 acc[M];
        for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = wg + b * kRows * QT;
            for (int l = 0; l < kRows * QT; l += 64)
                _mm_prefetch(reinterpret_cast<const char*>(blk) + (M <= 4 ? 32 : 8) * kRows * QT + l,
                             M <= 4 ? _MM_HINT_T1 : _MM_HINT_T0);
            const __m256 dw = halves8(blk, h);
            const __m256 mw = block_min(QT) ? halves8(blk + 2 * kRows, h) : _mm256_setzero_ps();
            __m256i codes[8], mags[8];
            block_codes8<QT>(blk + kRows * hdr, h, codes);
            constexpr bool sg = QT == kQ8_0 && kSignedQ8;
            if constexpr (sg)   // once per block, not per token
                for (int t = 0; t < 8; ++t) mags[t] = _mm256_abs_epi8(codes[t]);
            for (int m = 0; m < M; ++m) {
                const int64_t r = (m0 + m) * nb + b;
                const int32_t* xw = reinterpret_cast<const int32_t*>(X.q.data() + (m0 + m) * K + b * kBlock);
                const int32_t* xw2 = reinterpret_cast<const int32_t*>(X.q2.data() + (m0 + m) * K + b * kBlock);
                const __m256i a = _mm256_add_epi32(dot_quad8<chunks, sg>(codes, mags, xw, 0),
                                                   dot_quad8<chunks, sg>(codes, mags, xw, 4));
                const __m256i a2 = _mm256_add_epi32(dot_quad8<chunks, sg>(codes, mags, xw2, 0),
                                                    dot_quad8<chunks, sg>(codes, mags, xw2, 4));
                acc[m] = block_term8<QT>(a, a2, scales_at(X, r), dw, mw, acc[m]);
            }
        }
        store_half<M>(acc, bias, y, ldy, m0, n0 + 8 * h);
    }
}

#endif

#if CONVEYOR_INT8_VECTOR
// The x16 layout on the vector int8 kernel (x16_group: AVX512-VNNI's or AVX2's).
template <int QT, typename T>
void x16_impl(const QuantX& X, int64_t M, int64_t K, const uint8_t* w, int64_t N, const T* bias, T* y, int64_t ldy) {
    const int64_t nb = K / kBlock, gbytes = nb * kRows * QT;
    group_passes(N, M, [&](auto mc, int64_t m, int64_t g) {
        x16_group<QT, decltype(mc)::value>(X, m, nb, w + g * gbytes, bias, y, ldy, g * kRows);
    });
}
#endif

#if !CONVEYOR_INT8_AMX
bool amx_permitted() { return false; }
#endif

// Whether steps of 16 tokens or more take AMX (set_int8_amx: off to compare; same results).
std::atomic<bool> g_int8_amx{true};

inline bool use_amx(int64_t M) {
    return kHaveAmx && M >= kAmxMinTokens && !conveyor::team() && g_int8_amx.load(std::memory_order_relaxed) &&
           amx_permitted();
}

// The x16 layout without VNNI (a file repacked elsewhere): the int8 arithmetic, scalar.
template <int QT, typename T>
void x16_portable(const QuantX& X, int64_t M, int64_t K, const uint8_t* w, int64_t N, const T* bias, T* y,
                  int64_t ldy) {
    const int64_t nb = K / kBlock;
    constexpr int off = code_zero(QT);
    conveyor::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
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
                            const uint8_t byte = blk[code_offset(QT) + (i % 16)];
                            code = i < 16 ? (byte & 0x0F) : (byte >> 4);
                            if (has_fifth(QT)) code |= ((u32_at(blk + fifth_offset(QT)) >> i) & 1) << 4;
                        }
                        dot += code * xq[i];
                        dot2 += code * xq2[i];
                    }
                    const int64_t r = m * nb + b;
                    s += ((float)(dot - off * X.qsum[r]) * X.d[r] + (float)(dot2 - off * X.qsum2[r]) * X.d2[r]) *
                         half_at(blk);
                    if (block_min(QT)) s += half_at(blk + 2) * X.sum[r];
                }
                narrow(s + (bias ? widen(bias[n]) : 0.f), y + m * ldy + n);
            }
    });
}

template <int QT, typename T>
void qgemv_typed(const QInfo& info, const float* x, int64_t M, int64_t K, const uint8_t* w, const T* bias, T* y,
                 int64_t ldy) {
    if (!info.x16) {
        qgemv_impl<QT, T>(x, M, K, w, info.N, (K / kBlock) * QT, bias, y, ldy);
        return;
    }
    with_quantized(x, M, K, [&](const QuantX& X) {
#if CONVEYOR_INT8_AMX
        if (use_amx(M)) x16_amx<QT, T>(X, M, K, w, info.N, bias, y, ldy);
        else x16_impl<QT, T>(X, M, K, w, info.N, bias, y, ldy);
#elif CONVEYOR_INT8_VECTOR
        x16_impl<QT, T>(X, M, K, w, info.N, bias, y, ldy);
#else
        x16_portable<QT, T>(X, M, K, w, info.N, bias, y, ldy);
#endif
    });
}

template <typename T>
void dispatch_qgemv(const QInfo& info, const float* x, int64_t M, int64_t K, const uint8_t* w, const T* bias, T* y,
                    int64_t ldy) {
    with_qtype(info.qt, [&](auto qt) { qgemv_typed<decltype(qt)::value, T>(info, x, M, K, w, bias, y, ldy); });
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
        with_qtype(info.qt, [&](auto qt) { dequant_impl<decltype(qt)::value, T>(wp, info.x16, K, ids, rows, o); });
    };
    if (dtype == torch::kBFloat16) run(out.data_ptr<at::BFloat16>());
    else run(out.data_ptr<float>());
    return out;
}

// ---- K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): super-blocks of 256 weights, in an x16 layout only -
// ggml's plain super-blocks (bytes per 256 weights):
//   Q4_K (144): d, dmin (fp16); 12 bytes of 6-bit scales and minima of 8 sub-blocks of 32; 128 bytes
//     of 4-bit codes, bytes 32p..32p+31 holding sub-block 2p (low nibbles) and 2p+1 (high nibbles);
//     weight = d * scale * code - dmin * min.
//   Q5_K (176): Q4_K's d, dmin and 12 scale bytes; 32 bytes of fifth bits (byte l, bit s: weight l of
//     sub-block s); then Q4_K's 128 bytes of low 4 bits. code = low | fifth << 4, 0..31.
//   Q6_K (210): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 int8 scales (one per 16
//     weights), d (fp16); weight = d * scale * (code - 32).
//   Q3_K (110): 32 bytes of high bits (byte l, bit 4h + k: weight 128h + 32k + l), 64 bytes of low 2
//     bits (byte 32h + l, bits 2k..2k+1: the same weight), 12 bytes of 16 6-bit scales s, d (fp16);
//     weight = d * (s - 32) * (code - 4), code = low + 4 * high (0..7).
//   Q2_K (84): 16 bytes of 4-bit scales (low nibble) and minima (high nibble) per 16 weights, 64 bytes
//     of 2-bit codes (Q3_K's low bits), d and dmin (fp16); weight = d * scale * code - dmin * min.
// The x16 layout is a 3-D tensor [N / 16, super-blocks, bytes] (its shape tells it from the 32-blocks'
// layouts); per group of 16 rows and super-block, lane j being row j:
//   Q4_K (2368 = 16 x 148): 16 d, 16 dmin (fp16); 8 x 16 scale bytes (sub-block-major); 8 x 16 min
//     bytes; then per pair p of sub-blocks 8 chunks of 64 bytes, chunk t holding in lane j row j's
//     code bytes 32p + 4t .. 32p + 4t + 3 (low nibbles: sub-block 2p's weights 4t..4t+3; high: 2p+1's);
//   Q5_K (2880 = 16 x 180): Q4_K's layout, then 8 chunks of 64 bytes of fifth bits, chunk t holding in
//     lane j row j's bytes 4t..4t+3 (bit s: sub-block s's weight 4t+i);
//   Q6_K (3360 = 16 x 210, the file's bytes): 16 d (fp16); 16 x 16 scale bytes (int8, per 16
//     weights); then per block b of 32 weights 4 chunks of 64 bytes of low 4 bits, chunk c holding
//     in lane j row j's weights 4c..4c+3 (low nibbles) and 16+4c..16+4c+3 (high nibbles), and 2
//     chunks of high 2 bits, chunk h holding in lane j byte k bits 2q..2q+1 of weight 4(4h+q)+k
//     (so code vector t = 4h+q takes them with one shift and one mask).
//   Q3_K (1824 = 16 x 114): 16 d (fp16); 16 x 16 scale bytes (int8 s - 32, per 16 weights); then per
//     block of 32 weights 2 chunks of 64 bytes of low 2 bits as Q6_K's high 2 bits (chunk h, lane j,
//     byte k, bits 2q..2q+1: weight 4(4h+q)+k), and a chunk of high bits (lane j, byte k, bit t:
//     weight 4t+k).
//   Q2_K (1344 = 16 x 84, the file's bytes): 16 d, 16 dmin (fp16); 16 x 16 bytes of scale | min << 4;
//     then per block of 32 weights Q3_K's 2 chunks of low 2 bits.
// Q4_K's layout is 1.03x the file's bytes, Q5_K's 1.02x, Q3_K's 1.04x, Q2_K's and Q6_K's 1x.
// Only the int8 (two-term activation) arithmetic of the 32-blocks' x16 kernel runs them.
enum KType { kQ2_K = 84, kQ3_K = 110, kQ4_K = 144, kQ5_K = 176, kQ6_K = 210 };   // bytes per plain super-block of 256
constexpr int kSuper = 256;
constexpr int64_t kx16_bytes(int KT) {
    return KT == kQ4_K ? 2368 : KT == kQ5_K ? 2880 : KT == kQ6_K ? 3360 : KT == kQ3_K ? 1824 : 1344;
}
// Q3_K's and Q2_K's x16 layouts: where block blk's code chunks start.
constexpr int64_t k2bit_block(int KT, int blk) { return KT == kQ3_K ? 288 + 192 * blk : 320 + 128 * blk; }
constexpr int64_t kFifthBits = 2368;   // where Q5_K's fifth bits start in its x16 super-block
// Q4_K and Q5_K: weight = d * scale * code - dmin * min, per 32 weights; Q6_K and Q3_K: a zero code
// (32, 4) instead of minima, int8 scales per 16 weights; Q2_K: scales and minima per 16 weights (its
// minima times the activations' int8 terms' sums: the exact weight times the two-term activations).
constexpr bool has_min(int KT) { return KT == kQ4_K || KT == kQ5_K; }
constexpr int kzero(int KT) { return KT == kQ6_K ? 32 : KT == kQ3_K ? 4 : 0; }

template <typename F>
inline void with_ktype(int kt, F&& f) {
    if (kt == kQ4_K) f(std::integral_constant<int, kQ4_K>{});
    else if (kt == kQ5_K) f(std::integral_constant<int, kQ5_K>{});
    else if (kt == kQ3_K) f(std::integral_constant<int, kQ3_K>{});
    else if (kt == kQ2_K) f(std::integral_constant<int, kQ2_K>{});
    else f(std::integral_constant<int, kQ6_K>{});
}

int ktype_of_x16(int64_t bytes) {
    for (int kt : {kQ2_K, kQ3_K, kQ4_K, kQ5_K, kQ6_K})
        if (bytes == kx16_bytes(kt)) return kt;
    TORCH_CHECK(false, "unknown K-quant x16 layout (", bytes, " bytes per super-block)");
    return 0;
}

// Q4_K's 6-bit scale and minimum of sub-block j (ggml's packing of 8 pairs into 12 bytes).
inline void q4k_scale_min(const uint8_t* sc, int j, uint8_t& scale, uint8_t& min) {
    if (j < 4) {
        scale = sc[j] & 63;
        min = sc[j + 4] & 63;
    } else {
        scale = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
        min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
}

// Q6_K's 256 6-bit codes, one per byte.
inline void q6k_codes(const uint8_t* b, uint8_t* codes) {
    for (int h = 0; h < 2; ++h) {   // halves of 128 weights
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        uint8_t* c = codes + 128 * h;
        for (int l = 0; l < 32; ++l) {
            c[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            c[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            c[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            c[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
}

// The 2-bit codes of Q2_K and Q3_K's low bits (64 bytes: byte 32h + l, bits 2k..2k+1 hold weight
// 128h + 32k + l).
inline void two_bit_codes(const uint8_t* qs, uint8_t* codes) {
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < 32; ++l) codes[128 * h + 32 * k + l] = (qs[32 * h + l] >> (2 * k)) & 3;
}

// Q3_K's 256 codes (0..7: low 2 bits + 4 x high bit) and 16 scales (s - 32, int8).
inline void q3k_codes(const uint8_t* b, uint8_t* codes, int8_t* scales) {
    const uint8_t* hm = b;
    const uint8_t* sc = b + 96;
    for (int i = 0; i < 16; ++i) {
        const int low = i < 8 ? sc[i] & 0xF : sc[i - 8] >> 4;
        scales[i] = (int8_t)((low | (((sc[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32);
    }
    two_bit_codes(b + 32, codes);
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < 32; ++l) codes[128 * h + 32 * k + l] |= ((hm[l] >> (4 * h + k)) & 1) << 2;
}

// Row j's low 2 bits of a block's 32 codes (cb) into the x16 chunks at ob (Q6_K's high-2-bit
// arrangement: chunk h, byte 4j + k, bits 2q..2q+1 hold weight 4(4h+q)+k), and back.
inline void pack_two_bits(const uint8_t* cb, uint8_t* ob, int j) {
    for (int h = 0; h < 2; ++h)
        for (int k = 0; k < 4; ++k) {
            uint8_t v = 0;
            for (int q = 0; q < 4; ++q) v |= (cb[4 * (4 * h + q) + k] & 3) << (2 * q);
            ob[64 * h + 4 * j + k] = v;
        }
}
inline void unpack_two_bits(const uint8_t* ob, int j, uint8_t* cb) {
    for (int t = 0; t < 8; ++t)
        for (int k = 0; k < 4; ++k) cb[4 * t + k] = (ob[64 * (t / 4) + 4 * j + k] >> (2 * (t % 4))) & 3;
}

template <int KT>
void krepack_impl(const uint8_t* src, uint8_t* dst, int64_t N, int64_t ns) {
    at::parallel_for(0, N / kRows, 1, [&](int64_t g0, int64_t g1) {
        uint8_t codes[kSuper];
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t s = 0; s < ns; ++s) {
                uint8_t* o = dst + (g * ns + s) * kx16_bytes(KT);
                for (int j = 0; j < kRows; ++j) {
                    const uint8_t* b = src + ((g * kRows + j) * ns + s) * KT;
                    if constexpr (has_min(KT)) {
                        const uint8_t* qs = b + (KT == kQ5_K ? 48 : 16);
                        std::memcpy(o + 2 * j, b, 2);
                        std::memcpy(o + 32 + 2 * j, b + 2, 2);
                        for (int sub = 0; sub < 8; ++sub) q4k_scale_min(b + 4, sub, o[64 + 16 * sub + j], o[192 + 16 * sub + j]);
                        for (int p = 0; p < 4; ++p)
                            for (int t = 0; t < 8; ++t)
                                for (int i = 0; i < 4; ++i) o[320 + 512 * p + 64 * t + 4 * j + i] = qs[32 * p + 4 * t + i];
                        if constexpr (KT == kQ5_K)
                            for (int t = 0; t < 8; ++t)
                                for (int i = 0; i < 4; ++i) o[kFifthBits + 64 * t + 4 * j + i] = b[16 + 4 * t + i];
                    } else if constexpr (KT == kQ3_K) {
                        int8_t scales[16];
                        q3k_codes(b, codes, scales);
                        std::memcpy(o + 2 * j, b + 108, 2);
                        for (int i = 0; i < 16; ++i) o[32 + 16 * i + j] = (uint8_t)scales[i];
                        for (int blk = 0; blk < 8; ++blk) {
                            uint8_t* ob = o + k2bit_block(KT, blk);
                            const uint8_t* cb = codes + 32 * blk;
                            pack_two_bits(cb, ob, j);
                            for (int k = 0; k < 4; ++k) {
                                uint8_t hv = 0;
                                for (int t = 0; t < 8; ++t) hv |= (cb[4 * t + k] >> 2) << t;
                                ob[128 + 4 * j + k] = hv;
                            }
                        }
                    } else if constexpr (KT == kQ2_K) {
                        std::memcpy(o + 2 * j, b + 80, 2);
                        std::memcpy(o + 32 + 2 * j, b + 82, 2);
                        for (int i = 0; i < 16; ++i) o[64 + 16 * i + j] = b[i];
                        two_bit_codes(b + 16, codes);
                        for (int blk = 0; blk < 8; ++blk) pack_two_bits(codes + 32 * blk, o + k2bit_block(KT, blk), j);
                    } else {
                        std::memcpy(o + 2 * j, b + 208, 2);
                        for (int i = 0; i < 16; ++i) o[32 + 16 * i + j] = b[192 + i];
                        q6k_codes(b, codes);
                        for (int blk = 0; blk < 8; ++blk) {
                            uint8_t* ob = o + 288 + 384 * blk;
                            const uint8_t* cb = codes + 32 * blk;
                            for (int c = 0; c < 4; ++c)
                                for (int k = 0; k < 4; ++k)
                                    ob[64 * c + 4 * j + k] = (cb[4 * c + k] & 0xF) | ((cb[16 + 4 * c + k] & 0xF) << 4);
                            for (int h = 0; h < 2; ++h)
                                for (int k = 0; k < 4; ++k) {
                                    uint8_t v = 0;
                                    for (int q = 0; q < 4; ++q) v |= (cb[4 * (4 * h + q) + k] >> 4) << (2 * q);
                                    ob[256 + 64 * h + 4 * j + k] = v;
                                }
                        }
                    }
                }
            }
    });
}

// Row n's super-block s from the x16 layout: 256 codes, and per 16 weights a scale and a minimum
// (weight = scale * code - minimum; Q6_K's minimum is 32 scales, Q3_K's 4, Q2_K's dmin * min).
template <int KT>
void kx16_row(const uint8_t* w, int64_t ns, int64_t n, int64_t s, uint8_t* codes, float* scale16, float* min16) {
    const uint8_t* o = w + ((n / kRows) * ns + s) * kx16_bytes(KT);
    const int j = (int)(n % kRows);
    if constexpr (has_min(KT)) {
        const float d = half_at(o + 2 * j), dmin = half_at(o + 32 + 2 * j);
        for (int sub = 0; sub < 8; ++sub) {
            scale16[2 * sub] = scale16[2 * sub + 1] = d * (float)o[64 + 16 * sub + j];
            min16[2 * sub] = min16[2 * sub + 1] = dmin * (float)o[192 + 16 * sub + j];
        }
        for (int p = 0; p < 4; ++p)
            for (int t = 0; t < 8; ++t)
                for (int i = 0; i < 4; ++i) {
                    const uint8_t byte = o[320 + 512 * p + 64 * t + 4 * j + i];
                    codes[64 * p + 4 * t + i] = byte & 0xF;
                    codes[64 * p + 32 + 4 * t + i] = byte >> 4;
                    if constexpr (KT == kQ5_K) {
                        const uint8_t fifth = o[kFifthBits + 64 * t + 4 * j + i];
                        codes[64 * p + 4 * t + i] |= ((fifth >> (2 * p)) & 1) << 4;
                        codes[64 * p + 32 + 4 * t + i] |= ((fifth >> (2 * p + 1)) & 1) << 4;
                    }
                }
    } else if constexpr (KT == kQ2_K) {
        const float d = half_at(o + 2 * j), dmin = half_at(o + 32 + 2 * j);
        for (int i = 0; i < 16; ++i) {
            scale16[i] = d * (float)(o[64 + 16 * i + j] & 0xF);
            min16[i] = dmin * (float)(o[64 + 16 * i + j] >> 4);
        }
        for (int blk = 0; blk < 8; ++blk) unpack_two_bits(o + k2bit_block(KT, blk), j, codes + 32 * blk);
    } else {   // Q6_K, Q3_K: int8 scales per 16 weights and a zero code
        const float d = half_at(o + 2 * j);
        for (int i = 0; i < 16; ++i) {
            scale16[i] = d * (float)(int8_t)o[32 + 16 * i + j];
            min16[i] = (float)kzero(KT) * scale16[i];
        }
        if constexpr (KT == kQ3_K) {
            for (int blk = 0; blk < 8; ++blk) {
                const uint8_t* ob = o + k2bit_block(KT, blk);
                unpack_two_bits(ob, j, codes + 32 * blk);
                for (int t = 0; t < 8; ++t)
                    for (int k = 0; k < 4; ++k) codes[32 * blk + 4 * t + k] |= ((ob[128 + 4 * j + k] >> t) & 1) << 2;
            }
            return;
        }
        for (int blk = 0; blk < 8; ++blk) {
            const uint8_t* ob = o + 288 + 384 * blk;
            uint8_t* cb = codes + 32 * blk;
            for (int c = 0; c < 4; ++c)
                for (int k = 0; k < 4; ++k) {
                    cb[4 * c + k] = ob[64 * c + 4 * j + k] & 0xF;
                    cb[16 + 4 * c + k] = ob[64 * c + 4 * j + k] >> 4;
                }
            for (int h = 0; h < 2; ++h)
                for (int k = 0; k < 4; ++k)
                    for (int q = 0; q < 4; ++q)
                        cb[4 * (4 * h + q) + k] |= ((ob[256 + 64 * h + 4 * j + k] >> (2 * q)) & 3) << 4;
        }
    }
}

template <int KT, typename T>
void kdequant_impl(const uint8_t* w, int64_t K, const int64_t* ids, int64_t rows, T* out) {
    const int64_t ns = K / kSuper;
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
        uint8_t codes[kSuper];
        float scale16[16], min16[16];
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t n = ids ? ids[r] : r;
            for (int64_t s = 0; s < ns; ++s) {
                kx16_row<KT>(w, ns, n, s, codes, scale16, min16);
                T* o = out + r * K + s * kSuper;
                for (int i = 0; i < kSuper; ++i) narrow(std::fma((float)codes[i], scale16[i / 16], -min16[i / 16]), o + i);
            }
        }
    });
}

// The int8 arithmetic, scalar: the reference of the vector kernel and its path without VNNI.
template <int KT, typename T>
void kx16_portable(const QuantX& X, int64_t M, int64_t K, const uint8_t* w, int64_t N, const T* bias, T* y,
                   int64_t ldy) {
    const int64_t ns = K / kSuper, nb = K / kBlock;
    conveyor::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        uint8_t codes[kSuper];
        float scale16[16], min16[16];
        float sbuf[kMaxM];
        std::vector<float> big;   // (more tokens than a decode team's pass: outside one)
        float* s = M <= kMaxM ? sbuf : (big.resize(M), big.data());
        for (int64_t n = n0; n < n1; ++n) {
            std::fill(s, s + M, 0.f);
            for (int64_t sb = 0; sb < ns; ++sb) {
                kx16_row<KT>(w, ns, n, sb, codes, scale16, min16);
                for (int64_t m = 0; m < M; ++m)
                    for (int h = 0; h < 16; ++h) {   // 16 weights
                        const int64_t r = m * nb + sb * 8 + h / 2;
                        const int8_t* xq = X.q.data() + m * K + sb * kSuper + 16 * h;
                        const int8_t* xq2 = X.q2.data() + m * K + sb * kSuper + 16 * h;
                        int32_t dot = 0, dot2 = 0;
                        for (int i = 0; i < 16; ++i) {
                            dot += (int)codes[16 * h + i] * xq[i];
                            dot2 += (int)codes[16 * h + i] * xq2[i];
                        }
                        const bool lo = h % 2 == 0;
                        const int32_t qsum = lo ? X.qsum_lo[r] : X.qsum[r] - X.qsum_lo[r];
                        const int32_t qsum2 = lo ? X.qsum2_lo[r] : X.qsum2[r] - X.qsum2_lo[r];
                        dot -= kzero(KT) * qsum;
                        dot2 -= kzero(KT) * qsum2;
                        s[m] += ((float)dot * X.d[r] + (float)dot2 * X.d2[r]) * scale16[h];
                        if (KT == kQ2_K) s[m] -= min16[h] * ((float)qsum * X.d[r] + (float)qsum2 * X.d2[r]);
                        if (has_min(KT) && h % 2 == 0) s[m] -= min16[h] * X.sum[r];
                    }
            }
            for (int64_t m = 0; m < M; ++m) narrow(s[m] + (bias ? widen(bias[n]) : 0.f), y + m * ldy + n);
        }
    });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Codes of one block of 32 (8 chunks) against a token's int8 block: chunks 0-3 (weights 0-15) and
// 4-7 (16-31) as two chains.
inline void dot_halves(const __m512i* codes, const int8_t* xb, __m512i& lo, __m512i& hi) {
    const int32_t* xw = reinterpret_cast<const int32_t*>(xb);
    const __m512i z = _mm512_setzero_si512();
    lo = _mm512_dpbusd_epi32(z, codes[0], _mm512_set1_epi32(xw[0]));
    hi = _mm512_dpbusd_epi32(z, codes[4], _mm512_set1_epi32(xw[4]));
    for (int t = 1; t < 4; ++t) {
        lo = _mm512_dpbusd_epi32(lo, codes[t], _mm512_set1_epi32(xw[t]));
        hi = _mm512_dpbusd_epi32(hi, codes[t + 4], _mm512_set1_epi32(xw[t + 4]));
    }
}

// One group of 16 output rows for M tokens.
template <int KT, int M, typename T>
inline void kx16_group(const QuantX& X, int64_t m0, int64_t ns, const uint8_t* wg, const T* bias, T* y, int64_t ldy,
                       int64_t n0) {
    const int64_t K = ns * kSuper, nb = K / kBlock;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int64_t s = 0; s < ns; ++s) {
        const uint8_t* o = wg + s * kx16_bytes(KT);
        for (int64_t l = 0; l < kx16_bytes(KT); l += 64)   // the next super-block
            _mm_prefetch(reinterpret_cast<const char*>(o) + kx16_bytes(KT) + l, _MM_HINT_T0);
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o)));
        __m512i codes[8];
        if constexpr (has_min(KT)) {
            const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32)));
            for (int sub = 0; sub < 8; ++sub) {
                const uint8_t* cp = o + 320 + 512 * (sub / 2);
                for (int t = 0; t < 8; ++t) {
                    const __m512i raw = _mm512_loadu_si512(cp + 64 * t);
                    codes[t] = _mm512_and_si512(sub % 2 ? _mm512_srli_epi16(raw, 4) : raw, nib);
                    if constexpr (KT == kQ5_K) {   // the sub-block's fifth bits to bit 4 of each byte
                        const __m512i fifth = _mm512_loadu_si512(o + kFifthBits + 64 * t);
                        const __mmask64 set = _mm512_test_epi8_mask(fifth, _mm512_set1_epi8((char)(1 << sub)));
                        codes[t] = _mm512_mask_add_epi8(codes[t], set, codes[t], _mm512_set1_epi8(0x10));
                    }
                }
                const __m512 sc = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 64 + 16 * sub)))));
                const __m512 mn = _mm512_mul_ps(mv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                        _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 192 + 16 * sub)))));
                const int64_t b = s * 8 + sub;
                for (int m = 0; m < M; ++m) {
                    const int64_t r = (m0 + m) * nb + b;
                    __m512i lo, hi, lo2, hi2;
                    dot_halves(codes, X.q.data() + (m0 + m) * K + b * kBlock, lo, hi);
                    dot_halves(codes, X.q2.data() + (m0 + m) * K + b * kBlock, lo2, hi2);
                    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo2, hi2)), _mm512_set1_ps(X.d2[r]),
                                                     _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)),
                                                                   _mm512_set1_ps(X.d[r])));
                    acc[m] = _mm512_fmadd_ps(v, sc, acc[m]);
                    acc[m] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(X.sum[r]), acc[m]);
                }
            }
        } else {
            const __m512i hmask = _mm512_set1_epi8(0x30);
            // Q2_K's dmin (its minima are dmin x the high nibbles of the scale bytes).
            const __m512 mv = KT == kQ2_K ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32)))
                                          : _mm512_setzero_ps();
            for (int blk = 0; blk < 8; ++blk) {
                if constexpr (KT == kQ3_K || KT == kQ2_K) {
                    const uint8_t* cp = o + k2bit_block(KT, blk);
                    const __m512i three = _mm512_set1_epi8(3);
                    for (int h = 0; h < 2; ++h) {   // the low 2 bits (as Q6_K's high 2)
                        const __m512i lb = _mm512_loadu_si512(cp + 64 * h);
                        for (int q = 0; q < 4; ++q) codes[4 * h + q] = _mm512_and_si512(_mm512_srli_epi16(lb, 2 * q), three);
                    }
                    if constexpr (KT == kQ3_K) {   // bit t of the high-bit chunk's bytes to bit 2 of vector t
                        const __m512i hb = _mm512_loadu_si512(cp + 128), four = _mm512_set1_epi8(4);
                        for (int t = 0; t < 8; ++t)
                            codes[t] = _mm512_mask_add_epi8(codes[t], _mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(1 << t))),
                                                            codes[t], four);
                    }
                } else {
                    const uint8_t* cp = o + 288 + 384 * blk;
                    for (int c = 0; c < 4; ++c) {
                        const __m512i raw = _mm512_loadu_si512(cp + 64 * c);
                        codes[c] = _mm512_and_si512(raw, nib);
                        codes[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
                    }
                    for (int h = 0; h < 2; ++h) {   // the high 2 bits to bits 4-5 of each byte
                        const __m512i hb = _mm512_loadu_si512(cp + 256 + 64 * h);
                        codes[4 * h] = _mm512_or_si512(codes[4 * h], _mm512_and_si512(_mm512_slli_epi32(hb, 4), hmask));
                        codes[4 * h + 1] = _mm512_or_si512(codes[4 * h + 1], _mm512_and_si512(_mm512_slli_epi32(hb, 2), hmask));
                        codes[4 * h + 2] = _mm512_or_si512(codes[4 * h + 2], _mm512_and_si512(hb, hmask));
                        codes[4 * h + 3] = _mm512_or_si512(codes[4 * h + 3], _mm512_and_si512(_mm512_srli_epi32(hb, 2), hmask));
                    }
                }
                auto bytes16 = [&](int64_t at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + at)); };
                auto scale = [&](int i) {
                    if constexpr (KT == kQ2_K)   // the low nibbles of scale | min << 4
                        return _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_and_si512(
                                                     _mm512_cvtepu8_epi32(bytes16(64 + 16 * i)), _mm512_set1_epi32(0xF))));
                    return _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(32 + 16 * i))));
                };
                auto minimum = [&](int i) {   // Q2_K's high nibbles, times dmin
                    return _mm512_mul_ps(mv, _mm512_cvtepi32_ps(_mm512_srli_epi32(_mm512_cvtepu8_epi32(bytes16(64 + 16 * i)), 4)));
                };
                const __m512 sa = scale(2 * blk), sb = scale(2 * blk + 1);
                __m512 ma = _mm512_setzero_ps(), mb = ma;
                if constexpr (KT == kQ2_K) ma = minimum(2 * blk), mb = minimum(2 * blk + 1);
                const int64_t b = s * 8 + blk;
                for (int m = 0; m < M; ++m) {
                    const int64_t r = (m0 + m) * nb + b;
                    __m512i lo, hi, lo2, hi2;
                    dot_halves(codes, X.q.data() + (m0 + m) * K + b * kBlock, lo, hi);
                    dot_halves(codes, X.q2.data() + (m0 + m) * K + b * kBlock, lo2, hi2);
                    // The codes' zero (32; Q3_K 4) times each half's activation sum.
                    constexpr int z = kzero(KT);
                    if constexpr (z != 0) {
                        lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(z * X.qsum_lo[r]));
                        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(z * (X.qsum[r] - X.qsum_lo[r])));
                        lo2 = _mm512_sub_epi32(lo2, _mm512_set1_epi32(z * X.qsum2_lo[r]));
                        hi2 = _mm512_sub_epi32(hi2, _mm512_set1_epi32(z * (X.qsum2[r] - X.qsum2_lo[r])));
                    }
                    const __m512 d = _mm512_set1_ps(X.d[r]), d2 = _mm512_set1_ps(X.d2[r]);
                    const __m512 va = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo2), d2, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d));
                    const __m512 vb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi2), d2, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d));
                    acc[m] = _mm512_fmadd_ps(va, sa, acc[m]);
                    acc[m] = _mm512_fmadd_ps(vb, sb, acc[m]);
                    if constexpr (KT == kQ2_K) {   // minimum x the half's activations (their two int8 terms)
                        const float xa = (float)X.qsum_lo[r] * X.d[r] + (float)X.qsum2_lo[r] * X.d2[r];
                        const float xb = (float)(X.qsum[r] - X.qsum_lo[r]) * X.d[r] +
                                         (float)(X.qsum2[r] - X.qsum2_lo[r]) * X.d2[r];
                        acc[m] = _mm512_fnmadd_ps(ma, _mm512_set1_ps(xa), acc[m]);
                        acc[m] = _mm512_fnmadd_ps(mb, _mm512_set1_ps(xb), acc[m]);
                    }
                }
            }
        }
    }
    store_group<M>(acc, bias, y, ldy, m0, n0);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2: kx16_group (VNNI) for half h of a group (rows 8h..8h+7), the same sums and operations lane
// by lane (see x16_group's AVX2 version).
template <int KT, int M, typename T>
inline void kx16_half(const QuantX& X, int64_t m0, int64_t ns, const uint8_t* wg, int h, const T* bias, T* y,
                      int64_t ldy, int64_t n0) {
    const int64_t K = ns * kSuper, nb = K / kBlock;
    constexpr int chunks = int16_chunks(KT == kQ6_K ? 63 : KT == kQ5_K ? 31 : KT == kQ4_K ? 15 : KT == kQ3_K ? 7 : 3);
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    const __m256i nib = _mm256_set1_epi8(0x0F);
    // Rows 8h..8h+7's bytes of a 16-byte row array at `at` (scales, minima), widened.
    auto bytes8 = [&](const uint8_t* o, int64_t at) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + at + 8 * h)); };
    auto dots = [&](const __m256i* codes, int64_t m, int64_t b, __m256i& lo, __m256i& hi, __m256i& lo2, __m256i& hi2) {
        const int32_t* xw = reinterpret_cast<const int32_t*>(X.q.data() + (m0 + m) * K + b * kBlock);
        const int32_t* xw2 = reinterpret_cast<const int32_t*>(X.q2.data() + (m0 + m) * K + b * kBlock);
        lo = dot_quad8<chunks>(codes, codes, xw, 0);
        hi = dot_quad8<chunks>(codes, codes, xw, 4);
        lo2 = dot_quad8<chunks>(codes, codes, xw2, 0);
        hi2 = dot_quad8<chunks>(codes, codes, xw2, 4);
    };
    for (int64_t s = 0; s < ns; ++s) {
        const uint8_t* o = wg + s * kx16_bytes(KT);
        for (int64_t l = 0; l < kx16_bytes(KT); l += 64)   // the next super-block
            _mm_prefetch(reinterpret_cast<const char*>(o) + kx16_bytes(KT) + l, _MM_HINT_T0);
        const __m256 dv = halves8(o, h);
        __m256i codes[8];
        if constexpr (has_min(KT)) {
            const __m256 mv = halves8(o + 32, h);
            for (int sub = 0; sub < 8; ++sub) {
                const uint8_t* cp = o + 320 + 512 * (sub / 2);
                for (int t = 0; t < 8; ++t) {
                    const __m256i raw = chunk_half(cp + 64 * t, h);
                    codes[t] = _mm256_and_si256(sub % 2 ? _mm256_srli_epi16(raw, 4) : raw, nib);
                    if constexpr (KT == kQ5_K) {
                        const __m256i bit = _mm256_set1_epi8((char)(1 << sub));
                        codes[t] = add_where(codes[t], chunk_half(o + kFifthBits + 64 * t, h), bit, _mm256_set1_epi8(0x10));
                    }
                }
                const __m256 sc = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(o, 64 + 16 * sub))));
                const __m256 mn = _mm256_mul_ps(mv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8(o, 192 + 16 * sub))));
                const int64_t b = s * 8 + sub;
                for (int m = 0; m < M; ++m) {
                    const int64_t r = (m0 + m) * nb + b;
                    __m256i lo, hi, lo2, hi2;
                    dots(codes, m, b, lo, hi, lo2, hi2);
                    const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo2, hi2)), _mm256_set1_ps(X.d2[r]),
                                                     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)),
                                                                   _mm256_set1_ps(X.d[r])));
                    acc[m] = _mm256_fmadd_ps(v, sc, acc[m]);
                    acc[m] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(X.sum[r]), acc[m]);
                }
            }
        } else {
            const __m256i hmask = _mm256_set1_epi8(0x30);
            const __m256 mv = KT == kQ2_K ? halves8(o + 32, h) : _mm256_setzero_ps();
            for (int blk = 0; blk < 8; ++blk) {
                if constexpr (KT == kQ3_K || KT == kQ2_K) {
                    const uint8_t* cp = o + k2bit_block(KT, blk);
                    const __m256i three = _mm256_set1_epi8(3);
                    for (int hh = 0; hh < 2; ++hh) {
                        const __m256i lb = chunk_half(cp + 64 * hh, h);
                        for (int q = 0; q < 4; ++q) codes[4 * hh + q] = _mm256_and_si256(_mm256_srli_epi16(lb, 2 * q), three);
                    }
                    if constexpr (KT == kQ3_K) {
                        const __m256i hb = chunk_half(cp + 128, h), four = _mm256_set1_epi8(4);
                        for (int t = 0; t < 8; ++t) codes[t] = add_where(codes[t], hb, _mm256_set1_epi8((char)(1 << t)), four);
                    }
                } else {
                    const uint8_t* cp = o + 288 + 384 * blk;
                    for (int c = 0; c < 4; ++c) {
                        const __m256i raw = chunk_half(cp + 64 * c, h);
                        codes[c] = _mm256_and_si256(raw, nib);
                        codes[c + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
                    }
                    for (int hh = 0; hh < 2; ++hh) {
                        const __m256i hb = chunk_half(cp + 256 + 64 * hh, h);
                        codes[4 * hh] = _mm256_or_si256(codes[4 * hh], _mm256_and_si256(_mm256_slli_epi32(hb, 4), hmask));
                        codes[4 * hh + 1] = _mm256_or_si256(codes[4 * hh + 1], _mm256_and_si256(_mm256_slli_epi32(hb, 2), hmask));
                        codes[4 * hh + 2] = _mm256_or_si256(codes[4 * hh + 2], _mm256_and_si256(hb, hmask));
                        codes[4 * hh + 3] = _mm256_or_si256(codes[4 * hh + 3], _mm256_and_si256(_mm256_srli_epi32(hb, 2), hmask));
                    }
                }
                auto scale = [&](int i) {
                    if constexpr (KT == kQ2_K)
                        return _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_and_si256(
                                                     _mm256_cvtepu8_epi32(bytes8(o, 64 + 16 * i)), _mm256_set1_epi32(0xF))));
                    return _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes8(o, 32 + 16 * i))));
                };
                auto minimum = [&](int i) {
                    return _mm256_mul_ps(mv, _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_cvtepu8_epi32(bytes8(o, 64 + 16 * i)), 4)));
                };
                const __m256 sa = scale(2 * blk), sb = scale(2 * blk + 1);
                __m256 ma = _mm256_setzero_ps(), mb = ma;
                if constexpr (KT == kQ2_K) ma = minimum(2 * blk), mb = minimum(2 * blk + 1);
                const int64_t b = s * 8 + blk;
                for (int m = 0; m < M; ++m) {
                    const int64_t r = (m0 + m) * nb + b;
                    __m256i lo, hi, lo2, hi2;
                    dots(codes, m, b, lo, hi, lo2, hi2);
                    constexpr int z = kzero(KT);
                    if constexpr (z != 0) {
                        lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(z * X.qsum_lo[r]));
                        hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(z * (X.qsum[r] - X.qsum_lo[r])));
                        lo2 = _mm256_sub_epi32(lo2, _mm256_set1_epi32(z * X.qsum2_lo[r]));
                        hi2 = _mm256_sub_epi32(hi2, _mm256_set1_epi32(z * (X.qsum2[r] - X.qsum2_lo[r])));
                    }
                    const __m256 d = _mm256_set1_ps(X.d[r]), d2 = _mm256_set1_ps(X.d2[r]);
                    const __m256 va = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo2), d2, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), d));
                    const __m256 vb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi2), d2, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), d));
                    acc[m] = _mm256_fmadd_ps(va, sa, acc[m]);
                    acc[m] = _mm256_fmadd_ps(vb, sb, acc[m]);
                    if constexpr (KT == kQ2_K) {
                        const float xa = (float)X.qsum_lo[r] * X.d[r] + (float)X.qsum2_lo[r] * X.d2[r];
                        const float xb = (float)(X.qsum[r] - X.qsum_lo[r]) * X.d[r] +
                                         (float)(X.qsum2[r] - X.qsum2_lo[r]) * X.d2[r];
                        acc[m] = _mm256_fnmadd_ps(ma, _mm256_set1_ps(xa), acc[m]);
                        acc[m] = _mm256_fnmadd_ps(mb, _mm256_set1_ps(xb), acc[m]);
                    }
                }
            }
        }
    }
    store_half<M>(acc, bias, y, ldy, m0, n0 + 8 * h);
}

// One group of 16 output rows for M tokens, half by half.
template <int KT, int M, typename T>
inline void kx16_group(const QuantX& X, int64_t m0, int64_t ns, const uint8_t* wg, const T* bias, T* y, int64_t ldy,
                       int64_t n0) {
    for (int h = 0; h < 2; ++h) kx16_half<KT, M>(X, m0, ns, wg, h, bias, y, ldy, n0);
}
#endif

#if CONVEYOR_INT8_VECTOR
template <int KT, typename T>
void kx16_impl(const QuantX& X, int64_t M, int64_t K, const uint8_t* w, int64_t N, const T* bias, T* y, int64_t ldy) {
    const int64_t ns = K / kSuper, gbytes = ns * kx16_bytes(KT);
    group_passes(N, M, [&](auto mc, int64_t m, int64_t g) {
        kx16_group<KT, decltype(mc)::value>(X, m, ns, w + g * gbytes, bias, y, ldy, g * kRows);
    });
}
#endif

template <typename T>
void dispatch_kgemv(int kt, const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const T* bias, T* y,
                    int64_t ldy) {
    with_quantized(x, M, K, [&](const QuantX& X) {
        with_ktype(kt, [&](auto k) {
#if CONVEYOR_INT8_VECTOR
            kx16_impl<decltype(k)::value, T>(X, M, K, w, N, bias, y, ldy);
#else
            kx16_portable<decltype(k)::value, T>(X, M, K, w, N, bias, y, ldy);
#endif
        });
    });
}

torch::Tensor kdequant_rows(const torch::Tensor& w, int64_t K, const int64_t* ids, int64_t rows, at::ScalarType dtype) {
    TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "a K-quant x16 weight");
    TORCH_CHECK(K == w.size(1) * kSuper, "K ", K, " does not match ", w.size(1), " super-blocks");
    TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "fp32 or bf16 output only");
    const int kt = ktype_of_x16(w.size(2));
    auto out = torch::empty({rows, K}, torch::TensorOptions().dtype(dtype));
    auto run = [&](auto* o) {
        using T = std::remove_pointer_t<decltype(o)>;
        with_ktype(kt, [&](auto k) { kdequant_impl<decltype(k)::value, T>(w.data_ptr<uint8_t>(), K, ids, rows, o); });
    };
    if (dtype == torch::kBFloat16) run(out.data_ptr<at::BFloat16>());
    else run(out.data_ptr<float>());
    return out;
}

torch::Tensor kgemv(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
                "x [M, K], a K-quant x16 weight");
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * kRows;
    TORCH_CHECK(K == w.size(1) * kSuper, "K ", K, " does not match ", w.size(1), " super-blocks");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "fp32 or bf16 x only");
    if (bias) TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == x.scalar_type() && bias->numel() == N,
                          "bias [N], x's dtype");
    const int kt = ktype_of_x16(w.size(2));
    auto y = torch::empty({M, N}, x.options());
    const auto xf = x.to(torch::kFloat32).contiguous();
    if (x.scalar_type() == torch::kBFloat16)
        dispatch_kgemv<at::BFloat16>(kt, xf.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), N,
                                     bias ? bias->data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(), N);
    else
        dispatch_kgemv<float>(kt, xf.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), N,
                              bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), N);
    return y;
}

// A quantized weight's matmul on fp32 activations (either 32-block layout or a K-quant).
template <typename T>
void qlinear_f32(const float* x, int64_t M, int64_t K, const torch::Tensor& w, const T* bias, T* y, int64_t ldy) {
    const uint8_t* wp = w.data_ptr<uint8_t>();
    if (w.dim() == 3) dispatch_kgemv<T>(ktype_of_x16(w.size(2)), x, M, K, wp, w.size(0) * kRows, bias, y, ldy);
    else dispatch_qgemv<T>(qinfo(w, K), x, M, K, wp, bias, y, ldy);
}

}  // namespace

// x: [M, K] fp32 or bf16; w: [N, row_bytes] uint8 in GGUF blocks, or [N / 16, 16 * row_bytes] in
// the x16 layout (qrepack); bias: [N] in x's dtype or None. Returns [M, N] in x's dtype. With bf16
// x and the plain layout the weights are rounded to bf16 (a bf16 model's weights: the dense bf16
// copy, the GEMV and this kernel then differ only in summation order); the x16 layout always
// keeps them exact and rounds the activations (two int8 terms).
torch::Tensor qgemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
    if (w.dim() == 3) return kgemv(x, w, bias);   // K-quants (x16 layout)
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
        with_qtype(info.qt, [&](auto qt) { qgemv_bf16_impl<decltype(qt)::value>(xp, M, K, wp, info.N, rb, bp, yp, info.N); });
        return y;
    }
#endif
    const auto xf = x.to(torch::kFloat32).contiguous();
    if (x.scalar_type() == torch::kBFloat16)
        dispatch_qgemv<at::BFloat16>(info, xf.data_ptr<float>(), M, K, wp,
                                     bias ? bias->data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(), info.N);
    else
        dispatch_qgemv<float>(info, xf.data_ptr<float>(), M, K, wp, bias ? bias->data_ptr<float>() : nullptr,
                              y.data_ptr<float>(), info.N);
    return y;
}

// A quantized weight (either layout) -> [N, K] in `dtype` (fp32 or bf16).
torch::Tensor qdequant(torch::Tensor w, int64_t K, at::ScalarType dtype) {
    if (w.dim() == 3) return kdequant_rows(w, K, nullptr, w.size(0) * kRows, dtype);
    return dequant_rows(w, K, nullptr, qinfo(w, K).N, dtype);
}

// Rows `ids` (int64, any shape) of a quantized table -> [ids.numel(), K]: an embedding lookup.
torch::Tensor qembedding(torch::Tensor w, torch::Tensor ids, int64_t K, at::ScalarType dtype) {
    const int64_t N = w.dim() == 3 ? w.size(0) * kRows : qinfo(w, K).N;
    const auto flat = ids.to(torch::kInt64).contiguous().view(-1);
    const int64_t* p = flat.data_ptr<int64_t>();
    for (int64_t i = 0; i < flat.numel(); ++i)
        TORCH_CHECK(p[i] >= 0 && p[i] < N, "token id ", p[i], " out of range [0, ", N, ")");
    if (w.dim() == 3) return kdequant_rows(w, K, p, flat.numel(), dtype);
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
    with_qtype(info.qt, [&](auto qt) {
        repack_impl<decltype(qt)::value>(w.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), info.N, nb);
    });
    return out;
}

// Plain K-quant super-blocks [N, super-blocks * bytes] (`bytes`: 84 Q2_K, 110 Q3_K, 144 Q4_K, 176 Q5_K, 210
// Q6_K; N a multiple of 16) -> the x16 layout [N / 16, super-blocks, x16 bytes] of the int8 kernel.
torch::Tensor krepack(torch::Tensor w, int64_t K, int64_t bytes) {
    TORCH_CHECK(bytes == kQ2_K || bytes == kQ3_K || bytes == kQ4_K || bytes == kQ5_K || bytes == kQ6_K,
                "K-quant super-block bytes: 84 (Q2_K), 110 (Q3_K), 144 (Q4_K), 176 (Q5_K) or 210 (Q6_K), got ", bytes);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "a plain [N, row bytes] weight");
    TORCH_CHECK(K > 0 && K % kSuper == 0 && w.size(1) == K / kSuper * bytes, "row bytes do not match K ", K);
    TORCH_CHECK(w.size(0) % kRows == 0, "x16 needs a multiple of 16 rows, got ", w.size(0));
    const int64_t ns = K / kSuper;
    auto out = torch::empty({w.size(0) / kRows, ns, kx16_bytes((int)bytes)}, w.options());
    with_ktype((int)bytes, [&](auto k) {
        krepack_impl<decltype(k)::value>(w.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), w.size(0), ns);
    });
    return out;
}

// Whether the x16 layout runs on int8 dot products here (else a scalar loop: never chosen).
bool quant_int8_native() { return kInt8Vector; }
bool int8_amx() { return use_amx(kAmxMinTokens); }
int64_t int8_amx_tokens() { return kAmxMinTokens; }
void set_int8_amx(bool on) { g_int8_amx.store(on); }

// A decode layer's matmul weight: its output features, after checking that linear_raw takes it
// for activations of `dtype` (linear_raw itself checks nothing: it may run inside a decode team).
int64_t linear_check(const torch::Tensor& w, int64_t K, at::ScalarType dtype) {
    TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "fp32 or bf16 activations only");
    if (w.scalar_type() != torch::kUInt8) {
        TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == dtype && w.size(1) == K,
                    "a dense weight [N, K] in the activations' dtype, contiguous");
        return w.size(0);
    }
    if (w.dim() == 3) {
        TORCH_CHECK(w.is_contiguous() && K == w.size(1) * kSuper, "a K-quant x16 weight of K ", K);
        ktype_of_x16(w.size(2));
        return w.size(0) * kRows;
    }
    return qinfo(w, K).N;
}

// y (rows ldy apart) = x W^T (+ bias) for M rows of K activations (contiguous), all in T: a
// quantized (uint8) weight on its kernels, a dense one on the GEMV. The weight must have passed
// linear_check. In a decode team: this thread's share of the output rows.
template <typename T>
void linear_raw(const T* x, int64_t M, int64_t K, const torch::Tensor& w, const T* bias, T* y, int64_t ldy) {
    if (w.scalar_type() != torch::kUInt8) {
        gemv_raw<T>(x, M, K, w.data_ptr<T>(), w.size(0), bias, y, ldy);
        return;
    }
    if constexpr (std::is_same_v<T, float>) {
        qlinear_f32<float>(x, M, K, w, bias, y, ldy);
    } else {
#if defined(__AVX512BF16__)
        if (w.dim() == 2) {
            const QInfo info = qinfo(w, K);
            if (!info.x16) {
                with_qtype(info.qt, [&](auto qt) {
                    qgemv_bf16_impl<decltype(qt)::value>(x, M, K, w.data_ptr<uint8_t>(), info.N, (K / kBlock) * info.qt,
                                                         bias, y, ldy);
                });
                return;
            }
        }
#endif
        std::vector<float> local;   // outside a team (a team thread's buffer is sized before its region)
        const conveyor::Team* tm = conveyor::team();
        std::vector<float>& xf = tm ? tm->scratch->xf : local;
        if ((int64_t)xf.size() < M * K) xf.resize(M * K);
        for (int64_t i = 0; i < M * K; ++i) xf[i] = widen(x[i]);
        qlinear_f32<T>(xf.data(), M, K, w, bias, y, ldy);
    }
}
template void linear_raw<float>(const float*, int64_t, int64_t, const torch::Tensor&, const float*, float*, int64_t);
template void linear_raw<at::BFloat16>(const at::BFloat16*, int64_t, int64_t, const torch::Tensor&, const at::BFloat16*,
                                       at::BFloat16*, int64_t);
