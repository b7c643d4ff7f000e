// Shared helpers of the CPU kernels: fp32 <-> bf16 and 16-lane loads widened to fp32.
#pragma once

#include <torch/types.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstring>

namespace conveyor {

inline float widen(float x) { return x; }

inline float widen(at::BFloat16 x) {
    uint32_t bits = static_cast<uint32_t>(x.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline void narrow(float x, float* out) { *out = x; }

inline void narrow(float x, at::BFloat16* out) { *out = at::BFloat16(x); }   // round to nearest even

#if defined(__AVX512F__)
// 16 values as their fp32 bit patterns (bf16 -> fp32 is a 16-bit shift).
template <typename T>
inline __m512i load16_bits(const T* p);

template <>
inline __m512i load16_bits<float>(const float* p) { return _mm512_loadu_si512(p); }

template <>
inline __m512i load16_bits<at::BFloat16>(const at::BFloat16* p) {
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
}

template <typename T>
inline __m512 load16(const T* p) { return _mm512_castsi512_ps(load16_bits<T>(p)); }
#endif

// Each of G rows of L scores -> softmax, in place (L >= 1; no infinities: the files may build with
// -ffast-math).
inline void softmax_rows(float* scores, int64_t G, int64_t L) {
    for (int64_t g = 0; g < G; ++g) {
        float* sg = scores + g * L;
        float mx = sg[0];
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
}

}  // namespace conveyor
