// Fused elementwise ops for the CPU decoder layer, fp32 or bf16 storage with fp32 math: each
// replaces 3-10 small torch ops and as many passes over the activations.
#include <torch/types.h>
#include <ATen/Parallel.h>

#include "cpu_vec.h"
#include "rowops.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

namespace {

using conveyor::add_row;
using conveyor::gelu_tanh_mul_row;
using conveyor::narrow;
using conveyor::rms_row;
using conveyor::rope_row;
using conveyor::silu_mul_row;
using conveyor::widen;

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, double eps) {
    const int64_t d = x.size(-1), rows = x.numel() / d;
    const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) rms_row(xp + r * d, wp, op + r * d, d, (float)eps);
    });
}

template <typename T>
void add_rms_norm_impl(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& w, torch::Tensor& out,
                       double eps) {
    const int64_t d = x.size(-1), rows = x.numel() / d;
    const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
    T *rp = residual.data_ptr<T>(), *op = out.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
            add_row(rp + r * d, xp + r * d, d);
            rms_row(rp + r * d, wp, op + r * d, d, (float)eps);
        }
    });
}

template <typename T, bool Gelu>
void act_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
    const int64_t two_i = gate_up.size(-1), inter = two_i / 2, rows = gate_up.numel() / two_i;
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
            const T* g = gp + r * two_i;
            if constexpr (Gelu) gelu_tanh_mul_row(g, g + inter, op + r * inter, inter);
            else silu_mul_row(g, g + inter, op + r * inter, inter);
        }
    });
}

template <typename T>
void rope_impl(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin) {
    const int64_t T_ = x.size(0), H = x.size(1), d = x.size(2), half = d / 2, row = x.stride(0);
    auto pos = positions.contiguous();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    T* xp = x.data_ptr<T>();
    at::parallel_for(0, T_, 8, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
            const float* c = cp + pp[t] * half;
            const float* s = sp + pp[t] * half;
            for (int64_t h = 0; h < H; ++h) rope_row(xp + t * row + h * d, c, s, half);
        }
    });
}

void check(const torch::Tensor& x) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "fp32 or bf16 only");
}

}  // namespace

// out = rms_norm(x) * w over the last dim; x: [T, D]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
    check(x);
    TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.scalar_type() == x.scalar_type(), "contiguous, one dtype");
    auto out = torch::empty_like(x);
    if (x.scalar_type() == torch::kFloat32) rms_norm_impl<float>(x, w, out, eps);
    else rms_norm_impl<at::BFloat16>(x, w, out, eps);
    return out;
}

// residual += x (in place); returns rms_norm(residual) * w
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
    check(x);
    TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(), "shapes");
    TORCH_CHECK(residual.scalar_type() == x.scalar_type() && w.scalar_type() == x.scalar_type(), "one dtype");
    auto out = torch::empty_like(x);
    if (x.scalar_type() == torch::kFloat32) add_rms_norm_impl<float>(x, residual, w, out, eps);
    else add_rms_norm_impl<at::BFloat16>(x, residual, w, out, eps);
    return out;
}

namespace {

template <bool Gelu>
torch::Tensor act_mul(const torch::Tensor& gate_up) {
    check(gate_up);
    TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0, "contiguous [T, 2I]");
    auto out = torch::empty({gate_up.numel() / gate_up.size(-1), gate_up.size(-1) / 2}, gate_up.options());
    if (gate_up.scalar_type() == torch::kFloat32) act_mul_impl<float, Gelu>(gate_up, out);
    else act_mul_impl<at::BFloat16, Gelu>(gate_up, out);
    return out;
}

}  // namespace

// gate_up: [T, 2I] -> silu(gate) * up: [T, I]
torch::Tensor silu_mul(torch::Tensor gate_up) { return act_mul<false>(gate_up); }

// gate_up: [T, 2I] -> gelu_tanh(gate) * up: [T, I] (GeGLU)
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) { return act_mul<true>(gate_up); }

// Rotate-half RoPE in place on x: [T, heads, d] (rows may be strided views of a fused qkv
// output: stride(0) is honoured, heads and d must be dense). cos/sin: [max_pos, d/2] fp32.
void rope_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
    check(x);
    TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "layout");
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32, "fp32 tables");
    if (x.scalar_type() == torch::kFloat32) rope_impl<float>(x, positions, cos, sin);
    else rope_impl<at::BFloat16>(x, positions, cos, sin);
}

