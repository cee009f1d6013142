// The one SIMD vocabulary of the kernels: Vec, the variant's register of f32 (one AVX-512 zmm of 16 lanes, or one
// AVX2 ymm of 8), and V16, the 16 lanes of the summation order made of Vec (one zmm, or two ymm). Every V16
// operation is its Vec operation on each part: with AVX-512 the same single instruction, with AVX2 the same
// instruction on both halves, so a sum in V16 has the same bits on both instruction sets.
#pragma once

#include <immintrin.h>

namespace llama_jax {

#ifdef __AVX512F__
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec VZero() { return _mm512_setzero_ps(); }
inline Vec VLoad(const float* p) { return _mm512_load_ps(p); }
inline Vec VLoadU(const float* p) { return _mm512_loadu_ps(p); }
inline void VStoreU(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec VSet(float a) { return _mm512_set1_ps(a); }
inline Vec VFma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec VAdd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec VMul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec VMax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec VSub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec VZero() { return _mm256_setzero_ps(); }
inline Vec VLoad(const float* p) { return _mm256_load_ps(p); }
inline Vec VLoadU(const float* p) { return _mm256_loadu_ps(p); }
inline void VStoreU(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec VSet(float a) { return _mm256_set1_ps(a); }
inline Vec VFma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec VAdd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec VMul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec VMax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec VSub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
#endif

inline float HorizontalSum(__m256 v) {  // the one fixed tree: (l0+l4, l1+l5, l2+l6, l3+l7), then hadd twice
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

constexpr int kParts = 16 / kLanes;  // the registers of a V16
struct V16 {
  Vec part[kParts];  // lanes 0.., then (AVX2) lanes 8..
};
inline V16 Zero16() {
  V16 a;
  for (int k = 0; k < kParts; ++k) a.part[k] = VZero();
  return a;
}
inline V16 Add16(V16 a, V16 b) {
  for (int k = 0; k < kParts; ++k) a.part[k] = VAdd(a.part[k], b.part[k]);
  return a;
}
inline V16 Mul16(V16 a, V16 b) {
  for (int k = 0; k < kParts; ++k) a.part[k] = VMul(a.part[k], b.part[k]);
  return a;
}
inline V16 Fma16(V16 a, V16 b, V16 c) {
  for (int k = 0; k < kParts; ++k) c.part[k] = VFma(a.part[k], b.part[k], c.part[k]);
  return c;
}
inline V16 Load16(const float* p) {
  V16 a;
  for (int k = 0; k < kParts; ++k) a.part[k] = VLoadU(p + k * kLanes);
  return a;
}
inline void Store16(float* p, V16 a) {
  for (int k = 0; k < kParts; ++k) VStoreU(p + k * kLanes, a.part[k]);
}
inline float Sum16(V16 a) {  // lane l + lane l + 8, then the fixed tree
#ifdef __AVX512F__
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.part[0]), 1));
  return HorizontalSum(_mm256_add_ps(_mm512_castps512_ps256(a.part[0]), hi));
#else
  return HorizontalSum(_mm256_add_ps(a.part[0], a.part[1]));
#endif
}

}  // namespace llama_jax
