// Paged attention for decoding sequences on CPU: reads each sequence's K/V in place through
// its block table (no gather copy, no padding to the batch's longest context). The cache may
// be fp32 or bf16 (read and widened to fp32 on the fly: half the memory traffic); the math is
// fp32; the output has the query's dtype.
//
// q:            [D, H, d]                 one query token per decoding sequence (fp32 or bf16)
// k/v_cache:    [KVH, num_blocks, block_size, d]
// block_tables: [D, max_blocks] int64
// context_lens: [D] int64                 tokens of context (including the new one)
// window:       > 0: a query attends to its last `window` tokens only (sliding-window layers)
// returns       [D, H, d]
#include <torch/types.h>
#include <ATen/Parallel.h>

#include "cpu_vec.h"
#include "kernels.h"
#include "team.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
using conveyor::load16;   // (AVX-512 only: without it the kernels build their scalar loops)
#endif
using conveyor::softmax_rows;
using conveyor::widen;

// Widen one row of the cache (d values) into an fp32 buffer.
template <typename T, int HD>
inline void load_row(const T* __restrict src, float* __restrict dst, int n) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, at::BFloat16> && HD > 0 && HD % 16 == 0) {
        // bf16 -> fp32 is a 16-bit shift: 16 values per instruction pair (the compiler does not see it).
        const auto* p = reinterpret_cast<const __m256i*>(src);
        for (int i = 0; i < HD / 16; ++i)
            _mm512_storeu_ps(dst + 16 * i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                               _mm256_loadu_si256(p + i)), 16)));
        return;
    }
#endif
    const int len = HD > 0 ? HD : n;
#pragma omp simd
    for (int i = 0; i < len; ++i) dst[i] = widen(src[i]);
}

// Walks one KV head's rows of a sequence in token order through its block table: the next token's
// row without the two integer divisions per token (tens of cycles each) an index computation costs.
template <typename T>
struct RowCursor {
    const T* head;
    const int64_t* table;
    int64_t bs, hd, blk, off;
    RowCursor(const T* head, const int64_t* table, int64_t t, int64_t bs, int64_t hd)
        : head(head), table(table), bs(bs), hd(hd), blk(t / bs), off(t % bs) {}
    const T* next() {
        const T* row = head + (table[blk] * bs + off) * hd;
        if (++off == bs) {
            off = 0;
            ++blk;
        }
        return row;
    }
};

template <int HD>
inline float dot(const float* __restrict a, const float* __restrict b, int n) {
    float s = 0.f;
    const int len = HD > 0 ? HD : n;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < len; ++i) s += a[i] * b[i];
    return s;
}

template <int HD>
inline void axpy(float* __restrict y, const float* __restrict x, float a, int n) {
    const int len = HD > 0 ? HD : n;
#pragma omp simd
    for (int i = 0; i < len; ++i) y[i] += a * x[i];
}

// One (sequence, KV head) with G query heads (qs: G rows of d, fp32) over tokens [first, L): the
// fp32 outputs of the G heads to out. Each head's numbers do not depend on G (the G heads only
// share the K/V rows read), so a head computed alone (G = 1) gets the same bits.
template <typename T, int HD>
void decode_item(const float* qs, const T* kh, const T* vh, const int64_t* table, int64_t first, int64_t L, int64_t bs,
                 int64_t d, int64_t G, float* out, float scale, AttnScratch& sc) {
    const int64_t n = L - first;
    auto& scores = sc.scores;
    auto& acc = sc.acc;
    auto& row = sc.row;
    row.resize(d);
    scores.assign(G * n, 0.f);
    RowCursor<T> krow(kh, table, first, bs, d), vrow(vh, table, first, bs, d);
    for (int64_t t = first; t < L; ++t) {
        load_row<T, HD>(krow.next(), row.data(), (int)d);
        for (int64_t g = 0; g < G; ++g) scores[g * n + t - first] = dot<HD>(qs + g * d, row.data(), (int)d) * scale;
    }
    softmax_rows(scores.data(), G, n);
    acc.assign(G * d, 0.f);
    for (int64_t t = first; t < L; ++t) {
        load_row<T, HD>(vrow.next(), row.data(), (int)d);
        for (int64_t g = 0; g < G; ++g) axpy<HD>(acc.data() + g * d, row.data(), scores[g * n + t - first], (int)d);
    }
    std::copy(acc.begin(), acc.end(), out);
}

