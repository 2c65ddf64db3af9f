// float32 vectors for the kernels' templates, one struct per instruction set: the same few operations over 16
// (AVX-512) or 8 (AVX2) lanes, each load and store masked to the first n lanes (the rest read as zeros).

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace gpt_kernels {

#pragma GCC push_options
#pragma GCC target("avx512f")

namespace avx512 {

struct FloatLanes {
  using Vec = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kLanes = 16;
  static Mask Lanes(int64_t n) { return n >= kLanes ? Mask(0xffff) : Mask((1u << n) - 1); }
  static Vec Zero() { return _mm512_setzero_ps(); }
  static Vec Set(float value) { return _mm512_set1_ps(value); }
  static Vec Load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static void Store(float* p, Vec v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
  static Vec Add(Vec x, Vec y) { return _mm512_add_ps(x, y); }
  static Vec Madd(Vec acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
  static float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace avx512

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace avx2 {

struct FloatLanes {
  using Vec = __m256;
  using Mask = __m256i;  // all ones in the lanes to load
  static constexpr int64_t kLanes = 8;
  static Mask Lanes(int64_t n) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < kLanes ? n : kLanes)), index);
  }
  static Vec Zero() { return _mm256_setzero_ps(); }
  static Vec Set(float value) { return _mm256_set1_ps(value); }
  static Vec Load(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static void Store(float* p, Vec v, Mask m) { _mm256_maskstore_ps(p, m, v); }
  static Vec Add(Vec x, Vec y) { return _mm256_add_ps(x, y); }
  static Vec Madd(Vec acc, Vec x, Vec w) { return _mm256_fmadd_ps(x, w, acc); }
  static float Sum(Vec v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

}  // namespace avx2

#pragma GCC pop_options

}  // namespace gpt_kernels
