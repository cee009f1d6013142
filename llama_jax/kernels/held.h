// The ways a weight matrix is held, one trait each (ggml's type_traits): f32, bf16 and f16 elements (F32, BF16,
// F16), ggml's blocks of 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and its k-quants of 256 (Q4_K, Q5_K, Q6_K).
// Every kernel family is one template over these traits (Matvec<H>, Product<H>, ScoreHead<H>); a new way of
// holding a matrix is a trait here and a line in handlers.h.
// A trait H gives:
// - its geometry: kValues, the values of a unit (an element: 1, a block: its values), and RowBytes(I), the bytes
//   of a row of I values;
// - the FFI buffer: its element type kDtype, and Matrix(dims, at, o, i): whether dims[at..] (the last kRank) hold
//   one matrix [O, I] as H lays it out (Layout(), for messages), and its O and I;
// - Read(row, i0, n, out): a row's values i0..i0+n-1 widened to f32 (a product's panels);
// - a matvec's step of kStep values (kStepBytes bytes of a row): Step(at, w), their values as kStep / 16 V16 in
//   order; with AVX2 StepHalf(at, h, w), their values 16g + 8h..16g + 8h + 7 in w[g] (a tile summed by halves,
//   matvec.cc); Value(row, j), an element row's value j (the tail past its last whole step); kPrefetched, whether
//   the matvec asks for a row's bytes ahead;
// - kLimbs: whether the matvec multiplies the quants by x's int8 limbs instead (limbs.h; the k-quants), and then
//   ChunkQuants(block, c), the 64 quants of chunk c as unsigned bytes, LimbScales(block) and ChunkScales(scales,
//   c), each lane's scale, and kMins / kOffset, the limbs' sums their mins take or the 32 their quants are less.
// Every widening is exact: the elements' values, or exactly the f32 values the loader's dequantization gives (ggml's
// order: d * q, then + m for Q4_1, as separate roundings: no fused multiply-add where it would round otherwise).
#pragma once

#include "common.h"
#include "limbs.h"
#include "simd.h"

namespace llama_jax {

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

#ifdef __AVX512F__
inline V16 Load16(const Bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {{_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))}};
}
inline V16 Load16(const Half* p) {
  return {{_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}};
}
#else
template <typename W>
inline V16 Load16(const W* p) {
  return {{Load8(p), Load8(p + 8)}};
}
#endif

inline float Widen(float v) { return v; }
inline float Widen(Bf16 v) {
  uint32_t bits = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float Widen(Half v) { return _cvtsh_ss(v.bits); }

// A matrix held as elements of W (the FFI's T): [O, I], row o's values at o * I. A matvec step is 16 of them.
template <ffi::DataType T, typename W>
struct Elements {
  static constexpr ffi::DataType kDtype = T;
  static constexpr size_t kRank = 2;
  static constexpr int64_t kValues = 1;
  static constexpr int64_t kStep = 16, kStepBytes = 16 * sizeof(W);
  static constexpr bool kPrefetched = false;  // element rows stream well without (f32 measured slower with it)
  static constexpr bool kLimbs = false;       // whether a matvec multiplies its quants by x's limbs (limbs.h)

  static bool Matrix(ffi::Span<const int64_t> dims, size_t at, int64_t& o, int64_t& i) {
    if (dims.size() != at + kRank) return false;
    o = dims[at], i = dims[at + 1];
    return true;
  }
  static std::string Layout() { return "[O, I]"; }
  static int64_t RowBytes(int64_t cols) { return cols * static_cast<int64_t>(sizeof(W)); }
  static const W* Typed(const uint8_t* at) { return reinterpret_cast<const W*>(at); }

  static void Read(const uint8_t* row, int64_t i0, int64_t n, float* out) {
    const W* values = Typed(row) + i0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) Store16(out + i, Load16(values + i));
    for (; i < n; ++i) out[i] = Widen(values[i]);
  }
  static void Step(const uint8_t* at, V16 w[1]) { w[0] = Load16(Typed(at)); }
#ifndef __AVX512F__
  static void StepHalf(const uint8_t* at, int h, Vec w[1]) { w[0] = Load8(Typed(at) + 8 * h); }
#endif
  static float Value(const uint8_t* row, int64_t j) { return Widen(Typed(row)[j]); }
};
using F32 = Elements<ffi::F32, float>;
using BF16 = Elements<ffi::BF16, Bf16>;
using F16 = Elements<ffi::F16, Half>;

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