#if defined(__AVX512F__)
// r[j] = sum of the 16 lanes of v[j]: 16 horizontal sums as one transposed reduction (~45
// instructions instead of 16 separate reductions of ~8 each).
inline __m512 reduce16(const __m512* v) {
    __m512 w[8], x[4];
    for (int i = 0; i < 8; ++i)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d c = _mm512_castps_pd(w[2 * i]), d = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// Ask for the next `count` rows of a cursor ahead of use: their blocks sit anywhere in the cache,
// where the hardware prefetcher cannot guess them. HINT: _MM_HINT_T0 (into L1) or _MM_HINT_T1 (L2).
template <typename T, int HD, auto HINT>
inline void prefetch_rows(RowCursor<T>& ahead, int64_t count) {
    for (int64_t t = 0; t < count; ++t) {
        const char* row = reinterpret_cast<const char*>(ahead.next());
        for (int64_t off = 0; off < HD * (int64_t)sizeof(T); off += 64) _mm_prefetch(row + off, HINT);
    }
}

// Rows are asked for on two levels: into L1 one block (16 tokens) ahead, and into L2
// attn_ahead() tokens ahead, that far beginning with a burst as an item starts (its first rows
// would otherwise come one block at a time). One block of one KV head is only 2 KiB (bf16, 16
// tokens, head_dim 64), so a sequence whose blocks lie scattered over the cache, as they do once
// requests have come and gone, gives the hardware prefetcher a new stream every 2 KiB. On the
// Zen4 VM (2026-12-06, whole decode steps of the demo model, bf16, runner only) scattered tables
// took 1.58x (1 x 1,500 tokens of context) and 1.71x (8 x 1,024) the time of consecutive ones with
// the L1 prefetch alone, 1.25x and 1.22x with the L2 one 64 tokens ahead too (48-128 did about as
// well; everything into L1 that far was no better than one block); 8 x 1,024 scattered: 27.3 ->
// 18.8 ms. 0: the L1 prefetch only (the kernel before). Speed only: it never changes a result.
inline int64_t& attn_ahead() {
    static int64_t tokens = 64;
    return tokens;
}
inline int64_t clamp_count(int64_t L, int64_t from, int64_t n) { return std::min(L, from + n) - std::min(L, from); }

// One (sequence, KV head) with G query heads of HD dims, vectors in registers: scores 16 tokens
// at a time, the weighted sum of V rows into G x HD/16 accumulators that never leave registers.
template <typename T, int HD, int G>
void decode_item_avx512(const float* qs, const T* kh, const T* vh, const int64_t* table, int64_t first, int64_t L,
                        int64_t bs, int64_t, int64_t, float* out, float scale, AttnScratch& sc) {
    constexpr int C = HD / 16;
    auto& scores = sc.scores;
    __m512 q[G][C];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) q[g][c] = _mm512_mul_ps(_mm512_loadu_ps(qs + g * HD + 16 * c), _mm512_set1_ps(scale));
#if defined(__AVX512BF16__)
    // The scaled query rounded to bf16: the model's q is bf16 already, so this only adds the
    // rounding of the scaling (none when 1/sqrt(head_dim) is a power of two, e.g. head_dim 64).
    __m512bh qb[G][HD / 32];
    if constexpr (std::is_same_v<T, at::BFloat16>)
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < HD / 32; ++c) qb[g][c] = _mm512_cvtne2ps_pbh(q[g][2 * c + 1], q[g][2 * c]);
#endif
    const int64_t N = L - first;   // tokens attended
    scores.resize(G * N);
    // krow: the rows in use; knear, kfar: 16 and A tokens ahead of it, for the prefetches.
    const int64_t A = attn_ahead();
    RowCursor<T> krow(kh, table, first, bs, HD), knear(kh, table, std::min(L, first + 16), bs, HD);
    RowCursor<T> kfar(kh, table, first, bs, HD);
    if (A > 0) prefetch_rows<T, HD, _MM_HINT_T1>(kfar, clamp_count(L, first, A));
    for (int64_t t0 = first; t0 < L; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, L - t0);
        const T* rows[16];
        for (int64_t j = 0; j < n; ++j) rows[j] = krow.next();
        prefetch_rows<T, HD, _MM_HINT_T0>(knear, clamp_count(L, t0 + 16, 16));
        if (A > 0) prefetch_rows<T, HD, _MM_HINT_T1>(kfar, clamp_count(L, t0 + A, 16));
        for (int g = 0; g < G; ++g) {
            __m512 part[16];
            for (int64_t j = 0; j < 16; ++j) {
                if (j >= n) {
                    part[j] = _mm512_setzero_ps();
                    continue;
                }
#if defined(__AVX512BF16__)
                if constexpr (std::is_same_v<T, at::BFloat16>) {
                    // bf16 K times bf16 q, pairs summed in fp32 by one instruction: no widening.
                    __m512 s = _mm512_setzero_ps();
                    for (int c = 0; c < HD / 32; ++c)
                        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(rows[j] + 32 * c), qb[g][c]);
                    part[j] = s;
                    continue;
                }
#endif
                __m512 s = _mm512_mul_ps(q[g][0], load16<T>(rows[j]));
                for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(q[g][c], load16<T>(rows[j] + 16 * c), s);
                part[j] = s;
            }
            _mm512_mask_storeu_ps(scores.data() + g * N + t0 - first, (__mmask16)((1u << n) - 1), reduce16(part));
        }
    }
    // V's first rows are asked for before the softmax, to arrive while it runs.
    RowCursor<T> vrow(vh, table, first, bs, HD), vnear(vh, table, std::min(L, first + 16), bs, HD);
    RowCursor<T> vfar(vh, table, first, bs, HD);
    if (A > 0) prefetch_rows<T, HD, _MM_HINT_T1>(vfar, clamp_count(L, first, A));
    softmax_rows(scores.data(), G, N);
    __m512 acc[G][C];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = first; t < L; ++t) {
        if ((t - first) % 16 == 0) {
            prefetch_rows<T, HD, _MM_HINT_T0>(vnear, clamp_count(L, t + 16, 16));
            if (A > 0) prefetch_rows<T, HD, _MM_HINT_T1>(vfar, clamp_count(L, t + A, 16));
        }
        const T* vt = vrow.next();
        __m512 v[C];
        for (int c = 0; c < C; ++c) v[c] = load16<T>(vt + 16 * c);
        for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(scores[g * N + t - first]);
            for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + g * HD + 16 * c, acc[g][c]);
}

