// The float32 class on AMX tiles (Intel Xeon since Sapphire Rapids): a block product x · Wᵀ, or its transpose g · W
// (the gradient with respect to x), whose weights are bf16-exact (W held as bf16) on tdpbf16ps, each activation
// split exactly into three bf16 terms.
//
// Why it is f32 class: an f32 x splits into hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid), each rounded
// to nearest, and hi + mid + lo = x exactly (24 significant bits, 8 a term; x - hi and x - hi - mid are exact in
// f32), for every x above 2^-110 in size (a smaller lo is under bf16's normal range, and the tiles treat it as 0). A
// bf16 term times a bf16 weight is exact in f32. So y = Σ_k Σ_t term_t(x_k) · w_k is a sum of exact products whose
// value is the f32 dot's: only the order and the roundings of the sums differ, about a straight f32 sum's error
// (tests/test_tiles.py against float64). The order is fixed by the inner dimension alone, whatever the rows, their
// place and the thread: batch invariance holds. It is not the FMA kernels' order: a process running the tiles gives
// other bits (in the same class) than one running avx512 or avx2 (variants.py: the "amx" variant).
//
// Rate (Intel Xeon family 6 model 167, 2 threads, 512 rows): SmolLM2-135M's and Llama-3.2-1B's shapes at 520-770
// GFLOP/s, 1.1-1.6x the f32 FMA peak (~475, benchmarks/machine.py) and 1.8-2.7x the FMA kernels' 223-310 on the same
// weights; the transposed g · W at 580-790, 2.0-3.1x. The tiles' bf16 products alone run at ~15x that peak: here each
// also waits on its operands (8 tile loads from L2 for 12 products), and x is split and W's columns packed. Under
// kPackedRows rows W is not packed at all (its rows are the A operand where they lie): 1.2-2.5x the packed form at
// 8-128 rows, and a bf16 model's 8-token logits in 0.6x the time.
//
// TileProductReference is the same arithmetic in plain C++, on every CPU, in the order Intel's pseudocode gives
// tdpbf16ps (the hardware sums in another order within a tile product: its bits differ from this, in the same
// class): what the tests check the split and the class against where no AMX exists.
//
// ggml's blocks of 32 (Q4_0, Q4_1, Q8_0: BlockQuants) take x · Wᵀ on the tiles too, as d · Σ q·x + m · Σ x per block:
// the block's integers (exact in bf16) times x's three terms, one tile product a step of 32 inputs, each step's sums
// drained and scaled in f32 by the outputs' d (and m times the rows' Σ x). Against float64 0.15-0.34x a straight f32
// sum's error of x by the dequantized weights; not the FMA kernels' bits (those multiply the dequantized f32 values).
// At 512 rows SmolLM2-135M's Q4_1 q, o, gate, up and down run 1.3-2.2x the FMA kernels (k, v 0.9x), and the default
// model's whole `logits` 1.05-1.1x faster at 8 tokens, 1.4-1.5x at 512 (RESULTS.md). BlockTileReference is their
// arithmetic in plain C++. Their transposed products (gradients) stay on the FMA units.
//
// The bfloat16 tier (nn/linear.py's `tiered`) hands the products activations already rounded to bf16: their mid and
// lo terms are zeros, so its products take one term (`terms` = 1), the same sums in a third of the tile products.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"
#include "gemm.h"

namespace llama_jax {

constexpr int64_t kTileRows = 16;  // a tile: 16 rows of 64 bytes (32 bf16 or 16 f32)
constexpr int64_t kTileDepth = 32;  // inner indices a tile product takes (16 pairs)
constexpr int kTerms = 3;           // bf16 terms of an activation (the most a product takes)

// The nearest bf16 to f (ties to even), as vcvtneps2bf16 rounds (a NaN stays a NaN)
inline uint16_t RoundBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
inline float WidenBf16(uint16_t h) { return Widen(Bf16{h}); }

// x's three terms: hi + mid + lo = x exactly (see the top)
inline void SplitThree(float x, uint16_t terms[kTerms]) {
  for (int t = 0; t < kTerms; ++t) {
    terms[t] = RoundBf16(x);
    x -= WidenBf16(terms[t]);
  }
}

// y [rows, o] = x [rows, i] · Wᵀ, W [o, i] bf16: in steps of 32 inner indices (zeros past i), each step the three
// terms in turn, each term's 16 pairs in order, each pair's even product added before its odd one, in f32
inline void TileProductReference(const uint16_t* w, const float* x, float* y, int64_t rows, int64_t o, int64_t i) {
  std::vector<uint16_t> terms(i * kTerms);  // a row of x's terms: [i][kTerms], split once for every column
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k = 0; k < i; ++k) SplitThree(x[m * i + k], &terms[k * kTerms]);
    for (int64_t n = 0; n < o; ++n) {
      float c = 0.0f;
      for (int64_t k0 = 0; k0 < i; k0 += kTileDepth) {
        for (int t = 0; t < kTerms; ++t) {
          for (int64_t k = k0; k < std::min(i, k0 + kTileDepth); ++k) {
            c += WidenBf16(terms[k * kTerms + t]) * WidenBf16(w[n * i + k]);
          }
        }
      }
      y[m * o + n] = c;
    }
  }
}