// A matrix held in ggml's blocks of Values values (a multiple of 16) of format F, Bytes each: [O, I / Values, Bytes].
// A matvec step is a block. F widens one: with AVX-512 F::Widen(block, w), its values as Values / 16 V16 in order
// (values 0-15, 16-31, ...); with AVX2 by halves, F::WidenHalf(block, h, w): its values 16g + 8h..16g + 8h + 7 in
// w[g], and where F::kWhole (a block whose scales cost more to read than its values) also whole, as AVX-512's.
template <typename F, int64_t Values, int64_t Bytes>
struct Blocks {
  static constexpr ffi::DataType kDtype = ffi::U8;
  static constexpr size_t kRank = 3;
  static constexpr int64_t kValues = Values;
  static constexpr int64_t kStep = Values, kStepBytes = Bytes;
  // block rows stream from memory faster with their bytes asked for ahead (matvec.cc's Ahead)
  static constexpr bool kPrefetched = true;
  static constexpr bool kWhole = false;  // (AVX2) whether F widens a whole block at once besides by halves
  static constexpr bool kLimbs = false;  // whether a matvec multiplies its quants by x's limbs (limbs.h)

  static bool Matrix(ffi::Span<const int64_t> dims, size_t at, int64_t& o, int64_t& i) {
    if (dims.size() != at + kRank || dims[at + 2] != Bytes) return false;
    o = dims[at], i = dims[at + 1] * Values;
    return true;
  }
  static std::string Layout() { return "[O, I / " + std::to_string(Values) + ", " + std::to_string(Bytes) + "]"; }
  static int64_t RowBytes(int64_t cols) { return cols / Values * Bytes; }

  static void Read(const uint8_t* row, int64_t i0, int64_t n, float* out) {
    constexpr int kGroups = Values / 16;
    for (int64_t b = i0 / Values; b * Values < i0 + n; ++b) {
      V16 v[kGroups];
      Step(row + b * Bytes, v);
      const int64_t lo = std::max(i0, b * Values), hi = std::min(i0 + n, b * Values + Values);
      if (hi - lo == Values) {
        for (int g = 0; g < kGroups; ++g) Store16(out + lo - i0 + 16 * g, v[g]);
        continue;
      }
      alignas(64) float values[Values];
      for (int g = 0; g < kGroups; ++g) Store16(values + 16 * g, v[g]);
      std::memcpy(out + lo - i0, values + lo - b * Values, (hi - lo) * sizeof(float));
    }
  }
#ifdef __AVX512F__
  static void Step(const uint8_t* block, V16 w[]) { F::Widen(block, w); }
#else
  static void Step(const uint8_t* block, V16 w[]) {  // both halves (a trait with kWhole widens them together)
    if constexpr (F::kWhole) {
      F::Widen(block, w);
    } else {
      Vec lanes[2][Values / 16];  // [h][g]: lanes 8h.. of values 16g..
      for (int h = 0; h < 2; ++h) F::WidenHalf(block, h, lanes[h]);
      for (int g = 0; g < Values / 16; ++g) w[g] = {{lanes[0][g], lanes[1][g]}};
    }
  }
  static void StepHalf(const uint8_t* block, int h, Vec w[]) { F::WidenHalf(block, h, w); }
#endif
};