#endif

template <typename T>
AttnItemFn<T> portable_kernel(int64_t d) {
    if (d == 64) return &decode_item<T, 64>;
    if (d == 256) return &decode_item<T, 256>;
    if (d == 128) return &decode_item<T, 128>;
    return &decode_item<T, 0>;
}

// The kernel for G query heads per KV head of d dims: register-blocked for common shapes (the
// accumulators must fit in registers), else the portable loop.
template <typename T>
AttnItemFn<T> item_kernel(int64_t d, int64_t G) {
#if defined(__AVX512F__)
    if (d == 64) {
        switch (G) {
            case 1: return &decode_item_avx512<T, 64, 1>;
            case 2: return &decode_item_avx512<T, 64, 2>;
            case 3: return &decode_item_avx512<T, 64, 3>;
            case 4: return &decode_item_avx512<T, 64, 4>;
            case 5: return &decode_item_avx512<T, 64, 5>;
            default: break;
        }
    }
    if (d == 128 && G == 1) return &decode_item_avx512<T, 128, 1>;
    if (d == 128 && G == 2) return &decode_item_avx512<T, 128, 2>;
#endif
    return portable_kernel<T>(d);
}

template <typename T>
void dispatch(const float* q, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens, float* out,
              int64_t D, int64_t H, int64_t KVH, int64_t NB, int64_t BS, int64_t d, int64_t row_stride,
              float scale, int64_t W) {
    const int64_t G = H / KVH, head_stride = NB * BS * d;   // one KV head of the cache
    const AttnItemFn<T> fn = item_kernel<T>(d, G);
    // KV head by KV head (a prompt's queries all read one head's rows: a thread keeps them in its
    // cache), and within a head the sequences in the order 0, D-1, 1, D-2, ...: a prompt's queries
    // (their contexts growing one token at a time) split into equal work, not the short half to one
    // thread and the long half to another. Which thread computes an item changes none of its bits.
    at::parallel_for(0, D * KVH, 1, [&](int64_t begin, int64_t end) {
        AttnScratch sc;
        for (int64_t item = begin; item < end; ++item) {
            const int64_t h = item / D, k = item % D, s = k % 2 == 0 ? k / 2 : D - 1 - k / 2;
            fn(q + (s * H + h * G) * d, kc + h * head_stride, vc + h * head_stride, tables + s * row_stride,
               W > 0 ? std::max<int64_t>(0, lens[s] - W) : 0, lens[s], BS, d, G, out + (s * H + h * G) * d, scale, sc);
        }
    });
}

}  // namespace

