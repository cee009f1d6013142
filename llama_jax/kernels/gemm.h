// The pieces of a register-blocked matrix product (as BLIS and MKL build theirs), shared by the block products
// (products.cc) and attention (attention.cc: a block's, and a decode step's softmax): how a matrix's values are read
// (HeldRows, from held.h), the packing of its columns into panels (Pack), the kMR x kNR microkernel (Micro), and
// the exp of a softmax (ExpNonPositive, the same operations lane for lane on both instruction sets) with its
// online sum (Exponentials).
//
// A product y = x · B runs over chunks of at most kKC inner indices; per chunk, B's columns are widened into panels
// of kNR columns (one inner index's kNR values adjacent: two registers), and the microkernel broadcasts one x per
// row and fused-multiply-adds it into the row's accumulators. Every y[m, n] is therefore, chunk by chunk, p_c = its
// products fused-multiply-added from zero in ascending order, then y = p_0, y = y + p_1, ...: an order fixed by the
// inner dimension alone, whatever the rows, a row's place, the thread and the instruction set (AVX-512 and AVX2
// give the same bits).
#pragma once

#include <array>
#include <utility>

#include "common.h"
#include "held.h"
#include "simd.h"

namespace llama_jax {

#ifdef __AVX512F__
constexpr int kMR = 12;  // rows of the microkernel: 2 x kMR accumulators of the 32 (AVX-512) or 16 (AVX2) registers
#else
constexpr int kMR = 6;
#endif
constexpr int64_t kNR = 2 * kLanes;  // columns of a panel: two registers
constexpr int64_t kKC = 192;         // inner indices per chunk (a multiple of 32: whole blocks)

// A matrix W [O, I] held as H (held.h), `cols` = I: Read gives row o's values i0..i0+n-1 in f32
template <typename H>
struct HeldRows {
  const uint8_t* w;
  int64_t cols;
  void Read(int64_t o, int64_t i0, int64_t n, float* out) const { H::Read(w + o * H::RowBytes(cols), i0, n, out); }
  // asks for the bytes of row o's values i0..i0+n-1 (their whole blocks) to be brought into cache (L1, or with
  // kHint _MM_HINT_T1 L2): a hint, never a fault (a row past the last included); the address as an integer, no
  // pointer past the array
  template <int kHint = _MM_HINT_T0>
  void Prefetch(int64_t o, int64_t i0, int64_t n) const {
    const uintptr_t row = reinterpret_cast<uintptr_t>(w) + o * H::RowBytes(cols);
    const int64_t first = i0 - i0 % H::kValues;
    const int64_t last = std::min(cols, (i0 + n + H::kValues - 1) / H::kValues * H::kValues);
    for (int64_t at = H::RowBytes(first); at < H::RowBytes(last); at += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(row + at), static_cast<_mm_hint>(kHint));
    }
  }
};

// out[k * ldo + j] = in[j * ldi + k] for j, k < 8: an 8 x 8 block transposed in 256-bit registers (24 shuffles
// for 64 values, where a scalar copy takes a load and a store each; the same on both instruction sets)
inline void Transpose8(const float* in, int64_t ldi, float* out, int64_t ldo) {
  __m256 r[8], t[8], s[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(in + j * ldi);
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);      // r_j[0] r_j+1[0] r_j[1] r_j+1[1] | the same of [4], [5]
    t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);  // [2], [3] | [6], [7]
  }
  for (int j = 0; j < 8; j += 4) {
    s[j] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));      // rows j..j+3 at [0] | at [4]
    s[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));  // at [1] | [5]
    s[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));  // at [2] | [6]
    s[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));  // at [3] | [7]
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(out + k * ldo, _mm256_permute2f128_ps(s[k], s[k + 4], 0x20));
    _mm256_storeu_ps(out + (k + 4) * ldo, _mm256_permute2f128_ps(s[k], s[k + 4], 0x31));
  }
}