#ifdef __AVX512F__
// a 4-bit block's 16 possible values (table[j] for q = j), computed once per block, looked up by q: exact, as the
// table's entries are the loader's values
inline void Lookup4(const uint8_t* qs, __m512 table, V16 w[2]) {  // qs[j] & 15 is value j, qs[j] >> 4 value j + 16
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  w[0].part[0] = _mm512_permutexvar_ps(bytes, table);  // the permutation reads the low 4 bits of each index
  w[1].part[0] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
inline __m512 Iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
#else
// q[0], q[1]: the 4-bit values 8h.. and 16 + 8h.. of a block (qs[j] & 15 is value j, qs[j] >> 4 value j + 16)
inline void NibbleHalf(const uint8_t* qs, int h, __m256i q[2]) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * h)));
  q[0] = _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F));
  q[1] = _mm256_srli_epi32(bytes, 4);
}
#endif

struct Q4_0 : Blocks<Q4_0, 32, 18> {  // f16 d, 16 bytes of nibbles q: d * (q - 8)
#ifdef __AVX512F__
  static void Widen(const uint8_t* block, V16 w[2]) {
    const __m512 table = _mm512_mul_ps(_mm512_set1_ps(HalfAt(block)), _mm512_sub_ps(Iota16(), _mm512_set1_ps(8)));
    Lookup4(block + 2, table, w);
  }
#else
  static void WidenHalf(const uint8_t* block, int h, Vec w[2]) {
    const __m256 d = _mm256_set1_ps(HalfAt(block));
    __m256i q[2];
    NibbleHalf(block + 2, h, q);
    for (int g = 0; g < 2; ++g) {
      w[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[g], _mm256_set1_epi32(8))));
    }
  }
#endif
};

// f16 d, f16 m, 16 bytes of nibbles q: d * q + m. ggml rounds the product, then the sum; the product of an f16
// (11 significant bits) and a 4-bit q is exact in f32, so one fused multiply-add rounds the same
struct Q4_1 : Blocks<Q4_1, 32, 20> {
#ifdef __AVX512F__
  static void Widen(const uint8_t* block, V16 w[2]) {
    const __m128 dm = TwoHalvesAt(block);  // d and m together: half the instructions of two scalars
    const __m512 m = _mm512_permutexvar_ps(_mm512_set1_epi32(1), _mm512_castps128_ps512(dm));
    Lookup4(block + 4, _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), Iota16(), m), w);
  }
#else
  static void WidenHalf(const uint8_t* block, int h, Vec w[2]) {
    const __m128 dm = TwoHalvesAt(block);
    const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    __m256i q[2];
    NibbleHalf(block + 4, h, q);
    for (int g = 0; g < 2; ++g) w[g] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[g]), m);  // d * q is exact
  }
#endif
};

struct Q8_0 : Blocks<Q8_0, 32, 34> {  // f16 d, 32 int8 q: q * d
#ifdef __AVX512F__
  static void Widen(const uint8_t* block, V16 w[2]) {
    const __m512 d = _mm512_set1_ps(HalfAt(block));
    for (int g = 0; g < 2; ++g) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * g));
      w[g].part[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
    }
  }
#else
  static void WidenHalf(const uint8_t* block, int h, Vec w[2]) {
    const __m256 d = _mm256_set1_ps(HalfAt(block));
    for (int g = 0; g < 2; ++g) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 16 * g + 8 * h));
      w[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  }
#endif
};

// ---- ggml's 5-bit blocks and k-quants. Each value is ggml's exactly, as gguf's dequantizer computes it: a 5-bit
// block's d * (q - 16) or d * q + m, a k-quant sub-block's (d * scale) * q - dmin * min or (d * scale) * (q - 32).
// d * scale and dmin * min are exact in f32 (11 significant bits times 6 or 8), and so is a product by a 4- or
// 5-bit q: a fused multiply-add then rounds once where ggml rounds the sum. With AVX-512 the values a 5-bit
// sub-block can take (32 of them) are made once and looked up by q (as Lookup4); a 4-bit one's (Q4_K) and, with
// AVX2, every one are computed.