// The two kernels round differently (the register-blocked one scales q before its dot products),
// so a share of a KV head's G query heads takes the kernel paged_decode takes for all G.
template <typename T>
AttnItemFn<T> attn_item_kernel(int64_t d, int64_t heads, int64_t G) {
    return item_kernel<T>(d, G) == portable_kernel<T>(d) ? portable_kernel<T>(d) : item_kernel<T>(d, heads);
}
template AttnItemFn<float> attn_item_kernel<float>(int64_t, int64_t, int64_t);
template AttnItemFn<at::BFloat16> attn_item_kernel<at::BFloat16>(int64_t, int64_t, int64_t);

void set_attn_prefetch(int64_t tokens) {
    TORCH_CHECK(tokens >= 0, "tokens ahead >= 0");
#if defined(__AVX512F__)
    attn_ahead() = tokens;
#endif
}
int64_t attn_prefetch() {
#if defined(__AVX512F__)
    return attn_ahead();
#else
    return 0;   // the portable loop does not prefetch
#endif
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale, int64_t window) {
    const auto kv_type = k_cache.scalar_type();
    TORCH_CHECK(kv_type == torch::kFloat32 || kv_type == torch::kBFloat16, "fp32 or bf16 cache");
    TORCH_CHECK(v_cache.scalar_type() == kv_type, "K and V caches of one dtype");
    TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16, "fp32 or bf16 queries");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
    TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64, "int64 tables");
    auto qf = q.to(torch::kFloat32).contiguous();
    // Rows of the table may repeat without a copy (stride 0: one prefill's queries, one table).
    auto bt = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
    auto cl = context_lens.contiguous();
    const int64_t D = q.size(0), H = q.size(1), d = q.size(2);
    const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
    TORCH_CHECK(k_cache.size(3) == d && H % KVH == 0, "shape mismatch");
    auto out = torch::empty_like(qf);
    if (kv_type == torch::kFloat32) {
        dispatch<float>(qf.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                        bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(), out.data_ptr<float>(), D, H, KVH, NB, BS, d,
                        bt.stride(0), (float)scale, window);
    } else {
        dispatch<at::BFloat16>(qf.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(),
                               v_cache.data_ptr<at::BFloat16>(), bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(),
                               out.data_ptr<float>(), D, H, KVH, NB, BS, d, bt.stride(0), (float)scale, window);
    }
    return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
}