// ggml's blocks of 32 values whose products the tiles take (kOn: Q4_0, Q4_1, Q8_0): a block's weights are d · q, or
// d · q + m (kMins), with q small integers (exact in bf16) and d, m f16. So block b of x · Wᵀ is d · Σ q·x + m · Σ x
// (the accuracy rule's own form): Σ q·x a tile product of the block's integers by x's three terms, one step of 32
// inputs, then scaled in f32. Parts gives a block's integers, d and m in plain C++ (the reference's; the tiles'
// machines unpack them with AVX-512 straight into bf16).
template <typename H>
struct BlockQuants {
  static constexpr bool kOn = false;
};
template <>
struct BlockQuants<Q4_0> {  // q - 8 of nibbles (value j: byte j's low 4 bits, value j + 16: its high 4)
  static constexpr bool kOn = true, kMins = false;
  static void Parts(const uint8_t* block, int32_t q[32], float& d, float& m) {
    d = HalfAt(block), m = 0.0f;
    for (int j = 0; j < 16; ++j) q[j] = (block[2 + j] & 15) - 8, q[j + 16] = (block[2 + j] >> 4) - 8;
  }
};
template <>
struct BlockQuants<Q4_1> {  // d · q + m taken as d · (q - 8) + (m + 8 · d): centred integers, so where a block's
  // weights straddle zero d · Σ q·x and m · Σ x do not cancel (with q itself, an input whose weight is near zero
  // gave both terms its full size, and their rounding errors stayed: elements of the real model's MLP further from
  // float64 than transformers')
  static constexpr bool kOn = true, kMins = true;
  static void Parts(const uint8_t* block, int32_t q[32], float& d, float& m) {
    d = HalfAt(block), m = HalfAt(block + 2) + 8.0f * d;
    for (int j = 0; j < 16; ++j) q[j] = (block[4 + j] & 15) - 8, q[j + 16] = (block[4 + j] >> 4) - 8;
  }
};
template <>
struct BlockQuants<Q8_0> {  // int8
  static constexpr bool kOn = true, kMins = false;
  static void Parts(const uint8_t* block, int32_t q[32], float& d, float& m) {
    d = HalfAt(block), m = 0.0f;
    for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(block[2 + j]);
  }
};

constexpr int64_t kChunkSteps = 32;  // steps an output's sum takes before it is added to y (1024 inputs)

// y [rows, o] = x [rows, i] · Wᵀ for W [o, i] held as H (BlockQuants<H>::kOn): the tiles' arithmetic for blocks in
// plain C++. Per output, per chunk of kChunkSteps steps from zero: per step, each term's 32 products summed from zero
// (a tile product; the hardware sums within one in its own order), then the terms' sums added (C); the chunk's
// sum += d · C, then += m · (x's sum over the step, in order) with Q4_1's m, each a fused multiply-add; then y = the
// first chunk's sum + the next's + ...
template <typename H>
inline void BlockTileReference(const uint8_t* w, const float* x, float* y, int64_t rows, int64_t o, int64_t i) {
  using B = BlockQuants<H>;
  const int64_t steps = i / kTileDepth;
  std::vector<int32_t> q(o * i);
  std::vector<float> d(o * steps), mins(o * steps);
  for (int64_t n = 0; n < o; ++n) {
    for (int64_t s = 0; s < steps; ++s) {
      B::Parts(w + n * H::RowBytes(i) + s * H::kStepBytes, &q[n * i + s * kTileDepth], d[n * steps + s],
               mins[n * steps + s]);
    }
  }
  std::vector<uint16_t> terms(i * kTerms);
  std::vector<float> sums(steps);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t k = 0; k < i; ++k) SplitThree(x[m * i + k], &terms[k * kTerms]);
    for (int64_t s = 0; s < steps; ++s) {
      sums[s] = 0.0f;
      for (int64_t k = s * kTileDepth; k < (s + 1) * kTileDepth; ++k) sums[s] += x[m * i + k];
    }
    for (int64_t n = 0; n < o; ++n) {
      float total = 0.0f;
      for (int64_t s0 = 0; s0 < steps; s0 += kChunkSteps) {
        float chunk = 0.0f;
        for (int64_t s = s0; s < std::min(steps, s0 + kChunkSteps); ++s) {
          float c = 0.0f;
          for (int t = 0; t < kTerms; ++t) {
            float part = 0.0f;
            for (int64_t k = s * kTileDepth; k < (s + 1) * kTileDepth; ++k) {
              part += WidenBf16(terms[k * kTerms + t]) * static_cast<float>(q[n * i + k]);
            }
            c += part;
          }
          chunk = std::fma(d[n * steps + s], c, chunk);
          if constexpr (B::kMins) chunk = std::fma(mins[n * steps + s], sums[s], chunk);
        }
        total = s0 == 0 ? chunk : total + chunk;
      }
      y[m * o + n] = total;
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LLAMA_JAX_TILES 1
constexpr bool kTiles = true;

// The calling thread's tiles as the product uses them (palette 1): 0-3 the 2 x 2 accumulators of a 32 x 32 tile of
// y (16 rows x 16 f32 each), 4-5 two row halves of an activation term (16 rows x 32 bf16), 6-7 two column halves of
// W (16 pairs x 16 columns x 2 bf16)
inline void ConfigureTiles() {
  struct alignas(64) {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config;
  std::memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kTileRows;
  _tile_loadconfig(&config);
}

// x [rows, i]'s first `terms` terms packed as the tiles read them: row tile r (32 rows, zeros past the last), step s,
// term t, half h (rows 0-15, 16-31) at ((r · steps + s) · terms + t) · 2 + h, 512 bf16 each: as an A operand (g · W:
// 16 rows of x, the step's 32 bf16 each) or, as_columns, as a B operand (x · Wᵀ: 16 pairs of inner indices, each
// row's pair adjacent: the A layout's 16 x 16 dwords transposed, 8 x 8 at a time by gemm.h's Transpose8)
inline void PackTerms(const float* x, int64_t rows, int64_t i, int64_t r, int64_t steps, int terms, uint16_t* a,
                      bool as_columns) {
  alignas(64) uint16_t split[kTerms][2 * kTileRows * kTileDepth];  // as columns: a step's terms as A first
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t k0 = s * kTileDepth, n = std::min(kTileDepth, i - k0);
    const __mmask16 low = static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1);
    const __mmask16 high = static_cast<__mmask16>(n >= 32 ? 0xffff : n <= 16 ? 0 : (1u << (n - 16)) - 1);
    for (int64_t row = 0; row < 2 * kTileRows; ++row) {
      const int64_t m = r * 2 * kTileRows + row;
      __m512 v[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      if (m < rows) {
        v[0] = _mm512_maskz_loadu_ps(low, x + m * i + k0);
        v[1] = _mm512_maskz_loadu_ps(high, x + m * i + k0 + 16);
      }
      for (int t = 0; t < terms; ++t) {
        // RoundBf16 of each value: words 0-15 from v[0], 16-31 from v[1]
        const __m512i term = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);
        // as A, term t's two halves are adjacent: [32 rows][32 bf16]
        uint16_t* terms_at = as_columns ? split[t] : a + ((r * steps + s) * terms + t) * 2 * 512;
        _mm512_storeu_si512(terms_at + row * kTileDepth, term);
        const __m512i low_wide = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(term));
        const __m512i high_wide = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(term, 1));
        v[0] = _mm512_sub_ps(v[0], _mm512_castsi512_ps(_mm512_slli_epi32(low_wide, 16)));  // exact: what remains
        v[1] = _mm512_sub_ps(v[1], _mm512_castsi512_ps(_mm512_slli_epi32(high_wide, 16)));
      }
    }
    for (int t = 0; t < terms && as_columns; ++t) {
      for (int h = 0; h < 2; ++h) {
        const float* from = reinterpret_cast<const float*>(split[t] + h * kTileRows * kTileDepth);  // [16][16] dwords
        float* tile = reinterpret_cast<float*>(a + (((r * steps + s) * terms + t) * 2 + h) * 512);
        for (int q = 0; q < kTileRows; q += 8) {
          for (int c = 0; c < kTileRows; c += 8) Transpose8(from + c * 16 + q, 16, tile + q * 16 + c, 16);
        }
      }
    }
  }
}