inline __m128i Bytes16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline uint32_t U32At(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// a k-quant's 6-bit scale and min of sub-block j (of 32 values) from its 12 bytes (ggml's get_scale_min_k4), as
// a = d * scale and b = -(dmin * min) for each of the 8 sub-blocks
inline void SubBlockScales(const uint8_t* block, float a[8], float b[8]) {
  const float d = HalfAt(block), dmin = HalfAt(block + 2);
  const uint8_t* s = block + 4;
  for (int j = 0; j < 8; ++j) {
    const int scale = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    const int min = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    a[j] = d * static_cast<float>(scale), b[j] = -(dmin * static_cast<float>(min));
  }
}

// 16 bytes as V16's 16 lanes (unsigned or signed), and the 8 of half h as Vec's
#ifdef __AVX512F__
inline V16 Lanes(__m128i bytes, bool is_signed) {
  return {{_mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes))}};
}
inline __m512i Quants16(const uint8_t* p) { return _mm512_cvtepu8_epi32(Bytes16(p)); }  // 16 bytes, one per lane
inline __m512 Table(float a, float b, float first) {  // a * (first + i) + b for i = 0..15
  return _mm512_fmadd_ps(_mm512_set1_ps(a), _mm512_add_ps(Iota16(), _mm512_set1_ps(first)), _mm512_set1_ps(b));
}
// SubBlockScales in one register: lanes 0-7 d * scale, lanes 8-15 dmin * min (a k-quant block's 12 bytes of them
// read as 16 lanes, the 4 bytes after them unused): the low bits (s[i] >> shift) & mask, and where j >= 4 the top
// two (s[k] >> 6) << 4, as the scalar loop reads them
inline __m512 SubBlockScales16(const uint8_t* block) {
  const __m512i s = _mm512_cvtepu8_epi32(Bytes16(block + 4));
  const __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i mask = _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  const __m512i low = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(at, s), shift), mask);
  const __m512i top = _mm512_slli_epi32(
      _mm512_srli_epi32(
          _mm512_maskz_permutexvar_epi32(0xF0F0, _mm512_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7), s),
          6),
      4);
  const __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(HalfAt(block)), _mm512_set1_ps(HalfAt(block + 2)));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_or_si512(low, top)));
}
#else
inline Vec LanesHalf(__m128i bytes, int h, bool is_signed) {
  const __m128i half = h ? _mm_srli_si128(bytes, 8) : bytes;
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(half) : _mm256_cvtepu8_epi32(half));
}
inline V16 Lanes(__m128i bytes, bool is_signed) {
  return {{LanesHalf(bytes, 0, is_signed), LanesHalf(bytes, 1, is_signed)}};
}
#endif
inline V16 Splat16(float a) {
  V16 r;
  for (int k = 0; k < kParts; ++k) r.part[k] = VSet(a);
  return r;
}
inline V16 Affine16(float a, V16 q, float b) { return Fma16(Splat16(a), q, Splat16(b)); }  // a * q + b, rounded once
inline __m128i LowNibbles(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(0x0F)); }
inline __m128i HighNibbles(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)); }
// ((byte >> shift) & mask) << 4 for each byte (16-bit shifts: the bits moved across a byte are masked off)
inline __m128i HighBits(__m128i v, int shift, int mask) {
  const __m128i shifted = _mm_srl_epi16(v, _mm_cvtsi32_si128(shift));
  const __m128i bits = _mm_and_si128(shifted, _mm_set1_epi8(static_cast<char>(mask)));
  return _mm_slli_epi16(bits, 4);
}
// bit j of the 16-bit `bits` as byte j's bit 4 (a 5-bit block's high bits: 16 or 0)
inline __m128i HighBit16(uint32_t bits) {
  const __m128i spread = _mm_shuffle_epi8(_mm_set1_epi16(static_cast<short>(bits)),
                                          _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, bit), bit), _mm_set1_epi8(16));
}