// The panel of columns n0..n0+cols-1 (cols <= kNR; zeros after) over inner indices k0..k0+kc-1:
// panel[k * kNR + j] = B(k0 + k, n0 + j), where B(k, n) = W[n, k] (x · Wᵀ) or W[k, n] (transpose)
template <typename Rows>
inline void Pack(const Rows& w, bool transpose, int64_t n0, int64_t cols, int64_t k0, int64_t kc, float* panel,
          float* scratch) {
  if (transpose) {  // inner index k is row k of W: its columns n0.. are adjacent
    for (int64_t k = 0; k < kc; ++k) {
      w.Read(k0 + k, n0, cols, panel + k * kNR);
      std::fill(panel + k * kNR + cols, panel + (k + 1) * kNR, 0.0f);
    }
    return;
  }
  for (int64_t j = 0; j < cols; ++j) {  // [cols, kc]: rows of W, the next panel's asked for meanwhile: its short
    // row pieces from memory (a layer read in place, not a copy XLA has just streamed into cache) measured ~5% of
    // SmolLM2-135M's prefill without
    w.Prefetch(n0 + kNR + j, k0, kc);
    w.Read(n0 + j, k0, kc, scratch + j * kc);
  }
  // the rows' values transposed into the panel, 8 x 8 at a time (Pack measured 40% of the microkernel's time in
  // products of 128 rows, lm-eval's, with a value copied at a time), the rest one at a time
  const int64_t k8 = kc - kc % 8, j8 = cols - cols % 8;
  for (int64_t k = 0; k < k8; k += 8)
    for (int64_t j = 0; j < j8; j += 8) Transpose8(scratch + j * kc + k, kc, panel + k * kNR + j, kNR);
  for (int64_t k = 0; k < kc; ++k) {
    float* line = panel + k * kNR;
    for (int64_t j = k < k8 ? j8 : 0; j < cols; ++j) line[j] = scratch[j * kc + k];
    std::fill(line + cols, line + kNR, 0.0f);
  }
}

// One row's two accumulators of a microkernel's tile written to y (or added to it), cols valid columns
__attribute__((always_inline)) inline void CloseRow(Vec low, Vec high, float* out, int64_t cols, bool add) {
  if (cols == kNR) {
    if (add) {
      low = VAdd(VLoadU(out), low);
      high = VAdd(VLoadU(out + kLanes), high);
    }
    VStoreU(out, low);
    VStoreU(out + kLanes, high);
    return;
  }
  alignas(64) float part[kNR];
  VStoreU(part, low);
  VStoreU(part + kLanes, high);
  for (int64_t j = 0; j < cols; ++j) out[j] = add ? out[j] + part[j] : part[j];
}

// MR rows of x (row stride ldx, at the chunk's first inner index) against one panel (inner index k's kNR values at
// panel + k · ldp: a packed panel's ldp is kNR): the chunk's partial sums, written to y (the first chunk) or added
// to it (row stride ldy; cols valid columns). The rows' accumulators are named by constants alone (the closing rows
// by a fold), so they stay registers: a loop over them kept them in a stack array, 48 more stores and 24 loads a
// call.
template <int MR, size_t... R>
inline void MicroRows(const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t kc, float* y,
                      int64_t ldy, int64_t cols, bool add, std::index_sequence<R...>) {
  Vec acc[MR][2] = {};
  for (int64_t k = 0; k < kc; ++k) {
    const Vec b0 = VLoadU(panel + k * ldp), b1 = VLoadU(panel + k * ldp + kLanes);
    for (int r = 0; r < MR; ++r) {
      const Vec a = VSet(x[r * ldx + k]);
      acc[r][0] = VFma(a, b0, acc[r][0]);
      acc[r][1] = VFma(a, b1, acc[r][1]);
    }
  }
  (CloseRow(acc[R][0], acc[R][1], y + static_cast<int64_t>(R) * ldy, cols, add), ...);
}
template <int MR>
inline void Micro(const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t kc, float* y, int64_t ldy,
                  int64_t cols, bool add) {
  MicroRows<MR>(x, ldx, panel, ldp, kc, y, ldy, cols, add, std::make_index_sequence<MR>());
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, int64_t, bool);
template <size_t... R>
constexpr std::array<MicroFn, sizeof...(R)> MicroTable(std::index_sequence<R...>) {
  return {&Micro<static_cast<int>(R) + 1>...};
}
constexpr auto kMicro = MicroTable(std::make_index_sequence<kMR>());  // kMicro[r - 1]: r rows

// `buffer` grown to hold `floats` from a 64-byte boundary, and that boundary
inline float* Aligned(std::vector<float>& buffer, int64_t floats) {
  if (static_cast<int64_t>(buffer.size()) < floats + 16) buffer.resize(floats + 16);
  const auto at = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((at + 63) / 64 * 64);
}

