// Fused elementwise ops for the CPU decoder layer (fp32): each replaces 3-10 small torch ops
// and as many passes over the activations.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

inline void rms_row(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t d,
                    float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / (float)d + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv * w[i];
}

}  // namespace

// out = rms_norm(x) * w over the last dim; x: [T, D]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && w.is_contiguous(), "fp32 contiguous");
    const int64_t d = x.size(-1), rows = x.numel() / d;
    auto out = torch::empty_like(x);
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) rms_row(xp + r * d, wp, op + r * d, d, (float)eps);
    });
    return out;
}

// residual += x (in place); returns rms_norm(residual) * w
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
    TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(), "shapes");
    const int64_t d = x.size(-1), rows = x.numel() / d;
    auto out = torch::empty_like(x);
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float *rp = residual.data_ptr<float>(), *op = out.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
            float* rr = rp + r * d;
            const float* xr = xp + r * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) rr[i] += xr[i];
            rms_row(rr, wp, op + r * d, d, (float)eps);
        }
    });
    return out;
}

// gate_up: [T, 2I] -> silu(gate) * up: [T, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
    TORCH_CHECK(gate_up.is_contiguous() && gate_up.dtype() == torch::kFloat32, "fp32 contiguous");
    const int64_t two_i = gate_up.size(-1), inter = two_i / 2, rows = gate_up.numel() / two_i;
    auto out = torch::empty({rows, inter}, gate_up.options());
    const float* gp = gate_up.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
            const float* g = gp + r * two_i;
            const float* u = g + inter;
            float* o = op + r * inter;
#pragma omp simd
            for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
        }
    });
    return out;
}

// Rotate-half RoPE in place on x: [T, heads, d] (rows may be strided views of a fused qkv
// output: stride(0) is honoured, heads and d must be dense). cos/sin: [max_pos, d/2].
void rope_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin) {
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.stride(2) == 1 && x.stride(1) == x.size(2), "layout");
    const int64_t T = x.size(0), H = x.size(1), d = x.size(2), half = d / 2, row = x.stride(0);
    auto pos = positions.contiguous();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    float* xp = x.data_ptr<float>();
    at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
            const float* c = cp + pp[t] * half;
            const float* s = sp + pp[t] * half;
            for (int64_t h = 0; h < H; ++h) {
                float* v = xp + t * row + h * d;
#pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    const float x1 = v[i], x2 = v[i + half];
                    v[i] = x1 * c[i] - x2 * s[i];
                    v[i + half] = x2 * c[i] + x1 * s[i];
                }
            }
        }
    });
}