// 5-bit blocks: f16 d (and f16 m), 32 high bits, 16 bytes of nibbles; q = nibble + 16 * high bit (value j: qh bit
// j); Q5_0 d * (q - 16), Q5_1 d * q + m
template <typename F, int64_t Bytes, bool Min>
struct Blocks5 : Blocks<F, 32, Bytes> {
  static constexpr int kHigh = Min ? 4 : 2, kQs = kHigh + 4;  // where the high bits and the nibbles start
  static constexpr bool kWhole = true;
  // group g's q (values 16g..16g + 15), minus 16 for Q5_0 (signed bytes)
  static __m128i Quants(const uint8_t* block, int g) {
    const __m128i qs = Bytes16(block + kQs);
    const __m128i q = _mm_or_si128(g ? HighNibbles(qs) : LowNibbles(qs), HighBit16(U32At(block + kHigh) >> (16 * g)));
    return Min ? q : _mm_sub_epi8(q, _mm_set1_epi8(16));
  }
#ifdef __AVX512F__
  static void Widen(const uint8_t* block, V16 w[2]) {
    const float d = HalfAt(block), m = Min ? HalfAt(block + 2) : 0.0f;
    const __m512 low = Min ? Table(d, m, 0) : Table(d, -0.0f, -16), high = Min ? Table(d, m, 16) : Table(d, -0.0f, 0);
    const __m512i qs = Quants16(block + kQs);
    const uint32_t bits = U32At(block + kHigh);
    for (int g = 0; g < 2; ++g) {
      const __m512i q = g ? _mm512_srli_epi32(qs, 4) : _mm512_and_si512(qs, _mm512_set1_epi32(0x0F));
      const __mmask16 fifth = static_cast<__mmask16>(bits >> (16 * g));
      w[g].part[0] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(q, low), fifth, q, high);
    }
  }
#else
  static void Widen(const uint8_t* block, V16 w[2]) {
    const float d = HalfAt(block), m = Min ? HalfAt(block + 2) : -0.0f;
    for (int g = 0; g < 2; ++g) w[g] = Affine16(d, Lanes(Quants(block, g), !Min), m);
  }
  static void WidenHalf(const uint8_t* block, int h, Vec w[2]) {
    const float d = HalfAt(block), m = Min ? HalfAt(block + 2) : -0.0f;
    for (int g = 0; g < 2; ++g) {
      w[g] = _mm256_fmadd_ps(_mm256_set1_ps(d), LanesHalf(Quants(block, g), h, !Min), _mm256_set1_ps(m));
    }
  }
#endif
};
struct Q5_0 : Blocks5<Q5_0, 22, false> {};
struct Q5_1 : Blocks5<Q5_1, 24, true> {};

// k-quants of 256 values, 8 sub-blocks of 32: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, (Q5_K) 32 bytes
// of fifth bits (value l of sub-block j: bit j of byte l), 128 bytes of nibbles (32 bytes per 64 values: sub-block
// 2c's low nibbles, 2c + 1's high ones)
template <typename F, int64_t Bytes, bool Fifth>
struct BlocksK : Blocks<F, 256, Bytes> {
  static constexpr int kQs = Fifth ? 48 : 16;
  static constexpr bool kWhole = true;
  // The matvec's form (limbs.h): chunk c of 64 values is sub-blocks 2c (lanes 0-7) and 2c + 1 (lanes 8-15); its
  // quants q as bytes, each lane's d * scale, and per block the mins' part, dmin * min (lanes 8-15) times the
  // limbs' `sums`
  static constexpr bool kLimbs = true, kMins = true, kOffset = false;
  static Q64 ChunkQuants(const uint8_t* block, int c) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kQs + 32 * c));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i first = _mm256_and_si256(qs, nibble), second = _mm256_and_si256(_mm256_srli_epi16(qs, 4), nibble);
    if constexpr (Fifth) {  // bit j of byte l: value l's fifth bit in sub-block j (16-bit shifts, bit 0 kept)
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
      const __m256i one = _mm256_set1_epi8(1);
      const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), one);
      const __m256i h1 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c + 1)), one);
      first = _mm256_or_si256(first, _mm256_slli_epi16(h0, 4));
      second = _mm256_or_si256(second, _mm256_slli_epi16(h1, 4));
    }
    return Quants64(first, second);
  }
