// Row kernels shared by the standalone fused ops (fused_ops_cpu.cpp) and the decode loop
// (decode_layers_cpu.cpp): one definition, so both give the same bits. fp32 or bf16 storage,
// fp32 math. Out of line and opaque to interprocedural optimization (noipa: no inlining, no
// specialized clones): compiled into different callers the compiler may vectorize a reduction
// differently, and the two paths must agree to the bit.
#pragma once

#include "cpu_vec.h"

#include <cmath>
#include <cstdint>

#if defined(__clang__)
#define CONVEYOR_ROW __attribute__((noinline))
#else
#define CONVEYOR_ROW __attribute__((noipa))
#endif

namespace conveyor {

// out = x / rms(x) * w over d values (out may not alias x).
template <typename T>
CONVEYOR_ROW void rms_row(const T* __restrict x, const T* __restrict w, T* __restrict out, int64_t d, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) {
        const float v = widen(x[i]);
        ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / (float)d + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) narrow(widen(x[i]) * inv * widen(w[i]), out + i);
}

// r = r + x, rounded to T (the residual stream), over d values.
template <typename T>
CONVEYOR_ROW void add_row(T* __restrict r, const T* __restrict x, int64_t d) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) narrow(widen(r[i]) + widen(x[i]), r + i);
}

// Rotate-half RoPE of one head (2 * half values) in place: c, s the position's tables.
template <typename T>
CONVEYOR_ROW void rope_row(T* __restrict v, const float* __restrict c, const float* __restrict s, int64_t half) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = widen(v[i]), x2 = widen(v[i + half]);
        narrow(x1 * c[i] - x2 * s[i], v + i);
        narrow(x2 * c[i] + x1 * s[i], v + i + half);
    }
}

// out = silu(g) * u over n values.
template <typename T>
CONVEYOR_ROW void silu_mul_row(const T* __restrict g, const T* __restrict u, T* __restrict out, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float gv = widen(g[i]);
        narrow(gv / (1.f + std::exp(-gv)) * widen(u[i]), out + i);
    }
}

// out = gelu_tanh(g) * u over n values (GeGLU), the gelu rounded to T before the product, as torch
// computes F.gelu(gate, approximate="tanh") * up in T.
template <typename T>
CONVEYOR_ROW void gelu_tanh_mul_row(const T* __restrict g, const T* __restrict u, T* __restrict out, int64_t n) {
    constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;   // sqrt(2 / pi)
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float x = widen(g[i]);
        T gl;
        narrow(0.5f * x * (1.f + std::tanh(kBeta * (x + kKappa * x * x * x))), &gl);
        narrow(widen(gl) * widen(u[i]), out + i);
    }
}

}  // namespace conveyor