namespace {

template <typename T>
void write_kv_impl(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kc, torch::Tensor& vc,
                   const int64_t* slots) {
    const int64_t T_ = k.size(0), KVH = k.size(1), d = k.size(2);
    const int64_t cache_head = kc.size(1) * kc.size(2) * d;
    const T *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    T *kcp = kc.data_ptr<T>(), *vcp = vc.data_ptr<T>();
    const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
    at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
            for (int64_t h = 0; h < KVH; ++h) {
                std::memcpy(kcp + h * cache_head + slots[t] * d, kp + t * ks0 + h * ks1, d * sizeof(T));
                std::memcpy(vcp + h * cache_head + slots[t] * d, vp + t * vs0 + h * vs1, d * sizeof(T));
            }
        }
    });
}

template <typename T>
inline uint32_t bits_of(T x);

template <>
inline uint32_t bits_of<float>(float x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}

template <>
inline uint32_t bits_of<at::BFloat16>(at::BFloat16 x) { return static_cast<uint32_t>(x.x) << 16; }

#if defined(__AVX512F__)
using conveyor::load16_bits;

// One pass: per lane the running maximum and where it was first seen; non-finite values are
// caught on the exponent bits (intrinsics are not rewritten by -ffast-math).
template <typename T>
bool argmax_row_avx512(const T* row, int64_t V, int64_t* idx, float* best) {
    if (V % 16) return false;
    const __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::max());
    __m512i at = _mm512_setzero_si512(), lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 bad = 0;
    for (int64_t i = 0; i < V; i += 16) {
        const __m512i bits = load16_bits<T>(row + i);
        bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exp_mask), exp_mask);
        const __m512 v = _mm512_castsi512_ps(bits);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, mx, _CMP_GT_OQ);
        mx = _mm512_mask_mov_ps(mx, gt, v);
        at = _mm512_mask_mov_epi32(at, gt, _mm512_add_epi32(lane, _mm512_set1_epi32((int)i)));
    }
    alignas(64) float m[16];
    alignas(64) int32_t a[16];
    _mm512_store_ps(m, mx);
    _mm512_store_si512(a, at);
    int k = 0;
    for (int j = 1; j < 16; ++j)
        if (m[j] > m[k] || (m[j] == m[k] && a[j] < a[k])) k = j;
    *idx = a[k];
    *best = bad ? std::numeric_limits<float>::quiet_NaN() : m[k];
    return true;
}
#endif

template <typename T>
void argmax_impl(const torch::Tensor& x, int64_t* idx, float* best) {
    const int64_t V = x.size(1), rows = x.size(0);
    const T* xp = x.data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
            const T* row = xp + r * V;
#if defined(__AVX512F__)
            if (argmax_row_avx512<T>(row, V, idx + r, best + r)) continue;
#endif
            // Non-finite values are found from the bits (the file builds with -ffast-math, which
            // assumes there are none): exponent all ones.
            float mx = widen(row[0]);
            uint32_t bad = 0;
#pragma omp simd reduction(max : mx) reduction(| : bad)
            for (int64_t i = 0; i < V; ++i) {
                mx = std::max(mx, widen(row[i]));
                bad |= ((bits_of<T>(row[i]) & 0x7f800000u) == 0x7f800000u);
            }
            int64_t at = 0;
            for (int64_t i = 0; i < V; ++i)
                if (widen(row[i]) == mx) {
                    at = i;
                    break;
                }
            idx[r] = at;
            best[r] = bad ? std::numeric_limits<float>::quiet_NaN() : mx;
        }
    });
}

}  // namespace

// k, v: [T, KVH, d] (strided rows allowed: views of the fused qkv output); caches [KVH, NB, BS, d]
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
    check(k);
    TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k.scalar_type() &&
                    v_cache.scalar_type() == k.scalar_type(), "one dtype");
    TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(), "layout");
    auto slots = slot_mapping.contiguous();
    TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == k.size(0), "slots");
    if (k.scalar_type() == torch::kFloat32) write_kv_impl<float>(k, v, k_cache, v_cache, slots.data_ptr<int64_t>());
    else write_kv_impl<at::BFloat16>(k, v, k_cache, v_cache, slots.data_ptr<int64_t>());
}

// Greedy choice per row of logits [R, V]: (index of the first maximum, the maximum as fp32 or
// NaN if the row holds a NaN or an infinity).
std::tuple<torch::Tensor, torch::Tensor> argmax_rows(torch::Tensor x) {
    check(x);
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "contiguous [rows, vocab]");
    auto idx = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
    auto best = torch::empty({x.size(0)}, x.options().dtype(torch::kFloat32));
    if (x.scalar_type() == torch::kFloat32) argmax_impl<float>(x, idx.data_ptr<int64_t>(), best.data_ptr<float>());
    else argmax_impl<at::BFloat16>(x, idx.data_ptr<int64_t>(), best.data_ptr<float>());
    return {idx, best};
}