#ifdef __AVX512F__
  static V16 LimbScales(const uint8_t* block) { return {{SubBlockScales16(block)}}; }
  static V16 ChunkScales(V16 scales, int c) {
    const __m512i at = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return {{_mm512_permutexvar_ps(_mm512_add_epi32(at, _mm512_set1_epi32(2 * c)), scales.part[0])}};
  }
#else
  static V16 LimbScales(const uint8_t* block) {
    float a[8], b[8];
    SubBlockScales(block, a, b);
    alignas(32) float both[16];
    for (int j = 0; j < 8; ++j) both[j] = a[j], both[8 + j] = -b[j];
    return {{_mm256_load_ps(both), _mm256_load_ps(both + 8)}};
  }
  static V16 ChunkScales(V16 scales, int c) {
    return {{_mm256_permutevar8x32_ps(scales.part[0], _mm256_set1_epi32(2 * c)),
             _mm256_permutevar8x32_ps(scales.part[0], _mm256_set1_epi32(2 * c + 1))}};
  }
#endif
  // the q of values 16t.. of sub-block j
  static __m128i Quants(const uint8_t* block, int j, int t) {
    const __m128i qs = Bytes16(block + kQs + 32 * (j / 2) + 16 * t);
    const __m128i q = j % 2 ? HighNibbles(qs) : LowNibbles(qs);
    return Fifth ? _mm_or_si128(q, HighBits(Bytes16(block + 16 + 16 * t), j, 1)) : q;
  }
#ifdef __AVX512F__
  static void Widen(const uint8_t* block, V16 w[16]) {
    alignas(64) float both[16];  // d * scale of each sub-block, then dmin * min
    _mm512_store_ps(both, SubBlockScales16(block));
    const __m512i mask = _mm512_set1_epi32(0x0F);
    for (int c = 0; c < 4; ++c) {
      for (int t = 0; t < 2; ++t) {  // bytes 16t.. of the 32: values 16t.. of sub-blocks 2c and 2c + 1
        const __m512i qs = Quants16(block + kQs + 32 * c + 16 * t);
        for (int k = 0; k < 2; ++k) {
          const int j = 2 * c + k;
          const __m512i q = k ? _mm512_srli_epi32(qs, 4) : _mm512_and_si512(qs, mask);
          __m512 v;
          if constexpr (Fifth) {  // 32 values to look up: index bit 4 picks the second table
            const __m512i qh = Quants16(block + 16 + 16 * t);
            const __m512i high =
                _mm512_and_si512(_mm512_srli_epi32(_mm512_slli_epi32(qh, 4), j), _mm512_set1_epi32(16));
            const float a = both[j], b = -both[8 + j];
            v = _mm512_permutex2var_ps(Table(a, b, 0), _mm512_or_si512(q, high), Table(a, b, 16));
          } else {  // computed (a lookup measured no faster): Table's a * q - m
            v = _mm512_fmsub_ps(_mm512_set1_ps(both[j]), _mm512_cvtepi32_ps(q), _mm512_set1_ps(both[8 + j]));
          }
          w[4 * c + 2 * k + t].part[0] = v;
        }
      }
    }
  }
#else
  static void Widen(const uint8_t* block, V16 w[16]) {
    float a[8], b[8];
    SubBlockScales(block, a, b);
    for (int j = 0; j < 8; ++j)
      for (int t = 0; t < 2; ++t) w[2 * j + t] = Affine16(a[j], Lanes(Quants(block, j, t), false), b[j]);
  }
  static void WidenHalf(const uint8_t* block, int h, Vec w[16]) {
    float a[8], b[8];
    SubBlockScales(block, a, b);
    for (int j = 0; j < 8; ++j) {
      for (int t = 0; t < 2; ++t) {
        const Vec q = LanesHalf(Quants(block, j, t), h, false);
        w[2 * j + t] = _mm256_fmadd_ps(_mm256_set1_ps(a[j]), q, _mm256_set1_ps(b[j]));
      }
    }
  }