// W's columns n0..n0+31 (zeros past o) over steps s0..s1-1, packed as the tiles read them: step s0 + s, half h at
// (s · 2 + h) · 512 bf16: 16 rows (the step's pairs) of 16 columns, each column's pair (k, k + 1) adjacent: row q
// of the tile holds dword q of each of 16 rows of W, so the packing is a transpose of W's rows read as dwords
// (8 x 8 at a time, gemm.h's Transpose8 moving their bits). `row` holds the steps of 32 rows of W (zeros past i).
inline void PackColumns(const uint16_t* w, int64_t o, int64_t i, int64_t n0, int64_t s0, int64_t s1, uint16_t* b,
                        uint16_t* row) {
  const int64_t k0 = s0 * kTileDepth, width = (s1 - s0) * kTileDepth, dwords = width / 2;
  const int64_t present = std::max<int64_t>(0, std::min(width, i - k0));
  for (int64_t c = 0; c < 2 * kTileRows; ++c) {
    uint16_t* line = row + c * width;
    const int64_t n = n0 + c < o ? present : 0;
    if (n > 0) std::memcpy(line, w + (n0 + c) * i + k0, n * sizeof(uint16_t));
    std::fill(line + n, line + width, uint16_t{0});
  }
  const uint32_t* rows32 = reinterpret_cast<const uint32_t*>(row);  // [32 columns][dwords]
  for (int64_t s = 0; s < s1 - s0; ++s) {
    for (int h = 0; h < 2; ++h) {
      float* tile = reinterpret_cast<float*>(b + (s * 2 + h) * 512);  // [16 pairs][16 columns] of dwords
      const float* from = reinterpret_cast<const float*>(rows32 + h * kTileRows * dwords + s * kTileRows);
      for (int q = 0; q < kTileRows; q += 8) {
        for (int c = 0; c < kTileRows; c += 8) Transpose8(from + c * dwords + q, dwords, tile + q * 16 + c, 16);
      }
    }
  }
}

// The transposed product's columns: B(k, n) = W[k, n] (W [inner, outputs] as the model holds it [O, I]: y = g · W),
// outputs n0..n0+31 (zeros past `outputs`) over steps s0..s1-1 (zeros past `inner`), laid out as PackColumns lays
// them: a tile row (a pair of inner indices k, k + 1) interleaves W's rows k and k + 1, 16 outputs each
inline void PackRows(const uint16_t* w, int64_t inner, int64_t outputs, int64_t n0, int64_t s0, int64_t s1,
                     uint16_t* b) {
  for (int64_t s = s0; s < s1; ++s) {
    for (int h = 0; h < 2; ++h) {
      const int64_t c0 = n0 + h * kTileRows, n = std::clamp<int64_t>(outputs - c0, 0, kTileRows);
      const __mmask16 valid = static_cast<__mmask16>(n >= 16 ? 0xffff : (1u << n) - 1);
      uint16_t* tile = b + ((s - s0) * 2 + h) * 512;
      for (int64_t q = 0; q < kTileRows; ++q) {
        const int64_t k = s * kTileDepth + 2 * q;
        const __m256i even = k < inner ? _mm256_maskz_loadu_epi16(valid, w + k * outputs + c0) : _mm256_setzero_si256();
        const __m256i odd =
            k + 1 < inner ? _mm256_maskz_loadu_epi16(valid, w + (k + 1) * outputs + c0) : _mm256_setzero_si256();
        const __m256i low = _mm256_unpacklo_epi16(even, odd), high = _mm256_unpackhi_epi16(even, odd);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + q * 32), _mm256_permute2x128_si256(low, high, 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + q * 32 + 16), _mm256_permute2x128_si256(low, high, 0x31));
      }
    }
  }
}

