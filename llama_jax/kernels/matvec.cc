// The matrix-vector product, called from jitted code through XLA's FFI: a decode step's products (one new position
// per sequence: its layers' matrices and the LM head) and the LM head of prefill's last position.
//
// Matvec: y[b, o] = sum_i W[layer, o, i] * x[b, i], read straight from the stacked weights (no copy of the
// layer's slice, which XLA makes for a dynamic slice), each row of W read once for up to kMaxBatch sequences; one
// call multiplies x by one matrix or by several of a layer (q, k, v; gate, up), their rows one pool of work.
// The weights as the model holds them (held.h): f32, bf16 or f16 (widened in registers), or ggml's blocks of
// 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), each block widened in registers to exactly the f32 values the loader's
// dequantization gives (ggml's order of operations, held.h): activations and sums stay f32, so a product on those
// is bit for bit the f32 kernel's product on their dequantized copy. The k-quants of 256 (Q4_K, Q5_K, Q6_K, H::kLimbs)
// cost more to widen than to read, so their quants multiply int8 limbs of x instead, exactly (limbs.h: f32 class,
// never llama.cpp's 8-bit activations).
//
// Two contracts:
// - Batch invariance: every y[b, o] is summed in one order whatever the batch, the sequence's place in it and
//   the instruction set (the limb types' order: LimbTile): 16 lanes, lane l fused-multiply-adding w[i] · x[i]
//   for i = l mod 16, i ascending; lane l + 8 added to lane l, the 8 sums added in one fixed tree; then the tail
//   i >= in - in % 16 in order. With AVX-512 the 16 lanes are one register, with AVX2 two (the same operations on
//   each lane: the same bits).
//   Tiles of several rows or sequences (for instruction-level parallelism) change which outputs run side by
//   side, never an output's order.
// - Threads: the work is cut into items (a block of rows for up to kMaxBatch sequences) that the calling thread
//   and any pool workers claim from one atomic counter. The caller never waits for a task that has not started
//   (XLA's pool may have one thread, or be busy with other programs): it only waits for items that a running
//   worker has claimed. A task that starts after the call has returned finds no item left and touches nothing.
#include "common.h"
#include "handlers.h"
#include "held.h"
#include "simd.h"

namespace llama_jax {
namespace {  // this file's own

constexpr int64_t kMaxBatch = 8;  // sequences per pass over the rows; more take another item

// The speed parameters of a matrix-vector product (kernels/tuning.py chooses them per CPU and passes them as the
// handler's attributes). None changes a result's bits: they choose which outputs run side by side, on which thread,
// and what is asked for from memory ahead, never an output's order of operations (the contract above).
// - ahead_small, ahead_large: a block row's bytes this far past where it is being read are asked for (a hint:
//   never a fault, past the end included), for matrices under and over 2 MB. With the hardware prefetchers alone
//   the block kernels read memory at ~19 GB/s of a Zen 5's ~45 (2 threads); 16 KB ahead gave SmolLM2-1.7B's
//   matrices 29-35 GB/s, but a thread's items of a matrix under 2 MB (SmolLM2-135M's, but its head) are 25-150 KB,
//   and 16 KB ahead wastes much of an item's reads on the next item's rows: those take 4 KB (Zen 5, issue 18).
//   The element types' rows (f32, bf16) stream well without it. The bytes go to L2, not L1: on a Zen 4 the Q8_0
//   head (49152 x 576, batch 1) took 1.9-2.3 ms with its lines asked for into L1 and 1.0-1.3 ms into L2, and a
//   SmolLM2-135M token 118-143 -> 152-174 tok/s (a line asked for into L1 holds one of its few miss buffers).
// - split_bytes: 5-8 sequences (blocks of 32) whose x takes more bytes than this run as two passes, sequences 0-3
//   and then the rest (each block widened twice: over each tile of 4 rows with AVX-512, over the item's rows with
//   AVX2), or with AVX2 a matrix of blocks as segments of its inputs whose x takes no more (RowsSegmented); else as
//   one pass of 1 row x 8.
// - items_per_thread: the rows are cut into about this many items per thread (load balance against the cost of
//   claiming an item), at least 32 rows each.
struct Tuning {
  int64_t ahead_small, ahead_large, split_bytes, items_per_thread;
  int64_t Ahead(int64_t matrix_bytes) const { return matrix_bytes < (int64_t{2} << 20) ? ahead_small : ahead_large; }
};
inline void Prefetch(const uint8_t* at, int64_t ahead) {  // the address as an integer: no pointer past its array
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(at) + ahead), _MM_HINT_T1);
}