#endif
};
struct Q4_K : BlocksK<Q4_K, 144, false> {};
struct Q5_K : BlocksK<Q5_K, 176, true> {};

// 256 values: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 values), f16 d:
// (d * scale) * (q - 32), q = nibble + 16 * high. Value 32k + l of half n (128 values): the low (k < 2) or high
// nibble of byte 64n + 32(k % 2) + l, and bits 2k, 2k + 1 of high byte 32n + l
struct Q6_K : Blocks<Q6_K, 256, 210> {
  static constexpr bool kWhole = true;
  // The matvec's form (limbs.h): chunk c of 64 values is groups 4c.. of 16 (lanes 4m..4m + 3: group 4c + m); q as
  // unsigned bytes (the limbs' `offset` takes the 32 off), each lane's d * scale
  static constexpr bool kLimbs = true, kMins = false, kOffset = true;
  static Q64 ChunkQuants(const uint8_t* block, int c) {  // values 64c..: half n = c / 2, its k = 2(c % 2), + 1
    const int n = c / 2, k = 2 * (c % 2);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * n));
    const __m256i nibble = _mm256_set1_epi8(0x0F), bits = _mm256_set1_epi8(0x30);
    __m256i q[2];
    for (int t = 0; t < 2; ++t) {  // k + t: the low (k < 2) or high nibbles of ql[64n + 32t..], qh bits 2(k + t)..
      const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * n + 32 * t));
      const __m256i low = k ? _mm256_and_si256(_mm256_srli_epi16(ql, 4), nibble) : _mm256_and_si256(ql, nibble);
      const int shift = 2 * (k + t);  // bits (shift, shift + 1) to bits 4, 5
      const __m256i high = shift <= 4 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - shift))
                                      : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift - 4));
      q[t] = _mm256_or_si256(low, _mm256_and_si256(high, bits));
    }
    return Quants64(q[0], q[1]);
  }
#ifdef __AVX512F__
  static V16 LimbScales(const uint8_t* block) {
    return {{_mm512_mul_ps(_mm512_set1_ps(HalfAt(block + 208)), Lanes(Bytes16(block + 192), true).part[0])}};
  }
  static V16 ChunkScales(V16 scales, int c) {
    const __m512i at = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return {{_mm512_permutexvar_ps(_mm512_add_epi32(at, _mm512_set1_epi32(4 * c)), scales.part[0])}};
  }
#else
  static V16 LimbScales(const uint8_t* block) {
    const V16 scales = Lanes(Bytes16(block + 192), true);
    const __m256 d = _mm256_set1_ps(HalfAt(block + 208));
    return {{_mm256_mul_ps(d, scales.part[0]), _mm256_mul_ps(d, scales.part[1])}};
  }
  static V16 ChunkScales(V16 scales, int c) {  // groups 4c.. lie in part c / 2, from lane 4(c % 2)
    const __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_set1_epi32(4 * (c % 2)));
    const __m256 part = scales.part[c / 2];
    return {{_mm256_permutevar8x32_ps(part, at),
             _mm256_permutevar8x32_ps(part, _mm256_add_epi32(at, _mm256_set1_epi32(2)))}};
  }
#endif
  static __m128i Quants(const uint8_t* block, int g) {  // q - 32 of values 16g.., signed bytes
    const int n = g / 8, k = g % 8 / 2, l = 16 * (g % 2);
    const __m128i ql = Bytes16(block + 64 * n + 32 * (k % 2) + l);
    const __m128i high = HighBits(Bytes16(block + 128 + 32 * n + l), 2 * k, 3);
    const __m128i q = _mm_or_si128(k < 2 ? LowNibbles(ql) : HighNibbles(ql), high);
    return _mm_sub_epi8(q, _mm_set1_epi8(32));
  }
  static float Scale(const uint8_t* block, float d, int g) {
    return d * static_cast<float>(static_cast<int8_t>(block[192 + g]));
  }