// GCC's tile intrinsics are inline assembly that names no memory: before a tile load of a tile's buffer just
// written, and after a tile store into one about to be read, the compiler must be told that those 1 KB are read or
// written there, or it may drop the buffer's stores as dead or move its reads above the store (measured on a branch:
// a tile load of a transposed partial sum read stale values until this came before it). Only that buffer: a
// "memory" clobber would make the compiler forget every value it holds from memory.
using TileBuffer = float[kTileRows * kTileRows];
inline void TileReads(const TileBuffer& buffer) { asm volatile("" : : "m"(buffer)); }
inline void TileWrote(TileBuffer& buffer) { asm volatile("" : "+m"(buffer)); }

// Accumulator tile `tile` (0-3) stored at `at`, rows `stride` bytes apart (the instruction takes its tile as an
// immediate)
inline void StoreAccumulator(int tile, float* at, int64_t stride) {
  switch (tile) {
    case 0:
      _tile_stored(0, at, stride);
      break;
    case 1:
      _tile_stored(1, at, stride);
      break;
    case 2:
      _tile_stored(2, at, stride);
      break;
    default:
      _tile_stored(3, at, stride);
  }
}

// Accumulator tile `tile` (0-3) loaded from `at`, rows `stride` bytes apart
inline void LoadAccumulator(int tile, const float* at, int64_t stride) {
  switch (tile) {
    case 0:
      _tile_loadd(0, at, stride);
      break;
    case 1:
      _tile_loadd(1, at, stride);
      break;
    case 2:
      _tile_loadd(2, at, stride);
      break;
    default:
      _tile_loadd(3, at, stride);
  }
}

// Accumulator tile `tile` loaded from y's rows m.., columns n.. (zeros outside [rows, cols]): a sum stored by
// StoreTile taken up again, exactly
inline void LoadTile(int tile, const float* y, int64_t rows, int64_t cols, int64_t m, int64_t n) {
  if (m + kTileRows <= rows && n + kTileRows <= cols) {
    LoadAccumulator(tile, y + m * cols + n, cols * static_cast<int64_t>(sizeof(float)));
    return;
  }
  alignas(64) float part[kTileRows * kTileRows] = {};
  for (int64_t r = 0; r < std::min(kTileRows, rows - m) && n < cols; ++r) {
    std::memcpy(part + r * kTileRows, y + (m + r) * cols + n, std::min(kTileRows, cols - n) * sizeof(float));
  }
  TileReads(part);
  LoadAccumulator(tile, part, kTileRows * sizeof(float));
}

// Accumulator tile `tile` stored to y's rows m.., columns n.. (only those inside [rows, cols])
inline void StoreTile(int tile, float* y, int64_t rows, int64_t cols, int64_t m, int64_t n) {
  if (m >= rows || n >= cols) return;
  if (m + kTileRows <= rows && n + kTileRows <= cols) {
    StoreAccumulator(tile, y + m * cols + n, cols * static_cast<int64_t>(sizeof(float)));
    return;
  }
  alignas(64) float part[kTileRows * kTileRows];
  StoreAccumulator(tile, part, kTileRows * sizeof(float));
  TileWrote(part);
  for (int64_t r = 0; r < std::min(kTileRows, rows - m); ++r) {
    std::memcpy(y + (m + r) * cols + n, part + r * kTileRows, std::min(kTileRows, cols - n) * sizeof(float));
  }
}

// Accumulator tile `tile` holding C[r][c] = y[m + c, n + r] (outputs as its rows, x · Wᵀ's), stored to y's rows
// m.., columns n.. (only those inside [rows, cols]) / taken up again from them (zeros outside), exactly
inline void StoreTileSwapped(int tile, float* y, int64_t rows, int64_t cols, int64_t m, int64_t n) {
  if (m >= rows || n >= cols) return;
  alignas(64) TileBuffer part, back;
  StoreAccumulator(tile, part, kTileRows * sizeof(float));
  TileWrote(part);
  for (int q = 0; q < kTileRows; q += 8) {
    for (int c = 0; c < kTileRows; c += 8) Transpose8(part + c * 16 + q, 16, back + q * 16 + c, 16);
  }
  for (int64_t r = 0; r < std::min(kTileRows, rows - m); ++r) {
    std::memcpy(y + (m + r) * cols + n, back + r * kTileRows, std::min(kTileRows, cols - n) * sizeof(float));
  }
}
inline void LoadTileSwapped(int tile, const float* y, int64_t rows, int64_t cols, int64_t m, int64_t n) {
  alignas(64) TileBuffer part = {}, back;
  for (int64_t r = 0; r < std::min(kTileRows, rows - m) && n < cols; ++r) {
    std::memcpy(part + r * kTileRows, y + (m + r) * cols + n, std::min(kTileRows, cols - n) * sizeof(float));
  }
  for (int q = 0; q < kTileRows; q += 8) {
    for (int c = 0; c < kTileRows; c += 8) Transpose8(part + c * 16 + q, 16, back + q * 16 + c, 16);
  }
  TileReads(back);
  LoadAccumulator(tile, back, kTileRows * sizeof(float));
}

// y [rows, o] = x [rows, i] · Wᵀ for W [o, i] held as bf16, on the pool's threads, a slab of up to kSlabRows rows
// at a time: the slab's terms (6 bytes an activation: 3 MB a slab at 1024 inputs) and W's columns in bands of up
// to kBandBytes packed once (items of a row tile, and of a column pair), then for each band items of (a group of
// 32-column pairs, a block of row tiles), each over chunks of kChunkSteps steps: for each row tile and column pair
// the chunk's products accumulated in the tiles, taken up from y and stored back between chunks (exactly: the
// sums' order is one pass over every step's). Slabs, bands, groups, blocks and chunks change which outputs are
// computed when, never an output's order.
constexpr int64_t kSlabRows = 512;  // (kChunkSteps, above: a row tile's terms 192 KB, a pair's columns 64 KB)
// W's columns packed at once: a call's buffer holds a band (SmolLM2-135M's largest matrix is 1.8 MB, Llama-3.2-1B's
// 16 MB; its LM head, 525 MB, goes in bands). Packing each item's own columns, the whole of W was packed once per
// block of rows (4 times at 512 rows): at 0.3-1.5 ms a product, the packing cost more than the tile products.
constexpr int64_t kBandBytes = 16 << 20;

