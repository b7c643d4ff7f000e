// Paged attention for decoding sequences on CPU: reads each sequence's K/V in place through
// its block table (no gather copy, no padding to the batch's longest context).
//
// q:            [D, H, d]                 one query token per decoding sequence
// k/v_cache:    [KVH, num_blocks, block_size, d]
// block_tables: [D, max_blocks] int64
// context_lens: [D] int64                 tokens of context (including the new one)
// returns       [D, H, d]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

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

template <int HD>
void decode_impl(const float* q, const float* kc, const float* vc, const int64_t* tables, const int64_t* lens,
                 float* out, int64_t D, int64_t H, int64_t KVH, int64_t num_blocks, int64_t bs, int64_t d,
                 int64_t max_blocks, float scale) {
    const int64_t G = H / KVH;
    const int64_t head_stride = num_blocks * bs * d;  // one KV head of the cache
    at::parallel_for(0, D * KVH, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        std::vector<float> acc;
        for (int64_t item = begin; item < end; ++item) {
            const int64_t s = item / KVH, h = item % KVH;
            const int64_t L = lens[s];
            const int64_t* table = tables + s * max_blocks;
            const float* qs = q + (s * H + h * G) * d;
            const float* kh = kc + h * head_stride;
            const float* vh = vc + h * head_stride;
            scores.assign(G * L, 0.f);
            for (int64_t t = 0; t < L; ++t) {
                const float* kt = kh + (table[t / bs] * bs + t % bs) * d;
                for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot<HD>(qs + g * d, kt, (int)d) * scale;
            }
            for (int64_t g = 0; g < G; ++g) {
                float* sg = scores.data() + g * L;
                float mx = sg[0];  // L >= 1; no infinities needed (the file may build with -ffast-math)
                for (int64_t t = 1; t < L; ++t) mx = std::max(mx, sg[t]);
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < L; ++t) {
                    sg[t] = std::exp(sg[t] - mx);
                    sum += sg[t];
                }
                const float inv = 1.f / sum;
#pragma omp simd
                for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
            }
            acc.assign(G * d, 0.f);
            for (int64_t t = 0; t < L; ++t) {
                const float* vt = vh + (table[t / bs] * bs + t % bs) * d;
                for (int64_t g = 0; g < G; ++g) axpy<HD>(acc.data() + g * d, vt, scores[g * L + t], (int)d);
            }
            float* os = out + (s * H + h * G) * d;
            std::copy(acc.begin(), acc.end(), os);
        }
    });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
    TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "fp32 only");
    TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
    TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64, "int64 tables");
    auto bt = block_tables.contiguous();
    auto cl = context_lens.contiguous();
    const int64_t D = q.size(0), H = q.size(1), d = q.size(2);
    const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
    TORCH_CHECK(k_cache.size(3) == d && H % KVH == 0, "shape mismatch");
    auto out = torch::empty_like(q);
    auto args = std::make_tuple(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                                bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(), out.data_ptr<float>());
    auto run = [&](auto impl) {
        impl(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args), std::get<4>(args),
             std::get<5>(args), D, H, KVH, NB, BS, d, bt.size(1), (float)scale);
    };
    if (d == 64) run(decode_impl<64>);
    else if (d == 128) run(decode_impl<128>);
    else run(decode_impl<0>);
    return out;
}