#ifdef __AVX512F__
  // A half's 128 quants at once, 64 bytes a register: bytes 0-31 of `low` are k = 0's (low nibbles of ql[0..31],
  // high bits 0-1), 32-63 k = 1's (ql[32..63], bits 2-3); of `high`, k = 2's and 3's (high nibbles, bits 4-5 and
  // 6-7). Lane j of `low` is group 8n + j, of `high` 8n + 4 + j, whose scale is scales[that group].
  static void Widen(const uint8_t* block, V16 w[16]) {
    const __m512 a = _mm512_mul_ps(_mm512_set1_ps(HalfAt(block + 208)), Lanes(Bytes16(block + 192), true).part[0]);
    const __m512i nibble = _mm512_set1_epi8(0x0F), bits = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi32(32);
    for (int n = 0; n < 2; ++n) {
      const __m512i ql = _mm512_loadu_si512(block + 64 * n);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * n));
      const __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi32(qh, 2), 1);
      const __m512i low = _mm512_or_si512(_mm512_and_si512(ql, nibble),
                                          _mm512_and_si512(_mm512_slli_epi32(c, 4), bits));  // (qh >> 2k & 3) << 4
      const __m512i high =
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(ql, 4), nibble), _mm512_and_si512(c, bits));
      const __m128i lanes[8] = {_mm512_castsi512_si128(low),        _mm512_extracti32x4_epi32(low, 1),
                                _mm512_extracti32x4_epi32(low, 2),  _mm512_extracti32x4_epi32(low, 3),
                                _mm512_castsi512_si128(high),       _mm512_extracti32x4_epi32(high, 1),
                                _mm512_extracti32x4_epi32(high, 2), _mm512_extracti32x4_epi32(high, 3)};
      for (int j = 0; j < 8; ++j) {
        const int g = 8 * n + j;
        const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(lanes[j]), bias));  // q - 32
        w[g].part[0] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_set1_epi32(g), a), q);
      }
    }
  }
#else
  static void Widen(const uint8_t* block, V16 w[16]) {
    const float d = HalfAt(block + 208);
    for (int g = 0; g < 16; ++g) w[g] = Affine16(Scale(block, d, g), Lanes(Quants(block, g), true), -0.0f);
  }
  static void WidenHalf(const uint8_t* block, int h, Vec w[16]) {
    const float d = HalfAt(block + 208);
    for (int g = 0; g < 16; ++g) {
      w[g] = _mm256_mul_ps(_mm256_set1_ps(Scale(block, d, g)), LanesHalf(Quants(block, g), h, true));
    }
  }
#endif
};

// Whether dims holds a stack of L matrices of H in its last dimensions ([L] and H's layout; a matrix alone: L = 1),
// any dimensions before them (a vmapped call's) all 1; its L, O and I
template <typename H>
bool MatrixStack(ffi::Span<const int64_t> dims, int64_t& layers, int64_t& o, int64_t& i) {
  if (dims.size() < H::kRank) return false;
  const size_t first = dims.size() - H::kRank;  // the matrix's first dimension
  layers = first > 0 ? dims[first - 1] : 1;
  for (size_t d = 0; d + 1 < first; ++d) {
    if (dims[d] != 1) return false;
  }
  return H::Matrix(dims, first, o, i);
}

// Whether dims holds one matrix of H in its last dimensions, any others (a vmapped call's) all 1; its O and I
template <typename H>
bool OneMatrix(ffi::Span<const int64_t> dims, int64_t& o, int64_t& i) {
  int64_t layers = 0;
  return MatrixStack<H>(dims, layers, o, i) && layers == 1;
}

}  // namespace llama_jax
