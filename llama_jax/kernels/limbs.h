// Activations as int8 limbs, for the k-quants' matrix-vector products (matvec.cc). Widening a k-quant block to f32
// costs more than reading its bytes (sub-block scales, 4- and 6-bit fields), so a batch-1 decode step on them was
// bound by that arithmetic, not by memory. Instead the block's integer quants multiply integers made from x, exactly
// (one vpdpbusd: 64 byte products a 512-bit instruction, in int32), and the f32 arithmetic is per 4 values.
//
// The form: per block of 32 inputs, x ≈ s·V with s = max|x| / (127·2¹⁵) and V the nearest integers (|V| < 2²²,
// so x is kept to 2⁻²³ of the block's largest value), V = (l0·2⁸ + l1)·2⁸ + l2 with l0, l1, l2 int8. Against 64
// quants q (unsigned bytes < 64), lane l's C = Σ q·V over values 4l..4l+3 is exact in int32 (< 4·63·2²²), by
// Horner over the limbs (dot, shift 8, dot, shift 8, dot). Against float64 on real activations this is within the
// f32 class (the error of a straight f32 sum or less: RESULTS.md, "Integer dot products"); with two limbs it is not.
//
// Each chunk of 64 inputs of one sequence is a LimbChunk; the lanes of the summation are 16 int32 (one zmm, or two
// ymm with AVX2: vpmaddubsw then vpmaddwd give the same integers as vpdpbusd, as 2·63·128 < 2¹⁵ never saturates).
#pragma once

#include <limits>

#include "common.h"
#include "simd.h"

#if defined(__AVX512F__) && !defined(__AVX512VNNI__)
#error "the avx512 variant is compiled with AVX512-VNNI (variants.py)"
#endif