// Items of (a group of 32-output pairs, a block of row tiles), about 8 a thread: 4-8 pairs a group where there are
// enough (a row tile's terms read once for 4 or more: one pair a group ran 1.4x slower at 16-18 pairs, SmolLM2-135M's
// k, v and down projections at 512 rows, 372 and 375 against 522 and 548 GFLOP/s, Intel Xeon family 6 model 167),
// fewer where the rows are few (their product reads W once: every thread a share of it)
struct TileItems {
  int64_t group, col_items, block, items;
  TileItems(int64_t pairs, int64_t row_tiles, int64_t threads) {
    const int64_t least = row_tiles >= 4 ? 4 : 1;
    group = std::min(pairs, std::clamp<int64_t>(pairs / (8 * threads), least, 8));
    col_items = (pairs + group - 1) / group;
    const int64_t row_blocks = std::clamp<int64_t>((8 * threads + col_items - 1) / col_items, 1, row_tiles);
    block = (row_tiles + row_blocks - 1) / row_blocks;
    items = col_items * ((row_tiles + block - 1) / block);
  }
};

// y [rows, o] = x [rows, i] · Wᵀ for W [o, i] held as bf16, on the pool's threads: W's rows are the tiles' A operand
// where they lie (16 rows of a step's 32 bf16, a row of W apart), so nothing of W is packed or copied and a product
// of few rows reads W once, as the FMA kernels do (packing W's columns as a B operand cost every call a transpose of
// the whole matrix: 8-token prompts paid it in full); x's terms are the B operand (PackTerms as columns), and each
// accumulator holds 16 outputs of 16 rows, transposed into y. Only where W's rows are not whole steps (i not a
// multiple of 32), or a pair's 32 rows run past o, are that pair's rows copied first, zeros after.
inline void RunForwardSlab(ffi::ThreadPool& pool, const uint16_t* w, const float* x, float* y, int64_t rows,
                           int64_t o, int64_t i, int terms) {
  const int64_t steps = (i + kTileDepth - 1) / kTileDepth, row_tiles = (rows + 2 * kTileRows - 1) / (2 * kTileRows);
  const int64_t pairs = (o + 2 * kTileRows - 1) / (2 * kTileRows), threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t terms_per_tile = steps * terms * 2 * 512, width = steps * kTileDepth;  // bf16
  uint16_t* b = reinterpret_cast<uint16_t*>(CallScratch(row_tiles * terms_per_tile / 2));
  auto packing = std::make_shared<Items>();
  packing->items = row_tiles;
  packing->run = [=](int64_t r) { PackTerms(x, rows, i, r, steps, terms, b, true); };
  RunItems(pool, packing);
  const TileItems split(pairs, row_tiles, threads);
  const int64_t chunk = std::min(kChunkSteps, steps);
  auto work = std::make_shared<Items>();
  work->items = split.items;
  work->run = [=](int64_t item) {
    const int64_t p0 = item % split.col_items * split.group, p1 = std::min(pairs, p0 + split.group);
    const int64_t t0 = item / split.col_items * split.block, t1 = std::min(row_tiles, t0 + split.block);
    // pair p's 32 rows of W: in place (a row apart), or copied (width apart, zeros past o and i)
    const auto whole = [=](int64_t p) { return i % kTileDepth == 0 && (p + 1) * 2 * kTileRows <= o; };
    uint16_t* copies = nullptr;
    if (!whole(p0) || !whole(p1 - 1)) copies = reinterpret_cast<uint16_t*>(Scratch((p1 - p0) * kTileRows * width));
    for (int64_t p = p0; p < p1; ++p) {
      if (whole(p)) continue;
      for (int64_t c = 0; c < 2 * kTileRows; ++c) {
        uint16_t* line = copies + ((p - p0) * 2 * kTileRows + c) * width;
        const int64_t n = p * 2 * kTileRows + c < o ? i : 0;
        if (n > 0) std::memcpy(line, w + (p * 2 * kTileRows + c) * i, n * sizeof(uint16_t));
        std::fill(line + n, line + width, uint16_t{0});
      }
    }
    ConfigureTiles();
    for (int64_t s0 = 0; s0 < steps; s0 += chunk) {
      const int64_t s1 = std::min(steps, s0 + chunk);
      for (int64_t r = t0; r < t1; ++r) {
        const uint16_t* packed = b + r * terms_per_tile;
        for (int64_t p = p0; p < p1; ++p) {
          const bool in_place = whole(p);
          const uint16_t* weights = in_place ? w + p * 2 * kTileRows * i : copies + (p - p0) * 2 * kTileRows * width;
          const int64_t line = in_place ? i : width;  // bf16 between two rows of W
          const int64_t m = r * 2 * kTileRows, n = p * 2 * kTileRows;
          if (s0 == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else {
            for (int tile = 0; tile < 4; ++tile) {
              LoadTileSwapped(tile, y, rows, o, m + tile % 2 * kTileRows, n + tile / 2 * kTileRows);
            }
          }
          for (int64_t s = s0; s < s1; ++s) {
            _tile_loadd(6, weights + s * kTileDepth, line * 2);
            _tile_loadd(7, weights + kTileRows * line + s * kTileDepth, line * 2);
            for (int t = 0; t < terms; ++t) {
              const uint16_t* term = packed + (s * terms + t) * 1024;
              _tile_loadd(4, term, 64);
              _tile_loadd(5, term + 512, 64);
              _tile_dpbf16ps(0, 6, 4);
              _tile_dpbf16ps(1, 6, 5);
              _tile_dpbf16ps(2, 7, 4);
              _tile_dpbf16ps(3, 7, 5);
            }
          }
          for (int tile = 0; tile < 4; ++tile) {
            StoreTileSwapped(tile, y, rows, o, m + tile % 2 * kTileRows, n + tile / 2 * kTileRows);
          }
        }
      }
    }
    _tile_release();
  };
  RunItems(pool, work);
}

// x [rows, i] times B [i, o] into y [rows, o]: B = Wᵀ for W [o, i], or (transpose) B = W for W [i, o]; each x
// as its first `terms` terms (1: x's values are bf16)
inline void RunTileSlab(ffi::ThreadPool& pool, const uint16_t* w, bool transpose, const float* x, float* y,
                        int64_t rows, int64_t o, int64_t i, int terms) {
  const int64_t steps = (i + kTileDepth - 1) / kTileDepth, row_tiles = (rows + 2 * kTileRows - 1) / (2 * kTileRows);
  const int64_t pairs = (o + 2 * kTileRows - 1) / (2 * kTileRows), threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t terms_per_tile = steps * terms * 2 * 512;  // bf16: a multiple of 32 (64 bytes)
  const int64_t pair_panel = steps * 2 * 512;             // a pair's columns over every step, bf16
  const int64_t band = std::clamp<int64_t>(kBandBytes / (2 * pair_panel), 1, pairs);
  uint16_t* a = reinterpret_cast<uint16_t*>(CallScratch((row_tiles * terms_per_tile + band * pair_panel) / 2));
  uint16_t* b = a + row_tiles * terms_per_tile;
  const int64_t chunk = std::min(kChunkSteps, steps);
  for (int64_t q0 = 0; q0 < pairs; q0 += band) {
    const int64_t q1 = std::min(pairs, q0 + band), x_items = q0 == 0 ? row_tiles : 0;
    auto packing = std::make_shared<Items>();
    packing->items = x_items + q1 - q0;
    packing->run = [=](int64_t k) {
      if (k < x_items) return PackTerms(x, rows, i, k, steps, terms, a, false);
      const int64_t p = q0 + k - x_items;
      uint16_t* columns = b + (p - q0) * pair_panel;
      if (transpose) return PackRows(w, i, o, p * 2 * kTileRows, 0, steps, columns);
      uint16_t* row = reinterpret_cast<uint16_t*>(Scratch(kTileRows * steps * kTileDepth));  // 32 rows of W
      PackColumns(w, o, i, p * 2 * kTileRows, 0, steps, columns, row);
    };
    RunItems(pool, packing);
    const TileItems split(q1 - q0, row_tiles, threads);
    auto work = std::make_shared<Items>();
    work->items = split.items;
    work->run = [=](int64_t item) {
      const int64_t p0 = q0 + item % split.col_items * split.group, p1 = std::min(q1, p0 + split.group);
      const int64_t t0 = item / split.col_items * split.block, t1 = std::min(row_tiles, t0 + split.block);
      ConfigureTiles();
      for (int64_t s0 = 0; s0 < steps; s0 += chunk) {
        const int64_t s1 = std::min(steps, s0 + chunk);
        for (int64_t r = t0; r < t1; ++r) {
          const uint16_t* packed = a + r * terms_per_tile;
          for (int64_t p = p0; p < p1; ++p) {
            const uint16_t* columns = b + (p - q0) * pair_panel;
            const int64_t m = r * 2 * kTileRows, n = p * 2 * kTileRows;
            if (s0 == 0) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
            } else {
              for (int tile = 0; tile < 4; ++tile) {
                LoadTile(tile, y, rows, o, m + tile / 2 * kTileRows, n + tile % 2 * kTileRows);
              }
            }
            for (int64_t s = s0; s < s1; ++s) {
              _tile_loadd(6, columns + s * 1024, 64);
              _tile_loadd(7, columns + s * 1024 + 512, 64);
              for (int t = 0; t < terms; ++t) {
                const uint16_t* term = packed + (s * terms + t) * 1024;
                _tile_loadd(4, term, 64);
                _tile_loadd(5, term + 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
              }
            }
            for (int tile = 0; tile < 4; ++tile) {
              StoreTile(tile, y, rows, o, m + tile / 2 * kTileRows, n + tile % 2 * kTileRows);
            }
          }
        }
      }
      _tile_release();
    };
    RunItems(pool, work);
  }
}

// A block's 32 integers as bf16 (exact: |q| <= 128) into q, from 16 int16 values each (low: values 0-15, high:
// 16-31): BlockQuants' Unpack, on the tiles' machines
inline void StoreQuants(__m256i low, __m256i high, uint16_t* q) {
  const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(low)), b = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(high));
  _mm512_storeu_si512(q, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}