// A thread's panels (and the forward pack's scratch rows), kept for its next items
inline float* Scratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  return Aligned(buffer, floats);
}

// A call's own buffer, shared by its items: the calling thread's, kept for its next calls (fresh pages each call
// would cost more than packing into them saves at a few hundred positions)
inline float* CallScratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  return Aligned(buffer, floats);
}

#ifdef __AVX512F__
// p · 2^n, where `shifted`'s low bits hold n + 127 (ExpNonPositive's), n in [-126, 0]; 0 where x < -87.3
inline Vec ScaleUnlessUnder(Vec p, Vec shifted, Vec x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, VSet(-87.3f), _CMP_LT_OQ);
  const __m512i bits = _mm512_slli_epi32(_mm512_castps_si512(shifted), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, _mm512_castsi512_ps(bits));
}
#else
inline Vec ScaleUnlessUnder(Vec p, Vec shifted, Vec x) {
  const __m256i bits = _mm256_slli_epi32(_mm256_castps_si256(shifted), 23);
  return _mm256_andnot_ps(_mm256_cmp_ps(x, VSet(-87.3f), _CMP_LT_OQ), _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif

// exp(x) for x <= 0 (a score minus its row's maximum: attention's softmax, scoring's): x = n ln 2 + r, n the integer
// nearest x · log2(e) (x · log2(e) + 1.5 · 2^23 + 127 in one rounding: its low bits are n + 127, 2^n's exponent),
// r = x - n ln 2 with ln 2 in two parts (Cephes'), |r| <= ln 2 / 2, exp(r) = 1 + r · q(r) with q of degree 5 fitted
// for the least relative error (2e-9), times 2^n; 0 below -87.3 (under f32's normal range) and for -inf. Within
// 1.05 ulp of the true value (every f32 x in [-87.3, 0] against float64); the same operations lane for lane with
// AVX-512 and AVX2. (Cephes' expf, a degree-7 polynomial and a rounding instruction, took 19 zmm operations to
// these 14: with the sum below, Exponentials went from 28.5 to 23 cycles per 16 scores on a Zen 4.)
inline Vec ExpNonPositive(Vec x) {
  const Vec magic = VSet(12583039.0f);  // 1.5 · 2^23 + 127
  const Vec shifted = VFma(x, VSet(1.44269504088896341f), magic);
  const Vec n = VSub(shifted, magic);
  Vec r = VFma(n, VSet(-0.693359375f), x);
  r = VFma(n, VSet(2.12194440e-4f), r);
  Vec p = VSet(1.3843642082065344e-3f);
  for (const float c : {8.374162018299103e-3f, 4.166800156235695e-2f, 1.6666431725025177e-1f, 4.999999403953552e-1f,
                        1.0f, 1.0f}) {
    p = VFma(p, r, VSet(c));
  }
  return ScaleUnlessUnder(p, shifted, x);
}

// 16 double lanes (one per slot lane: two zmm or four ymm), each adding floats in order: the same bits on both
// instruction sets; their sum by a fixed tree (lane l + lane l + 8, then + 4, + 2, + 1), the same on both
struct Doubles16 {
#ifdef __AVX512F__
  __m512d part[2];
#else
  __m256d part[4];
#endif
};
inline Doubles16 ZeroDoubles16() {
  Doubles16 d;
#ifdef __AVX512F__
  for (auto& p : d.part) p = _mm512_setzero_pd();
#else
  for (auto& p : d.part) p = _mm256_setzero_pd();
#endif
  return d;
}
// lane l += v's lane l, widened exactly; from the registers (a half read back from the row just stored missed the
// store's forwarding: 15% of block attention's own time at 512 positions, Zen 4)
inline Doubles16 AddDoubles16(Doubles16 d, V16 v) {
#ifdef __AVX512F__
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v.part[0]), 1));
  d.part[0] = _mm512_add_pd(d.part[0], _mm512_cvtps_pd(_mm512_castps512_ps256(v.part[0])));
  d.part[1] = _mm512_add_pd(d.part[1], _mm512_cvtps_pd(high));
