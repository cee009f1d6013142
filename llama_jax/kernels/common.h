// What the native kernels share: the element types the weights are held in and their exact widening to f32, ggml's
// blocks of 32 widened in registers to the loader's values, the 16-lane register V16 of the summation order, and
// the work-claiming scheme that spreads a kernel's items over XLA's thread pool (see decode.cc and products.cc).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace llama_jax {

inline float HorizontalSum(__m256 v) {  // the one fixed tree: (l0+l4, l1+l5, l2+l6, l3+l7), then hadd twice
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

struct Bf16 {  // the element types that share C++'s uint16_t, told apart
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};

inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 Load8(const Bf16* p) {  // 8 bf16 -> 8 f32: the bf16 bits are the f32's upper half
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256 Load8(const Half* p) {  // 8 f16 -> 8 f32 (exact)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float Widen(float v) { return v; }
inline float Widen(Bf16 v) {
  uint32_t bits = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float Widen(Half v) { return _cvtsh_ss(v.bits); }

inline float HalfAt(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
}

inline __m128 TwoHalvesAt(const uint8_t* p) {  // [p's f16, the next f16, 0, 0] in one load and one conversion
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
}

// V16: the 16 lanes of the summation order, one AVX-512 register or two AVX2 ones
#ifdef __AVX512F__
struct V16 {
  __m512 v;
};
inline V16 Zero16() { return {_mm512_setzero_ps()}; }
inline V16 Fma16(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float Sum16(V16 a) {  // lane l + lane l + 8, then the fixed tree
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
  return HorizontalSum(_mm256_add_ps(_mm512_castps512_ps256(a.v), hi));
}
inline V16 Load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 Load16(const Bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
}
inline V16 Load16(const Half* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
#else
struct V16 {
  __m256 lo, hi;
};
inline V16 Zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 Fma16(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float Sum16(V16 a) { return HorizontalSum(_mm256_add_ps(a.lo, a.hi)); }
template <typename W>
inline V16 Load16(const W* p) {
  return {Load8(p), Load8(p + 8)};
}
#endif

// ggml's blocks of 32 weights: Widen32 gives the block's values as two V16, in order (values 0-15, 16-31)
#ifdef __AVX512F__
// a 4-bit block's 16 possible values (table[j] for q = j), computed once per block, looked up by q: exact, as the
// table's entries are the loader's values
inline void Lookup4(const uint8_t* qs, __m512 table, V16 w[2]) {  // qs[j] & 15 is value j, qs[j] >> 4 value j + 16
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  w[0].v = _mm512_permutexvar_ps(bytes, table);  // the permutation reads the low 4 bits of each index
  w[1].v = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
inline __m512 Iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
#else
// AVX2 widens a block by halves (WidenHalf(block, h): its values 8h..8h+7 and 16+8h..16+8h+7), whole blocks as
// both halves; q[0], q[1]: the 4-bit values 8h.. and 16 + 8h.. (qs[j] & 15 is value j, qs[j] >> 4 value j + 16)
inline void NibbleHalf(const uint8_t* qs, int h, __m256i q[2]) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * h)));
  q[0] = _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F));
  q[1] = _mm256_srli_epi32(bytes, 4);
}
template <typename F>
inline void WidenHalves(const uint8_t* block, V16 w[2]) {
  __m256 lanes[2][2];  // [h][g]: lanes 8h.. of values 16g..
  for (int h = 0; h < 2; ++h) F::WidenHalf(block, h, lanes[h]);
  w[0] = {lanes[0][0], lanes[1][0]};
  w[1] = {lanes[0][1], lanes[1][1]};
}
#endif

struct Q4_0 {  // f16 d, 16 bytes of nibbles q: d * (q - 8)
  static constexpr int64_t kBytes = 18;
  static inline void Widen32(const uint8_t* block, V16 w[2]) {
#ifdef __AVX512F__
    const __m512 table = _mm512_mul_ps(_mm512_set1_ps(HalfAt(block)), _mm512_sub_ps(Iota16(), _mm512_set1_ps(8)));
    Lookup4(block + 2, table, w);
#else
    WidenHalves<Q4_0>(block, w);
#endif
  }
#ifndef __AVX512F__
  static inline void WidenHalf(const uint8_t* block, int h, __m256 w[2]) {
    const __m256 d = _mm256_set1_ps(HalfAt(block));
    __m256i q[2];
    NibbleHalf(block + 2, h, q);
    for (int g = 0; g < 2; ++g) w[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[g], _mm256_set1_epi32(8))));
  }
#endif
};

// f16 d, f16 m, 16 bytes of nibbles q: d * q + m. ggml rounds the product, then the sum; the product of an f16
// (11 significant bits) and a 4-bit q is exact in f32, so one fused multiply-add rounds the same
struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static inline void Widen32(const uint8_t* block, V16 w[2]) {
#ifdef __AVX512F__
    const __m128 dm = TwoHalvesAt(block);  // d and m together: half the instructions of two scalars
    const __m512 m = _mm512_permutexvar_ps(_mm512_set1_epi32(1), _mm512_castps128_ps512(dm));
    Lookup4(block + 4, _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), Iota16(), m), w);
#else
    WidenHalves<Q4_1>(block, w);
#endif
  }
#ifndef __AVX512F__
  static inline void WidenHalf(const uint8_t* block, int h, __m256 w[2]) {
    const __m128 dm = TwoHalvesAt(block);
    const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    __m256i q[2];
    NibbleHalf(block + 4, h, q);
    for (int g = 0; g < 2; ++g) w[g] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[g]), m);  // d * q is exact
  }
#endif
};

struct Q8_0 {  // f16 d, 32 int8 q: q * d
  static constexpr int64_t kBytes = 34;
  static inline void Widen32(const uint8_t* block, V16 w[2]) {
#ifdef __AVX512F__
    const __m512 d = _mm512_set1_ps(HalfAt(block));
    for (int g = 0; g < 2; ++g) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * g));
      w[g].v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    }
#else
    WidenHalves<Q8_0>(block, w);
#endif
  }
#ifndef __AVX512F__
  static inline void WidenHalf(const uint8_t* block, int h, __m256 w[2]) {
    const __m256 d = _mm256_set1_ps(HalfAt(block));
    for (int g = 0; g < 2; ++g) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 16 * g + 8 * h));
      w[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  }
#endif
};

// Work cut into items 0..items-1, shared by the caller and the pool tasks it scheduled (which may outlive the
// call: they then find no item left). `run(k)` does item k; the items write disjoint outputs.
struct Items {
  std::function<void(int64_t)> run;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < items;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      run(k);
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

// Runs every item on the calling thread and up to threads - 1 pool tasks
inline void RunItems(ffi::ThreadPool& pool, std::shared_ptr<Items> work) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min(threads, work->items) - 1;
  for (int64_t p = 0; p < helpers; ++p) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->items) _mm_pause();  // items claimed by running tasks
}

}  // namespace llama_jax