template <typename H>
inline void Unpack(const uint8_t* block, uint16_t* q, float& d, float& m);
template <>
inline void Unpack<Q4_0>(const uint8_t* block, uint16_t* q, float& d, float& m) {
  d = HalfAt(block), m = 0.0f;
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2)));
  const __m256i eight = _mm256_set1_epi16(8);
  StoreQuants(_mm256_sub_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(15)), eight),
              _mm256_sub_epi16(_mm256_srli_epi16(bytes, 4), eight), q);
}
template <>
inline void Unpack<Q4_1>(const uint8_t* block, uint16_t* q, float& d, float& m) {  // centred: BlockQuants<Q4_1>
  d = HalfAt(block), m = HalfAt(block + 2) + 8.0f * d;
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4)));
  const __m256i eight = _mm256_set1_epi16(8);
  StoreQuants(_mm256_sub_epi16(_mm256_and_si256(bytes, _mm256_set1_epi16(15)), eight),
              _mm256_sub_epi16(_mm256_srli_epi16(bytes, 4), eight), q);
}
template <>
inline void Unpack<Q8_0>(const uint8_t* block, uint16_t* q, float& d, float& m) {
  d = HalfAt(block), m = 0.0f;
  StoreQuants(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2))),
              _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18))), q);
}

// Σ x over each step of 32 inputs of row tile r's 32 rows: sums[(r · steps + s) · 32 + row], in order (zeros past
// the last row and input)
inline void StepSums(const float* x, int64_t rows, int64_t i, int64_t r, int64_t steps, float* sums) {
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t row = 0; row < 2 * kTileRows; ++row) {
      const int64_t m = r * 2 * kTileRows + row;
      float total = 0.0f;
      for (int64_t k = s * kTileDepth; m < rows && k < std::min(i, (s + 1) * kTileDepth); ++k) total += x[m * i + k];
      sums[(r * steps + s) * 2 * kTileRows + row] = total;
    }
  }
}