#else
  for (int k = 0; k < 4; ++k) {
    const __m128 quarter = k % 2 ? _mm256_extractf128_ps(v.part[k / 2], 1) : _mm256_castps256_ps128(v.part[k / 2]);
    d.part[k] = _mm256_add_pd(d.part[k], _mm256_cvtps_pd(quarter));
  }
#endif
  return d;
}
inline double SumDoubles16(Doubles16 d) {
#ifdef __AVX512F__
  const __m512d eight = _mm512_add_pd(d.part[0], d.part[1]);  // lane l + lane l + 8
  const __m256d four = _mm256_add_pd(_mm512_castpd512_pd256(eight), _mm512_extractf64x4_pd(eight, 1));
#else
  const __m256d four = _mm256_add_pd(_mm256_add_pd(d.part[0], d.part[2]), _mm256_add_pd(d.part[1], d.part[3]));
#endif
  const __m128d two = _mm_add_pd(_mm256_castpd256_pd128(four), _mm256_extractf128_pd(four, 1));
  return _mm_cvtsd_f64(_mm_add_sd(two, _mm_unpackhi_pd(two, two)));
}

// One row's scores over a chunk's slots [0, n) (block attention's chunk, a decode step's piece) into
// exp(score · scale - its new running maximum), in place, and exactly 0 outside [lo, hi) (before the row's first
// slot, past its own position) and on to the next 16; the row's running maximum and sum updated, and the factor its
// output is to be multiplied by returned: the row's softmax, online. The sum is nearly exact, in f32 lanes without
// widening each value: slot s in lane s mod 16, each value split into its part on a grid of 2^-16 (the value plus
// 1.5 · 2^7, less it: both exact) and the rest (exact, below 2^-17); a lane's grid parts add exactly (at most 256 of
// them, n <= 4096: 24 bits hold their sum), its rests with an error below 2^-33 at n <= 256, against a row's sum
// >= 1 (its largest score gives exp(0) = 1). Both then widen to double, and the lanes add by SumDoubles16's tree.
// (A double sum of every value took 5 of its exponential pass's 19 cycles per 16 scores on a Zen 4.)
inline float Exponentials(float* row, int64_t lo, int64_t hi, int64_t n, float scale, float& top, double& total) {
  const int64_t width = (n + 15) / 16 * 16;
  if (lo >= hi) {  // no slot of the row here: nothing added, nothing rescaled
    std::fill(row, row + width, 0.0f);
    return 1.0f;
  }
  std::fill(row, row + lo, -INFINITY);  // scale · -inf is -inf, and exp(-inf) is 0 (ExpNonPositive's underflow)
  std::fill(row + hi, row + width, -INFINITY);
  V16 high = Splat16(-INFINITY);
  for (int64_t s = 0; s < width; s += 16) {
    const V16 v = Load16(row + s);
    for (int k = 0; k < kParts; ++k) high.part[k] = VMax(high.part[k], v.part[k]);
  }
  alignas(64) float lanes[16];
  Store16(lanes, high);
  // the largest scaled score: a product rounded to f32 never decreases as the score grows (scale > 0), so it is the
  // scaled largest score, exactly (any order)
  const float new_top = std::max(top, *std::max_element(lanes, lanes + 16) * scale);
  alignas(64) float factor[kLanes] = {1.0f};  // exp(top - new_top): 0 at the row's first chunk (top = -inf)
  if (new_top != top) {
    factor[0] = top - new_top;
    VStoreU(factor, ExpNonPositive(VLoadU(factor)));
  }
  top = new_top;
  const Vec scales = VSet(scale), minus_top = VSet(-top), grid = VSet(192.0f);
  V16 on_grid = Zero16(), rest = Zero16();
  for (int64_t s = 0; s < width; s += 16) {
    V16 v = Load16(row + s);
    for (int k = 0; k < kParts; ++k) {
      v.part[k] = ExpNonPositive(VAdd(VMul(v.part[k], scales), minus_top));
      const Vec rounded = VSub(VAdd(v.part[k], grid), grid);
      on_grid.part[k] = VAdd(on_grid.part[k], rounded);
      rest.part[k] = VAdd(rest.part[k], VSub(v.part[k], rounded));
    }
    Store16(row + s, v);
  }
  total = total * factor[0] + SumDoubles16(AddDoubles16(AddDoubles16(ZeroDoubles16(), on_grid), rest));
  return factor[0];
}

}  // namespace llama_jax