// The lanes a pass of a tile accumulates: all 16 of the summation order (V16), or with AVX2 half h of them, lanes
// 8h..8h+7 of each 16 (Vec): Step<H> widens a step of a row of H into them, Load reads x's
struct AllLanes {
  using V = V16;
  bool First() const { return true; }  // the pass that asks for the rows' bytes ahead
  V Zero() const { return Zero16(); }
  V Fma(V a, V b, V c) const { return Fma16(a, b, c); }
  V Load(const float* p) const { return Load16(p); }
  template <typename H>
  void Step(const uint8_t* at, V* w) const { H::Step(at, w); }
};
#ifndef __AVX512F__
struct HalfLanes {
  using V = Vec;
  int h;
  bool First() const { return h == 0; }
  V Zero() const { return VZero(); }
  V Fma(V a, V b, V c) const { return VFma(a, b, c); }
  V Load(const float* p) const { return VLoadU(p + 8 * h); }
  template <typename H>
  void Step(const uint8_t* at, V* w) const { H::StepHalf(at, h, w); }
};
#endif

// The lanes of rows [o, o + NR) of w (a layer of H, [O, I]) against NB sequences of x ([NB, I], row stride `in`),
// over inputs i0..i1-1 (whole steps), into acc, from zero or (resume) from acc's lanes over the inputs before i0:
// each step of the rows widened once for the NB sequences; NR and NB are template arguments so that the NR x NB
// accumulators stay in registers
template <typename H, int NR, int NB, typename P>
inline void Pass(P lanes, const uint8_t* w, const float* x, int64_t in, int64_t o, int64_t i0, int64_t i1,
                 int64_t ahead, typename P::V acc[NR][NB], bool resume = false) {
  constexpr int kGroups = H::kStep / 16;  // the step's groups of 16 values
  const int64_t row_bytes = H::RowBytes(in);
  typename P::V sum[NR][NB];  // the accumulators, local: written to acc once at the end (GCC kept acc's in memory,
  // with AVX2 8 stores of 256 bits at every step of a batch-8 pass)
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < NB; ++b) sum[r][b] = resume ? acc[r][b] : lanes.Zero();
  for (int64_t i = i0, at = i0 / H::kStep * H::kStepBytes; i < i1; i += H::kStep, at += H::kStepBytes) {
    for (int r = 0; r < NR; ++r) {
      const uint8_t* step = w + (o + r) * row_bytes + at;
      if constexpr (H::kPrefetched && H::kStepBytes <= 64) {
        if (lanes.First()) Prefetch(step, ahead);
      } else if constexpr (H::kPrefetched) {  // every cache line of a k-quant's block (it spans up to 4)
        if (lanes.First()) {
          for (int64_t line = 0; line < H::kStepBytes; line += 64) Prefetch(step + line, ahead);
        }
      }
      typename P::V wv[kGroups];
      lanes.template Step<H>(step, wv);
      for (int g = 0; g < kGroups; ++g)
        for (int b = 0; b < NB; ++b) sum[r][b] = lanes.Fma(wv[g], lanes.Load(x + b * in + i + 16 * g), sum[r][b]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = sum[r][b];
}

// y of rows [o, o + NR) from their lanes over the whole steps: their fixed sum, then (elements) the tail in order
template <typename H, int NR, int NB>
inline void Finish(const uint8_t* w, const float* x, float* y, int64_t out, int64_t in, int64_t o,
                   const V16 acc[NR][NB]) {
  for (int r = 0; r < NR; ++r) {
    const uint8_t* row = w + (o + r) * H::RowBytes(in);
    for (int b = 0; b < NB; ++b) {
      float sum = Sum16(acc[r][b]);
      if constexpr (H::kValues == 1) {  // elements: the tail past the last whole step, in order
        for (int64_t j = in - in % H::kStep; j < in; ++j) sum += H::Value(row, j) * x[b * in + j];
      }
      y[b * out + o + r] = sum;
    }
  }
}

// rows [o, o + NR) of w against NB sequences of x into y (row stride `out`), in the order of the contract: the 16
// lanes over the inputs up to the last whole step, their fixed sum, then (elements) the tail in order. With AVX2 a
// tile of more than 4 outputs (its V16 accumulators would not fit in the 16 ymm registers) runs as two passes,
// lanes 0-7 of each 16 and then lanes 8-15 (the rows read again from L1), 8 ymm accumulators a pass: the same sums
template <typename H, int NR, int NB>
inline void Tile(const uint8_t* w, const float* x, float* y, int64_t out, int64_t in, int64_t o, int64_t ahead) {
  const int64_t vec = in - in % H::kStep;
  V16 acc[NR][NB];
#ifndef __AVX512F__
  if constexpr (NR * NB > 4) {
    Vec lanes[2][NR][NB];
    for (int h = 0; h < 2; ++h) Pass<H, NR, NB>(HalfLanes{h}, w, x, in, o, 0, vec, ahead, lanes[h]);
    for (int r = 0; r < NR; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = {{lanes[0][r][b], lanes[1][r][b]}};
  } else
#endif
  {
    Pass<H, NR, NB>(AllLanes{}, w, x, in, o, 0, vec, ahead, acc);
  }
  Finish<H, NR, NB>(w, x, y, out, in, o, acc);
}

#ifndef __AVX512F__
// (AVX2) rows [o0, o1) against NB sequences (5-8) whose x is over split_bytes: the inputs in as few segments of
// whole steps as keep the NB sequences' x of a segment within split_bytes (in L1 while its rows are read), a group
// of kKept rows at a time, one row of NB in two half passes per segment, the row's lanes kept between segments (in
// memory: the same sums, in the same order). Every step is widened once per half, as when x fits.
template <typename H, int NB>
void RowsSegmented(const uint8_t* w, const float* x, float* y, int64_t out, int64_t in, int64_t o0, int64_t o1,
                   int64_t ahead, int64_t split_bytes) {
  constexpr int64_t kKept = 8;  // rows whose lanes wait between segments: 8 x 2 x NB registers, 4 KB at batch 8
  const int64_t steps = in / H::kStep, step_bytes = NB * H::kStep * int64_t{sizeof(float)};
  const int64_t fits = std::max<int64_t>(1, split_bytes);
  const int64_t segments = std::max<int64_t>(1, (steps * step_bytes + fits - 1) / fits);
  const int64_t per = (steps + segments - 1) / segments;  // steps per segment
  Vec lanes[kKept][2][1][NB];
  for (int64_t g = o0; g < o1; g += kKept) {
    const int64_t rows = std::min(kKept, o1 - g);
    for (int64_t s = 0; s < steps; s += per) {
      const int64_t i0 = s * H::kStep, i1 = std::min(steps, s + per) * H::kStep;
      for (int64_t r = 0; r < rows; ++r) {
        for (int h = 0; h < 2; ++h) {
          Pass<H, 1, NB>(HalfLanes{h}, w, x, in, g + r, i0, i1, ahead, lanes[r][h], s > 0);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      V16 acc[1][NB];
      for (int b = 0; b < NB; ++b) acc[0][b] = {{lanes[r][0][0][b], lanes[r][1][0][b]}};
      Finish<H, 1, NB>(w, x, y, out, in, g + r, acc);
    }
  }
}
#endif

// rows [o0, o1) of w (a layer of H) against NB sequences: tiles of NR rows, the last rows one at a time.
// - AVX-512 (32 registers): tiles of 4 rows for up to 4 sequences (up to 16 accumulators), of 1 row for 5-8; or,
//   where 5-8 sequences' x is over tuning.split_bytes (the L1 data cache's size: tuning.py), two passes over each
//   tile of 4 rows, sequences 0-3 and then the rest, the second pass reading the rows again from L1. Batch 8 of
//   Q4_1: Zen 5, 2048 inputs, 11.3 cycles a block in two passes against 17 in one; Zen 4, 1536 inputs, 116 µs a
//   matrix against 169; with x in L1 widening twice costs 2-10%. The k-quants' blocks of 256 cost several times as
//   much to widen (their sub-block scales) and widen once: one pass of 1 row x 8 (Zen 5, 8192 x 2048, batch 8:
//   Q4_K 3.76 -> 1.43 ms, Q6_K 6.64 -> 2.12 ms).
// - AVX2 (16 registers): NR x NB <= 8 outputs, a tile of more than 4 as two half passes (see Tile). Where 5-8
//   sequences' x is over tuning.split_bytes: blocks run in segments of the inputs (RowsSegmented: each block
//   widened once a half, as when x fits), elements as sequences 0-3 over all the rows, then the rest (the rows
//   read again from L2, each x in L1 while it is read). Zen 3 (32 KB L1), 576 x 1536 matrices, batch 8 (x 48 KB),
//   one pass against two passes of sequences: Q4_1 329 -> 210 µs, Q8_0 314 -> 169, f32 404 -> 257, bf16 344 -> 182;
//   then segments against the two passes (30 layers, min of 10 alternating rounds): Q4_0 184 -> 147, Q4_1 195 ->
//   155, Q5_0 318 -> 198, Q5_1 323 -> 203, Q8_0 182 -> 166 (batch 6: Q4_1 160 -> 117; 300 x 2592, batch 8: Q4_1
//   169 -> 125), while f32, bf16 and f16 were even or slower (bf16 195 -> 226).
template <typename H, int NB>
void RowsFixed(const uint8_t* w, const float* x, float* y, int64_t out, int64_t in, int64_t o0, int64_t o1,
               const Tuning& tuning) {
  const int64_t ahead = tuning.Ahead(out * H::RowBytes(in));
  int64_t o = o0;
#ifdef __AVX512F__
  constexpr int NR = NB <= 4 ? 4 : 1;
  if constexpr (NB > 4 && H::kStep <= 32) {
    if (NB * in * static_cast<int64_t>(sizeof(float)) > tuning.split_bytes) {
      for (; o + 4 <= o1; o += 4) {
        Tile<H, 4, 4>(w, x, y, out, in, o, ahead);
        Tile<H, 4, NB - 4>(w, x + 4 * in, y + 4 * out, out, in, o, ahead);
      }
    }
  }
#else
  if constexpr (NB > 4) {
    if (NB * in * static_cast<int64_t>(sizeof(float)) > tuning.split_bytes) {
      if constexpr (H::kValues > 1) {  // blocks: widened once a half (their widening is the dearest part)
        RowsSegmented<H, NB>(w, x, y, out, in, o0, o1, ahead, tuning.split_bytes);
      } else {  // elements: cheap to widen twice, and a tile of 2 rows reads each x for both
        RowsFixed<H, 4>(w, x, y, out, in, o0, o1, tuning);
        RowsFixed<H, NB - 4>(w, x + 4 * in, y + 4 * out, out, in, o0, o1, tuning);
      }
      return;
    }
  }
  constexpr int NR = NB <= 2 ? 4 : NB <= 4 ? 2 : 1;
#endif
  for (; o + NR <= o1; o += NR) Tile<H, NR, NB>(w, x, y, out, in, o, ahead);
  for (; o < o1; ++o) Tile<H, 1, NB>(w, x, y, out, in, o, ahead);
}

// ---- The limb types (H::kLimbs, the k-quants: limbs.h). Each (row, sequence) sums in one order, whatever the
// batch, the tile and the instruction set: 16 f32 lanes, for each chunk of 64 inputs in order lane l
// fused-multiply-adding C_l (exact) times (the row's lane scale times the sequence's, rounded once); after each block
// of 256 (Q4_K, Q5_K) its mins' part, lanes 8-15; then Sum16.

// rows [o, o + NR) of w (a layer of H) against NB sequences' limbs (`stride` bytes apart) into y
template <typename H, int NR, int NB>
inline void LimbTile(const uint8_t* w, const uint8_t* limbs, int64_t stride, float* y, int64_t out, int64_t in,
                     int64_t o, int64_t ahead) {
  const int64_t row_bytes = H::RowBytes(in), blocks = in / 256;
  V16 acc[NR][NB];
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = Zero16();
  for (int64_t k = 0; k < blocks; ++k) {
    for (int r = 0; r < NR; ++r) {
      const uint8_t* block = w + (o + r) * row_bytes + k * H::kStepBytes;
      for (int64_t line = 0; line < H::kStepBytes; line += 64) Prefetch(block + line, ahead);
      const V16 scales = H::LimbScales(block);
      for (int c = 0; c < 4; ++c) {
        const Q64 q = H::ChunkQuants(block, c);
        const V16 lane = H::ChunkScales(scales, c);
        for (int b = 0; b < NB; ++b) {
          const LimbChunk& x = Chunks(limbs + b * stride)[4 * k + c];
          I16 dot = DotLimbs(q, x);
          if constexpr (H::kOffset) dot = Less(dot, x.offset);
          acc[r][b] = Fma16(ToFloat(dot), Mul16(lane, Load16(x.scale)), acc[r][b]);
        }
      }
      if constexpr (H::kMins) {
        for (int b = 0; b < NB; ++b) acc[r][b] = Fma16(scales, Load16(Sums(limbs + b * stride, in, k)), acc[r][b]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < NB; ++b) y[b * out + o + r] = Sum16(acc[r][b]);
}

// rows [o0, o1) of w against NB sequences: tiles of 4 rows for one sequence, 2 for two, else of 1 row
template <typename H, int NB>
void LimbRows(const uint8_t* w, const uint8_t* limbs, int64_t stride, float* y, int64_t out, int64_t in, int64_t o0,
              int64_t o1, const Tuning& tuning) {
  constexpr int NR = NB == 1 ? 4 : NB == 2 ? 2 : 1;
  const int64_t ahead = tuning.Ahead(out * H::RowBytes(in));
  int64_t o = o0;
  for (; o + NR <= o1; o += NR) LimbTile<H, NR, NB>(w, limbs, stride, y, out, in, o, ahead);
  for (; o < o1; ++o) LimbTile<H, 1, NB>(w, limbs, stride, y, out, in, o, ahead);
}

// x: the sequences' f32 rows ([B, in]) or, for a limb type, their limbs (stride bytes apart)
using RowsFn = void (*)(const uint8_t* w, const uint8_t* x, int64_t stride, float* y, int64_t batch, int64_t out,
                        int64_t in, int64_t o0, int64_t o1, const Tuning& tuning);

template <typename H, int NB>
void RowsOf(const uint8_t* w, const uint8_t* x, int64_t stride, float* y, int64_t out, int64_t in, int64_t o0,
            int64_t o1, const Tuning& tuning) {
  if constexpr (H::kLimbs) {
    LimbRows<H, NB>(w, x, stride, y, out, in, o0, o1, tuning);
  } else {
    RowsFixed<H, NB>(w, reinterpret_cast<const float*>(x), y, out, in, o0, o1, tuning);
  }
}

template <typename H>
void Rows(const uint8_t* w, const uint8_t* x, int64_t stride, float* y, int64_t batch, int64_t out, int64_t in,
          int64_t o0, int64_t o1, const Tuning& tuning) {
  switch (batch) {
    case 1: return RowsOf<H, 1>(w, x, stride, y, out, in, o0, o1, tuning);
    case 2: return RowsOf<H, 2>(w, x, stride, y, out, in, o0, o1, tuning);
    case 3: return RowsOf<H, 3>(w, x, stride, y, out, in, o0, o1, tuning);
    case 4: return RowsOf<H, 4>(w, x, stride, y, out, in, o0, o1, tuning);
    case 5: return RowsOf<H, 5>(w, x, stride, y, out, in, o0, o1, tuning);
    case 6: return RowsOf<H, 6>(w, x, stride, y, out, in, o0, o1, tuning);
    case 7: return RowsOf<H, 7>(w, x, stride, y, out, in, o0, o1, tuning);
    default: return RowsOf<H, 8>(w, x, stride, y, out, in, o0, o1, tuning);
  }
}

// One matrix of a call: its layer's first row (`out` rows of the call's `in` inputs) and where its products go,
// y [B, out]
struct Target {
  const uint8_t* rows;
  float* y;
  int64_t out;
};

// x (B sequences, `stride` bytes apart) times each target's rows (all of `in` inputs) into its y, on the pool's
// threads: every target's rows cut into pieces of `chunk` rows, the pieces of all of them one pool of items (one
// hand-off to the threads for the lot: a layer's q, k and v, its gate and up). Item k is piece k % pieces (in
// target order) of sequences [kMaxBatch * (k / pieces), ...).
void RunMatvec(ffi::ThreadPool pool, RowsFn rows, std::vector<Target> targets, const uint8_t* x, int64_t stride,
               int64_t batch, int64_t in, const Tuning& tuning) {
  int64_t total = 0;
  for (const Target& t : targets) total += t.out;
  if (total == 0 || batch == 0) return;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // tuning.items_per_thread items a thread (load balance), at least 32 rows each (the scheduling cost), a multiple of 8
  const int64_t chunk = std::max<int64_t>(32, (total / (tuning.items_per_thread * threads) + 7) / 8 * 8);
  std::vector<std::pair<int64_t, int64_t>> pieces;  // (target, first row)
  for (int64_t t = 0; t < static_cast<int64_t>(targets.size()); ++t)
    for (int64_t o0 = 0; o0 < targets[t].out; o0 += chunk) pieces.emplace_back(t, o0);
  const int64_t count = static_cast<int64_t>(pieces.size());
  auto work = std::make_shared<Items>();
  work->items = count * ((batch + kMaxBatch - 1) / kMaxBatch);
  work->run = [=, targets = std::move(targets), pieces = std::move(pieces)](int64_t k) {
    const auto [t, o0] = pieces[k % count];
    const Target& target = targets[t];
    const int64_t b0 = kMaxBatch * (k / count);
    rows(target.rows, x + b0 * stride, stride, target.y + b0 * target.out, std::min(kMaxBatch, batch - b0), target.out,
         in, o0, std::min(target.out, o0 + chunk), tuning);
  };
  RunItems(pool, work);
}

// x [B, I] times layer `layer` of each w [L, O_m, I] held as H (the remaining arguments), into each y [B, O_m] (the
// remaining results, in the same order)
template <typename H>
ffi::Error Matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                  ffi::RemainingRets ys, int64_t ahead_small, int64_t ahead_large, int64_t split_bytes,
                  int64_t items_per_thread) {
  if (ahead_small < 0 || ahead_large < 0 || items_per_thread < 1) {
    return ffi::Error::InvalidArgument("llama_jax matvec: tuning needs aheads >= 0 and items_per_thread >= 1");
  }
  const Tuning tuning{ahead_small, ahead_large, split_bytes, items_per_thread};
  const auto xd = x.dimensions();
  if (xd.size() != 2 || ws.size() != ys.size() || ws.size() == 0) {
    return ffi::Error::InvalidArgument("llama_jax matvec: expected x [B, I] and as many matrices as results");
  }
  const int64_t batch = xd[0], in = xd[1];
  const int32_t l = *layer.typed_data();
  std::vector<Target> targets;
  for (size_t m = 0; m < ws.size(); ++m) {
    auto w = ws.get<ffi::Buffer<H::kDtype>>(m);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(m);
    if (!w.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("llama_jax matvec: a matrix of another kind");
    }
    const auto wd = w->dimensions();
    int64_t o = 0, i = 0;
    if (!H::Matrix(wd, 1, o, i) || i != in) {
      return ffi::Error::InvalidArgument("llama_jax matvec: expected each w [L] + " + H::Layout() + " and x [B, I]");
    }
    if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("llama_jax matvec: layer index out of range");
    float* out = y.value()->typed_data();
    targets.push_back({static_cast<const uint8_t*>(w->untyped_data()) + l * o * H::RowBytes(i), out, o});
  }
  if constexpr (H::kLimbs) {  // the sequences' limbs, made once for every row (this thread's, reused between calls)
    thread_local std::vector<uint8_t> scratch;
    const int64_t stride = LimbBytes(in);
    scratch.resize(batch * stride + 64);
    uint8_t* limbs = scratch.data() + (64 - reinterpret_cast<uintptr_t>(scratch.data()) % 64) % 64;
    for (int64_t b = 0; b < batch; ++b) MakeLimbs(x.typed_data() + b * in, in, limbs + b * stride);
    RunMatvec(pool, Rows<H>, std::move(targets), limbs, stride, batch, in, tuning);
  } else {
    RunMatvec(pool, Rows<H>, std::move(targets), reinterpret_cast<const uint8_t*>(x.typed_data()),
              in * int64_t{sizeof(float)}, batch, in, tuning);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace llama_jax

using namespace llama_jax;  // the handlers below name its functions

#define LLAMA_JAX_MATVEC(held)                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(LlamaJaxMatvec##held, Matvec<held>,  \
                                ffi::Ffi::Bind()                  \
                                    .Ctx<ffi::ThreadPool>()       \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .RemainingArgs()              \
                                    .RemainingRets()              \
                                    .Attr<int64_t>("ahead_small") \
                                    .Attr<int64_t>("ahead_large") \
                                    .Attr<int64_t>("split_bytes") \
                                    .Attr<int64_t>("items_per_thread"));

LLAMA_JAX_HELD(LLAMA_JAX_MATVEC)