// y [rows, o] = x [rows, i] · Wᵀ for W [o, i] held as H (BlockQuants<H>::kOn), on the pool's threads: x's terms the
// A operand (16 rows), W's integers the B operand (16 outputs), unpacked per item and chunk; each step's four
// accumulators drained and scaled by their 16 outputs' d (and m times each row's Σ x) into the chunk's sums
template <typename H>
inline void RunBlockSlab(ffi::ThreadPool& pool, const uint8_t* w, const float* x, float* y, int64_t rows, int64_t o,
                         int64_t i, int terms) {
  using T = BlockQuants<H>;
  const int64_t steps = i / kTileDepth, row_tiles = (rows + 2 * kTileRows - 1) / (2 * kTileRows);
  const int64_t pairs = (o + 2 * kTileRows - 1) / (2 * kTileRows), threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t terms_per_tile = steps * terms * 2 * 512;
  float* scratch = CallScratch(row_tiles * terms_per_tile / 2 + row_tiles * steps * 2 * kTileRows);
  uint16_t* a = reinterpret_cast<uint16_t*>(scratch);
  float* sums = scratch + row_tiles * terms_per_tile / 2;
  auto packing = std::make_shared<Items>();
  packing->items = row_tiles;
  packing->run = [=](int64_t r) {
    PackTerms(x, rows, i, r, steps, terms, a, false);
    if constexpr (T::kMins) StepSums(x, rows, i, r, steps, sums);
  };
  RunItems(pool, packing);
  const TileItems split(pairs, row_tiles, threads);
  const int64_t chunk = std::min(kChunkSteps, steps);
  auto work = std::make_shared<Items>();
  work->items = split.items;
  work->run = [=](int64_t item) {
    const int64_t p0 = item % split.col_items * split.group, p1 = std::min(pairs, p0 + split.group);
    const int64_t t0 = item / split.col_items * split.block, t1 = std::min(row_tiles, t0 + split.block);
    // a chunk's B tiles [pair][step][half][512 bf16], then its d and m [pair][step][32 outputs] f32
    const int64_t tiles_b = (p1 - p0) * chunk * 2;
    float* own = Scratch(tiles_b * 256 + 2 * (p1 - p0) * chunk * 2 * kTileRows);
    uint16_t* qb = reinterpret_cast<uint16_t*>(own);
    float* d = own + tiles_b * 256;
    float* mins = d + (p1 - p0) * chunk * 2 * kTileRows;
    alignas(64) TileBuffer drained[4];
    alignas(64) float acc[4][kTileRows * kTileRows];  // [tile][row][output]: the chunk's sums
    alignas(64) uint16_t unpacked[kTileRows * kTileDepth];  // 16 outputs' 32 integers
    ConfigureTiles();
    for (int64_t s0 = 0; s0 < steps; s0 += chunk) {
      const int64_t s1 = std::min(steps, s0 + chunk), span = s1 - s0;
      for (int64_t p = p0; p < p1; ++p) {
        for (int64_t s = s0; s < s1; ++s) {
          for (int h = 0; h < 2; ++h) {
            const int64_t at = ((p - p0) * span + s - s0) * 2 + h;
            for (int64_t e = 0; e < kTileRows; ++e) {
              const int64_t n = p * 2 * kTileRows + h * kTileRows + e;
              float& dd = d[((p - p0) * span + s - s0) * 2 * kTileRows + h * kTileRows + e];
              float& mm = mins[((p - p0) * span + s - s0) * 2 * kTileRows + h * kTileRows + e];
              if (n < o) {
                Unpack<H>(w + n * H::RowBytes(i) + s * H::kStepBytes, unpacked + e * kTileDepth, dd, mm);
              } else {
                std::fill(unpacked + e * kTileDepth, unpacked + (e + 1) * kTileDepth, uint16_t{0});
                dd = 0.0f, mm = 0.0f;
              }
            }
            // [16 outputs][16 pairs] of dwords to [16 pairs][16 outputs]: the B operand
            const float* from = reinterpret_cast<const float*>(unpacked);
            float* tile = reinterpret_cast<float*>(qb + at * 512);
            for (int q = 0; q < kTileRows; q += 8) {
              for (int c = 0; c < kTileRows; c += 8) Transpose8(from + c * 16 + q, 16, tile + q * 16 + c, 16);
            }
          }
        }
      }
      for (int64_t r = t0; r < t1; ++r) {
        const uint16_t* packed = a + r * terms_per_tile;
        const int64_t m = r * 2 * kTileRows;
        const bool lower = m + kTileRows < rows;  // the row tile's second 16 rows hold any row
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t n = p * 2 * kTileRows;
          std::memset(acc, 0, sizeof acc);
          for (int64_t s = s0; s < s1; ++s) {
            const int64_t at = ((p - p0) * span + s - s0) * 2;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(6, qb + at * 512, 64);
            _tile_loadd(7, qb + (at + 1) * 512, 64);
            for (int t = 0; t < terms; ++t) {
              const uint16_t* term = packed + (s * terms + t) * 1024;
              _tile_loadd(4, term, 64);
              _tile_dpbf16ps(0, 4, 6);
              _tile_dpbf16ps(1, 4, 7);
              if (lower) {
                _tile_loadd(5, term + 512, 64);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
              }
            }
            _tile_stored(0, drained[0], 64);
            _tile_stored(1, drained[1], 64);
            if (lower) {
              _tile_stored(2, drained[2], 64);
              _tile_stored(3, drained[3], 64);
            }
            const float* step_sums = sums + (r * steps + s) * 2 * kTileRows;
            for (int tile = 0; tile < (lower ? 4 : 2); ++tile) {
              TileWrote(drained[tile]);
              const int64_t present = std::min(kTileRows, rows - m - tile / 2 * kTileRows);  // rows past: no sums
              const int64_t scale_at = (at / 2) * 2 * kTileRows + tile % 2 * kTileRows;
              const __m512 dv = _mm512_loadu_ps(d + scale_at);
              __m512 mv = _mm512_setzero_ps();
              if constexpr (T::kMins) mv = _mm512_loadu_ps(mins + scale_at);
              for (int64_t e = 0; e < present; ++e) {
                __m512 v = _mm512_fmadd_ps(dv, _mm512_load_ps(drained[tile] + e * 16), _mm512_load_ps(acc[tile] + e * 16));
                if constexpr (T::kMins) v = _mm512_fmadd_ps(mv, _mm512_set1_ps(step_sums[tile / 2 * kTileRows + e]), v);
                _mm512_store_ps(acc[tile] + e * 16, v);
              }
            }
          }
          for (int tile = 0; tile < 4; ++tile) {  // acc[tile][e] is y's row m' + e, outputs n'..n' + 15
            const int64_t mt = m + tile / 2 * kTileRows, nt = n + tile % 2 * kTileRows;
            if (mt >= rows || nt >= o) continue;
            const __mmask16 valid = static_cast<__mmask16>(o - nt >= 16 ? 0xffff : (1u << (o - nt)) - 1);
            for (int64_t e = 0; e < std::min(kTileRows, rows - mt); ++e) {
              float* out = y + (mt + e) * o + nt;
              __m512 v = _mm512_load_ps(acc[tile] + e * 16);
              if (s0 > 0) v = _mm512_add_ps(_mm512_maskz_loadu_ps(valid, out), v);
              _mm512_mask_storeu_ps(out, valid, v);
            }
          }
        }
      }
    }
    _tile_release();
  };
  RunItems(pool, work);
}