namespace llama_jax {

constexpr int64_t kChunk = 64;  // the inputs of one LimbChunk: 16 lanes of 4

struct alignas(64) LimbChunk {
  int8_t limb[3][kChunk];  // V = (limb[0] · 2⁸ + limb[1]) · 2⁸ + limb[2], value by value
  float scale[16];         // lane l's s (lanes 0-7: the chunk's first block of 32, 8-15: its second)
  int32_t offset[16];      // lane l's 32 · (the sum of V over its 4 values): Q6_K's q - 32 as q, less this
};

// A sequence's limbs: its chunks, then per 256 inputs (a k-quant block) `sums`: lanes 0-7 zero, lane 8 + j minus
// s·ΣV over sub-block j (of 32), the other side of a Q4_K/Q5_K block's mins (lanes 8-15 of its scales).
inline int64_t LimbBytes(int64_t in) { return in / kChunk * int64_t{sizeof(LimbChunk)} + in / 256 * 64; }
inline const LimbChunk* Chunks(const uint8_t* limbs) { return reinterpret_cast<const LimbChunk*>(limbs); }
inline const float* Sums(const uint8_t* limbs, int64_t in, int64_t block) {
  return reinterpret_cast<const float*>(limbs + in / kChunk * int64_t{sizeof(LimbChunk)}) + 16 * block;
}

// x [in] (a multiple of 256) as limbs into out (LimbBytes(in), 64-byte aligned). Plain loops the compiler
// vectorizes (IEEE division and rounding, integer arithmetic: the same values on every variant). A block holding an
// inf or a NaN gets s = NaN (its products NaN, as the f32 sums would be non-finite).
inline void MakeLimbs(const float* x, int64_t in, uint8_t* out) {
  LimbChunk* chunks = reinterpret_cast<LimbChunk*>(out);
  float* sums = reinterpret_cast<float*>(out + in / kChunk * int64_t{sizeof(LimbChunk)});
  for (int64_t j = 0; j < in / 32; ++j) {
    const float* v = x + 32 * j;
    float top = 0.0f;
    int finite = 1;
    for (int i = 0; i < 32; ++i) top = std::max(top, std::fabs(v[i]));
    for (int i = 0; i < 32; ++i) finite &= std::fabs(v[i]) <= std::numeric_limits<float>::max();
    const float s = !finite ? NAN : top / (127.0f * 32768.0f);
    const float inverse_of = s > 0.0f ? s : 1.0f;  // all zero (s = 0) or not finite: V = 0
    alignas(64) int32_t value[32];
    for (int i = 0; i < 32; ++i) value[i] = s > 0.0f ? static_cast<int32_t>(std::nearbyint(v[i] / inverse_of)) : 0;
    LimbChunk& chunk = chunks[j / 2];
    const int half = static_cast<int>(j % 2);  // which 32 of the chunk
    for (int i = 0; i < 32; ++i) {
      const int32_t l2 = ((value[i] + 128) & 255) - 128, rest = (value[i] - l2) / 256;
      const int32_t l1 = ((rest + 128) & 255) - 128;
      chunk.limb[0][32 * half + i] = static_cast<int8_t>((rest - l1) / 256);
      chunk.limb[1][32 * half + i] = static_cast<int8_t>(l1);
      chunk.limb[2][32 * half + i] = static_cast<int8_t>(l2);
    }
    int32_t total = 0;
    for (int l = 0; l < 8; ++l) {
      const int32_t lane = value[4 * l] + value[4 * l + 1] + value[4 * l + 2] + value[4 * l + 3];
      chunk.offset[8 * half + l] = 32 * lane;
      chunk.scale[8 * half + l] = s;
      total += lane;
    }
    float* block_sums = sums + 16 * (j / 8);
    if (j % 8 == 0) std::fill(block_sums, block_sums + 8, 0.0f);
    block_sums[8 + j % 8] = -static_cast<float>(static_cast<double>(s) * total);  // rounded once
  }
}

// 64 quants, unsigned bytes < 64, in value order; and 16 int32 lanes
#ifdef __AVX512F__
struct Q64 {
  __m512i bytes;
};
struct I16 {
  __m512i lanes;
};
inline Q64 Quants64(__m256i first, __m256i second) { return {_mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1)}; }
inline I16 Dot(I16 acc, Q64 q, const int8_t* limb) {
  return {_mm512_dpbusd_epi32(acc.lanes, q.bytes, _mm512_load_si512(limb))};
}
inline I16 Shift8(I16 a) { return {_mm512_slli_epi32(a.lanes, 8)}; }
inline I16 Less(I16 a, const int32_t* b) { return {_mm512_sub_epi32(a.lanes, _mm512_load_si512(b))}; }
inline V16 ToFloat(I16 a) { return {{_mm512_cvtepi32_ps(a.lanes)}}; }
inline I16 ZeroLanes() { return {_mm512_setzero_si512()}; }
#else
struct Q64 {
  __m256i bytes[2];
};
struct I16 {
  __m256i lanes[2];
};
inline Q64 Quants64(__m256i first, __m256i second) { return {{first, second}}; }
inline I16 Dot(I16 acc, Q64 q, const int8_t* limb) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int k = 0; k < 2; ++k) {
    const __m256i pairs =
        _mm256_maddubs_epi16(q.bytes[k], _mm256_load_si256(reinterpret_cast<const __m256i*>(limb + 32 * k)));
    acc.lanes[k] = _mm256_add_epi32(acc.lanes[k], _mm256_madd_epi16(pairs, ones));
  }
  return acc;
}
inline I16 Shift8(I16 a) { return {{_mm256_slli_epi32(a.lanes[0], 8), _mm256_slli_epi32(a.lanes[1], 8)}}; }
inline I16 Less(I16 a, const int32_t* b) {
  const __m256i* p = reinterpret_cast<const __m256i*>(b);
  return {{_mm256_sub_epi32(a.lanes[0], _mm256_load_si256(p)), _mm256_sub_epi32(a.lanes[1], _mm256_load_si256(p + 1))}};
}
inline V16 ToFloat(I16 a) { return {{_mm256_cvtepi32_ps(a.lanes[0]), _mm256_cvtepi32_ps(a.lanes[1])}}; }
inline I16 ZeroLanes() { return {{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
#endif

// lane l: Σ q·V over values 4l..4l+3 of the chunk, exact
inline I16 DotLimbs(Q64 q, const LimbChunk& x) {
  I16 c = Dot(ZeroLanes(), q, x.limb[0]);
  c = Dot(Shift8(c), q, x.limb[1]);
  return Dot(Shift8(c), q, x.limb[2]);
}

}  // namespace llama_jax