// y [rows, n] = x [rows, k] · Wᵀ for W [n, k] held as H (BlockQuants<H>::kOn), a slab of rows at a time; bf16_x:
// x's values are bf16 (the bfloat16 tier), one term each, else three
template <typename H>
inline void RunBlockTileProduct(ffi::ThreadPool& pool, const uint8_t* w, const float* x, float* y, int64_t rows,
                                int64_t n, int64_t k, bool bf16_x) {
  for (int64_t m = 0; m < rows; m += kSlabRows) {
    RunBlockSlab<H>(pool, w, x + m * k, y + m * n, std::min(kSlabRows, rows - m), n, k, bf16_x ? 1 : kTerms);
  }
}

// Slabs of at least this many rows take x · Wᵀ with W's columns packed as the B operand (RunTileSlab), fewer with
// W's rows as the A operand where they lie (RunForwardSlab): packing W costs a pass over it each call, which only
// many row tiles repay. Both give the same bits (a tile product's sum for an output is the same function of its
// pairs whichever operand holds W: measured, tests/test_tiles.py), so the choice keeps batch invariance. Measured
// (Intel Xeon family 6 model 167, 2 threads, benchmarks/product_rate.py --held bf16, GFLOP/s of SmolLM2-135M's and
// Llama-3.2-1B's matrices, packed / in place): 32 rows 178-257 / 308-371 and 155-245 / 241-619; 64 rows 158-242 /
// 169-374; 128 rows mixed (291-456 / 234-462) and 362-531 / 410-653; 256 rows even; 512 rows 244-664 / 228-581 and
// 539-676 / 509-573.
constexpr int64_t kPackedRows = 256;

// y [rows, n] = x [rows, k] times B: Wᵀ for W [n, k], or (transpose, the gradient of x · Wᵀ) W for W [k, n];
// bf16_x: x's values are bf16 (the bfloat16 tier), one term each, else three
inline void RunTileProduct(ffi::ThreadPool& pool, const uint16_t* w, bool transpose, const float* x, float* y,
                           int64_t rows, int64_t n, int64_t k, bool bf16_x) {
  if (rows == 0 || n == 0) return;
  if (k == 0) {
    std::fill(y, y + rows * n, 0.0f);
    return;
  }
  const int terms = bf16_x ? 1 : kTerms;
  for (int64_t m = 0; m < rows; m += kSlabRows) {
    const int64_t slab = std::min(kSlabRows, rows - m);
    if (!transpose && slab < kPackedRows) {
      RunForwardSlab(pool, w, x + m * k, y + m * n, slab, n, k, terms);
    } else {
      RunTileSlab(pool, w, transpose, x + m * k, y + m * n, slab, n, k, terms);
    }
  }
}
#else
#define LLAMA_JAX_TILES 0
constexpr bool kTiles = false;
#endif

// Whether this process may use the tiles: Linux grants their state on request (arch_prctl ARCH_REQ_XCOMP_PERM,
// 0x1023, for XFEATURE_XTILEDATA, 18), once per process, before any thread runs a tile instruction. Always false in
// a library built without them.
inline bool RequestTiles() {
#if defined(__AMX_TILE__)
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
  return false;
#endif
}

}  // namespace llama_jax
