// Attention, called from jitted code through XLA's FFI: a decode step's (Attend: one query position per sequence
// against the cache) and a block of query positions' (AttendBlock: prefill, scoring, `forward`) with its gradient.
//
// Attend: one query position per sequence against the keys and values in the cache, read in place (the layer's
// slice of the cache is not copied), each query head j·G + i against key/value head j, over the slots up to the
// sequence's own position, in pieces of slots fixed by slot numbers (every thread busy at batch 1 and depth);
// each (sequence, head) in one order, on any thread: batch-invariant too.
//
// AttendBlock: causal attention for a block of query positions,
// out[b, t, n] = softmax_s(q[b, t, n] · k[b, n / G, s] · c, s <= pos[b, t]) · v[b, n / G, s] (c: the scale,
// 1 / sqrt(H) or Granite's multiplier), and with a
// sliding window (window > 0) s > pos[b, t] - window too (Mistral's).
//
// Query t attends to the key slots 0..pos[b, t] only, and the work follows: a block of queries computes its scores
// up to the block's last position and no further, so the half of the T × T square that the causal mask hides is
// never computed (XLA's path computes the whole square and masks it). The keys are packed into panels once a call;
// then per item (sequence b, key/value head j, a block of 48 query positions), over the slots in chunks of kSlots
// (192) counted from slot 0: the chunk's scores for the G query heads of the group are a product (gemm.h) kept in a
// thread's scratch (G x 48 x 192 floats, in L2 at any length), each row's softmax is taken online (a running
// maximum m and sum l: the row's output and l are multiplied by exp(m_old - m_new) when the maximum grows), and the
// exponentials times the chunk's values are added by a second product; at the end each output is divided by its l.
// A whole T × T square of scores (at 8,000 positions several MB a block) is never held.
//
// Order (batch invariance): a row's scores are H fused multiply-adds in order; per chunk its maximum, exp(score - m)
// (the same polynomial, lane for lane, with AVX-512 and AVX2), their sum (nearly exact: 16 lanes over the chunk's
// slots, gemm.h's Exponentials, then the lanes in double by a fixed tree) added to l times the factor, its output times
// the factor plus the chunk's product (gemm.h's sum over its slots); at the end the output divided by l in double,
// rounded once. (l in f32, summed in lanes, left one of the real model's activations past the parity test's bound: the
// order and the accuracy of this sum matter there.) Slots outside the row's window (past its own position, before its
// first) hold exactly 0 and a chunk without any of its slots changes nothing: a row's bits depend on its position alone
// (the chunks are fixed by slot numbers), not on the block, the batch, T or the thread.
//
// Its gradient (AttendBlockGrad, below) reads the same slots only, in the same chunks, and holds no T × T square
// either: research's gradients through a layer's attention took ~9 ms in XLA's autograd at 256 positions.
#include "gemm.h"

namespace llama_jax {
namespace {  // this file's own

constexpr int64_t kSlots = kKC;  // the key slots of a chunk (whole panels), counted from slot 0 for every row

// The sizes of a block attention's operands: q [..., T, N, H], k and v [..., K, S, H], pos [..., T], the leading
// axes (a vmapped call's) folded into `batch` sequences
struct BlockShape {
  int64_t batch = 1, t_len = 0, heads = 0, head = 0, kv = 0, slots = 0;
};

// Checks the operands fit together and every position lies inside the key slots; `shape` then holds their sizes
ffi::Error CheckBlock(const char* name, ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                      ffi::Span<const int64_t> pd, const int32_t* positions, BlockShape& shape) {
  const std::string where = std::string("llama_jax ") + name + ": ";
  if (qd.size() < 3 || kd.size() != qd.size() || pd.size() + 2 != qd.size()) {
    return ffi::Error::InvalidArgument(where + "expected q [..., T, N, H], k and v [..., K, S, H], pos [..., T]");
  }
  const size_t lead = qd.size() - 3;
  for (size_t d = 0; d < lead; ++d) {
    if (kd[d] != qd[d] || pd[d] != qd[d]) return ffi::Error::InvalidArgument(where + "batch sizes differ");
    shape.batch *= qd[d];
  }
  shape.t_len = qd[lead], shape.heads = qd[lead + 1], shape.head = qd[lead + 2];
  shape.kv = kd[lead], shape.slots = kd[lead + 1];
  if (kd[lead + 2] != shape.head || pd[lead] != shape.t_len || shape.kv == 0 || shape.heads % shape.kv != 0) {
    return ffi::Error::InvalidArgument(where + "q, k, v and pos do not fit together");
  }
  for (int64_t r = 0; r < shape.batch * shape.t_len; ++r) {
    if (positions[r] < 0 || positions[r] >= shape.slots) {
      return ffi::Error::InvalidArgument(where + "a query position outside the key slots");
    }
  }
  return ffi::Error::Success();
}

// The slots row t reads: [first, end), its sliding window's (window > 0) or from slot 0
inline int64_t FirstSlot(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position + 1 - window) : 0;
}

ffi::Error AttendBlock(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out,
                       int64_t window, float scale) {
  BlockShape shape;
  const int32_t* positions = pos.typed_data();
  if (auto e = CheckBlock("attend_block", q.dimensions(), k.dimensions(), pos.dimensions(), positions, shape);
      e.failure()) {
    return e;
  }
  const int64_t batch = shape.batch, t_len = shape.t_len, heads = shape.heads, head = shape.head, kv = shape.kv,
                slots = shape.slots;  // (a lambda cannot capture structured bindings in C++17)
  if (batch * t_len == 0 || heads == 0 || head == 0) return ffi::Error::Success();
  const int64_t group = heads / kv;
  const int64_t block = 4 * kMR;  // queries per item: their scores over one chunk of slots, G x 48 x 192, in L2
  const int64_t blocks = (t_len + block - 1) / block;
  const float *queries = q.typed_data(), *keys_all = k.typed_data(), *values_all = v.typed_data();
  float* results = out->typed_data();
  // The keys' panels, packed once a call: every query block reads the chunks up to its position, and packing them
  // per block (~170 blocks at 8,000 positions) took ~2.5% of the attention there. Per sequence and key/value head,
  // per chunk of slots from the first any row reads (a sliding window's) to the last, per piece of kKC of the head's
  // values: the chunk's panels
  int64_t reach = 0, first_slot = slots;
  for (int64_t r = 0; r < batch * t_len; ++r) {
    reach = std::max<int64_t>(reach, positions[r] + 1);
    first_slot = std::min(first_slot, FirstSlot(positions[r], window));
  }
  const int64_t first_chunk = first_slot / kSlots;  // first_slot <= a position < reach
  const int64_t chunks = (reach + kSlots - 1) / kSlots - first_chunk, head_pieces = (head + kKC - 1) / kKC;
  const int64_t chunk_floats = head_pieces * (kSlots / kNR) * kKC * kNR;
  float* packed_keys = CallScratch(batch * kv * chunks * chunk_floats);
  auto packing = std::make_shared<Items>();
  packing->items = batch * kv * chunks;
  packing->run = [=](int64_t item) {
    const int64_t s0 = (first_chunk + item % chunks) * kSlots, n = std::min(kSlots, reach - s0);
    const HeldRows<F32> key_rows{reinterpret_cast<const uint8_t*>(keys_all + item / chunks * slots * head), head};
    float* pack_scratch = Scratch(kNR * kKC);
    for (int64_t h0 = 0; h0 < head; h0 += kKC) {
      float* panels = packed_keys + item * chunk_floats + h0 / kKC * (kSlots / kNR) * kKC * kNR;
      for (int64_t p = 0; p * kNR < n; ++p) {
        Pack(key_rows, false, s0 + p * kNR, std::min(kNR, n - p * kNR), h0, std::min(kKC, head - h0),
             panels + p * kKC * kNR, pack_scratch);
      }
    }
  };
  RunItems(pool, packing);
  auto work = std::make_shared<Items>();
  work->items = batch * kv * blocks;
  work->run = [=](int64_t item) {
    const int64_t qb = blocks - 1 - item % blocks;  // the longest blocks first: they take longest
    const int64_t b = item / blocks / kv, j = item / blocks % kv;
    const int64_t t0 = qb * block, t1 = std::min(t_len, t0 + block), rows = t1 - t0;
    const int32_t* row_pos = positions + b * t_len;
    int64_t len = 0, start = slots;  // the slots this block reads: from its first row's first to its last position
    for (int64_t t = t0; t < t1; ++t) {
      len = std::max<int64_t>(len, row_pos[t] + 1);
      start = std::min<int64_t>(start, FirstSlot(row_pos[t], window));
    }
    const float* values = values_all + (b * kv + j) * slots * head;
    const int64_t value_panels = (head + kNR - 1) / kNR;
    const int64_t panel_floats = value_panels * kKC * kNR;
    // 64-byte aligned pieces (a panel's loads are aligned): the chunk's values (unless read in place), the pack's
    // scratch, the scores [G, rows, kSlots], each row's running maximum and its sum
    float* panel = Scratch(panel_floats + kNR * kKC + group * rows * (kSlots + 3));
    float* pack_scratch = panel + panel_floats;
    float* scores = pack_scratch + kNR * kKC;
    float* tops = scores + group * rows * kSlots;
    double* totals = reinterpret_cast<double*>(tops + group * rows + (group * rows) % 2);
    std::fill(tops, tops + group * rows, -INFINITY);
    std::fill(totals, totals + group * rows, 0.0);
    const HeldRows<F32> value_rows{reinterpret_cast<const uint8_t*>(values), head};
    const float* q_at = queries + ((b * t_len + t0) * heads + j * group) * head;  // row t, head i: + (t·N + i)·H
    float* out_at = results + ((b * t_len + t0) * heads + j * group) * head;
    for (int64_t r = 0; r < rows; ++r) std::fill(out_at + r * heads * head, out_at + (r * heads + group) * head, 0.0f);
    for (int64_t s0 = start / kSlots * kSlots; s0 < len; s0 += kSlots) {  // chunks at multiples of kSlots
      const int64_t n = std::min(kSlots, len - s0), panels = (n + kNR - 1) / kNR;
      // scores[i][r][s] = q[t0 + r, jG + i] · k[s0 + s], chunk by chunk of the head's values
      for (int64_t h0 = 0; h0 < head; h0 += kKC) {
        const int64_t hc = std::min(kKC, head - h0);
        const float* key_panels = packed_keys + ((b * kv + j) * chunks + s0 / kSlots - first_chunk) * chunk_floats +
                                  h0 / kKC * (kSlots / kNR) * kKC * kNR;
        for (int64_t i = 0; i < group; ++i) {
          for (int64_t m = 0; m < rows; m += kMR) {
            const MicroFn micro = kMicro[std::min<int64_t>(kMR, rows - m) - 1];
            for (int64_t p = 0; p < panels; ++p) {
              micro(q_at + (m * heads + i) * head + h0, heads * head, key_panels + p * kKC * kNR, kNR, hc,
                    scores + (i * rows + m) * kSlots + p * kNR, kSlots, kNR, h0 > 0);
            }
          }
        }
      }
      for (int64_t i = 0; i < group; ++i) {
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t end = row_pos[t0 + r] + 1, first = FirstSlot(row_pos[t0 + r], window);
          const int64_t lo = std::clamp<int64_t>(first - s0, 0, n), hi = std::clamp<int64_t>(end - s0, 0, n);
          const float factor = Exponentials(scores + (i * rows + r) * kSlots, lo, hi, n, scale, tops[i * rows + r],
                                            totals[i * rows + r]);
          if (factor != 1.0f) {
            float* o = out_at + (r * heads + i) * head;
            for (int64_t h = 0; h < head; ++h) o[h] *= factor;
          }
        }
      }
      // out[t0 + r, jG + i] += exponentials[i][r] · v[s0..], the chunk's slots in one product's sum. Where the
      // head is whole panels wide, v's rows are the panels' rows and are read in place (their copy into panels
      // took ~2% of the attention at 8,000 positions); else packed, the last panel padded with zeros
      const bool in_place = head % kNR == 0;
      for (int64_t p = 0; p < value_panels && !in_place; ++p) {
        Pack(value_rows, true, p * kNR, std::min(kNR, head - p * kNR), s0, n, panel + p * kKC * kNR, pack_scratch);
      }
      for (int64_t i = 0; i < group; ++i) {
        for (int64_t m = 0; m < rows; m += kMR) {
          const MicroFn micro = kMicro[std::min<int64_t>(kMR, rows - m) - 1];
          for (int64_t p = 0; p < value_panels; ++p) {
            const float* b = in_place ? values + s0 * head + p * kNR : panel + p * kKC * kNR;
            micro(scores + (i * rows + m) * kSlots, kSlots, b, in_place ? head : kNR, n,
                  out_at + (m * heads + i) * head + p * kNR, heads * head, std::min(kNR, head - p * kNR), true);
          }
        }
      }
    }
    for (int64_t i = 0; i < group; ++i) {  // each output divided by its row's sum
      for (int64_t r = 0; r < rows; ++r) {
        float* o = out_at + (r * heads + i) * head;
        for (int64_t h = 0; h < head; ++h) o[h] = static_cast<float>(o[h] / totals[i * rows + r]);
      }
    }
  };
  RunItems(pool, work);
  return ffi::Error::Success();
}

// Rows o of a matrix at base + o · stride (a query head's rows of q [T, N, H]: stride N·H), for Pack
struct StridedRows {
  const float* base;
  int64_t stride;
  void Read(int64_t o, int64_t i0, int64_t n, float* out) const {
    std::memcpy(out, base + o * stride + i0, n * sizeof(float));
  }
  void Prefetch(int64_t, int64_t, int64_t) const {}  // rows just written by XLA: in cache
};

// y[m, c] (+)= Σ_k x[m, k] · B(k, c) for rows m < rows, the columns of `panels` packed panels (gemm.h's Micro)
inline void Product(const float* x, int64_t ldx, int64_t rows, const float* panels, int64_t panel_count, int64_t kc,
                    int64_t columns, float* y, int64_t ldy, bool add) {
  for (int64_t m = 0; m < rows; m += kMR) {
    const MicroFn micro = kMicro[std::min<int64_t>(kMR, rows - m) - 1];
    for (int64_t p = 0; p < panel_count; ++p) {
      micro(x + m * ldx, ldx, panels + p * kKC * kNR, kNR, kc, y + m * ldy + p * kNR, ldy,
            std::min(kNR, columns - p * kNR), add);
    }
  }
}

// The panels of rows' values h0..h0+hc-1 over columns c0..c0+cols-1 of `rows` (B(h, c) = rows[c0 + c, h0 + h]):
// a scores product's right side; or, transposed, of columns h of rows k0..k0+kc-1 (B(k, h) = rows[k0 + k, h])
inline int64_t PackPanels(const StridedRows& rows, bool transpose, int64_t c0, int64_t cols, int64_t k0, int64_t kc,
                          float* panels, float* scratch) {
  const int64_t count = (cols + kNR - 1) / kNR;
  for (int64_t p = 0; p < count; ++p) {
    Pack(rows, transpose, c0 + p * kNR, std::min(kNR, cols - p * kNR), k0, kc, panels + p * kKC * kNR, scratch);
  }
  return count;
}

// The gradient of AttendBlock's output with respect to q, k and v, given o (its output) and g (the output's
// gradient). With P the probabilities, c the scale (1 / sqrt(H), or Granite's multiplier) and D[t, n] = g[t, n] · o[t, n]:
// dS = P ⊙ (g·vᵀ - D), dq = c·dS·k, dk = c·Σ_(t, n in the group) dSᵀ·q, dv = Σ Pᵀ·g. Two passes over the items:
// (1) per (sequence, key/value head, block of 48 queries), as the forward: each row's maximum and sum (the
// forward's online softmax over the same chunks), D, then chunk by chunk the scores and g·vᵀ again, dS, and dq
// added chunk by chunk; (2) per (sequence, key/value head, chunk of kSlots key slots): the chunk's scores and v·gᵀ
// transposed (keys as rows) against the queries in blocks of kKC, Pᵀ and dSᵀ, and dk, dv summed over the blocks
// and the group's heads in order. Only the slots a query reads are computed (the causal half skipped); each sum
// runs in an order fixed by the shapes, not by the threads. f32 class: P is recomputed as exp(c·score - m) / l.
ffi::Error AttendBlockGrad(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::F32> o,
                           ffi::Buffer<ffi::F32> g, ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                           ffi::ResultBuffer<ffi::F32> dv, int64_t window, float scale) {
  BlockShape shape;
  const int32_t* positions = pos.typed_data();
  if (auto e = CheckBlock("attend_block_grads", q.dimensions(), k.dimensions(), pos.dimensions(), positions, shape);
      e.failure()) {
    return e;
  }
  if (o.element_count() != q.element_count() || g.element_count() != q.element_count()) {
    return ffi::Error::InvalidArgument("llama_jax attend_block_grads: o and g must have q's shape");
  }
  const int64_t batch = shape.batch, t_len = shape.t_len, heads = shape.heads, head = shape.head, kv = shape.kv,
                slots = shape.slots;  // (a lambda cannot capture structured bindings in C++17)
  float *dq_all = dq->typed_data(), *dk_all = dk->typed_data(), *dv_all = dv->typed_data();
  std::fill(dk_all, dk_all + dk->element_count(), 0.0f);  // slots no query reads keep 0
  std::fill(dv_all, dv_all + dv->element_count(), 0.0f);
  if (batch * t_len == 0 || heads == 0 || head == 0) return ffi::Error::Success();
  const int64_t group = heads / kv;
  const float *queries = q.typed_data(), *keys_all = k.typed_data(), *values_all = v.typed_data();
  const float *outs = o.typed_data(), *grads = g.typed_data();
  // per query row and head: its scores' maximum (scaled), 1 / its sum, D
  std::vector<float> tops_all(batch * t_len * heads), inverses_all(tops_all.size()), dots_all(tops_all.size());
  const int64_t value_panels = (head + kNR - 1) / kNR;
  const int64_t panel_floats = std::max((kKC + kNR - 1) / kNR, value_panels) * kKC * kNR;

  // (1) statistics and dq, per block of queries
  const int64_t block = 4 * kMR, blocks = (t_len + block - 1) / block;
  auto queries_pass = std::make_shared<Items>();
  queries_pass->items = batch * kv * blocks;
  queries_pass->run = [=, &tops_all, &inverses_all, &dots_all](int64_t item) {
    const int64_t qb = blocks - 1 - item % blocks;  // the longest blocks first
    const int64_t b = item / blocks / kv, j = item / blocks % kv;
    const int64_t t0 = qb * block, rows = std::min(t_len, t0 + block) - t0;
    const int32_t* row_pos = positions + b * t_len;
    int64_t len = 0, start = slots;
    for (int64_t t = t0; t < t0 + rows; ++t) {
      len = std::max<int64_t>(len, row_pos[t] + 1);
      start = std::min<int64_t>(start, FirstSlot(row_pos[t], window));
    }
    const StridedRows key_rows{keys_all + (b * kv + j) * slots * head, head};
    const StridedRows value_rows{values_all + (b * kv + j) * slots * head, head};
    const int64_t at = ((b * t_len + t0) * heads + j * group) * head;  // row t0, head jG
    const float *q_at = queries + at, *g_at = grads + at, *o_at = outs + at;
    float* dq_at = dq_all + at;
    float* panels = Scratch(panel_floats + kNR * kKC + 2 * group * rows * kSlots + 4 * group * rows + 2);
    float* pack_scratch = panels + panel_floats;
    float* scores = pack_scratch + kNR * kKC;  // [G, rows, kSlots]
    float* products = scores + group * rows * kSlots;  // g·vᵀ, [G, rows, kSlots]
    float* tops = products + group * rows * kSlots;
    float* dots = tops + group * rows;
    double* totals = reinterpret_cast<double*>(dots + group * rows);  // 2 G·rows floats before: 8-byte aligned
    std::fill(tops, tops + group * rows, -INFINITY);
    std::fill(totals, totals + group * rows, 0.0);
    // scores[i][r][s] = q[t0 + r, jG + i] · k[s0 + s] (the forward's product), or with g and v
    auto chunk_scores = [&](const StridedRows& rows_right, const float* left, int64_t s0, int64_t n, float* to) {
      for (int64_t h0 = 0; h0 < head; h0 += kKC) {
        const int64_t hc = std::min(kKC, head - h0);
        const int64_t count = PackPanels(rows_right, false, s0, n, h0, hc, panels, pack_scratch);
        for (int64_t i = 0; i < group; ++i) {
          Product(left + i * head + h0, heads * head, rows, panels, count, hc, n, to + i * rows * kSlots, kSlots,
                  h0 > 0);
        }
      }
    };
    const int64_t first_chunk = start / kSlots * kSlots;
    for (int64_t s0 = first_chunk; s0 < len; s0 += kSlots) {  // each row's maximum and sum, as the forward's
      const int64_t n = std::min(kSlots, len - s0);
      chunk_scores(key_rows, q_at, s0, n, scores);
      for (int64_t i = 0; i < group; ++i) {
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t end = row_pos[t0 + r] + 1, first = FirstSlot(row_pos[t0 + r], window);
          const int64_t lo = std::clamp<int64_t>(first - s0, 0, n), hi = std::clamp<int64_t>(end - s0, 0, n);
          Exponentials(scores + (i * rows + r) * kSlots, lo, hi, n, scale, tops[i * rows + r], totals[i * rows + r]);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < group; ++i) {
        const int64_t off = (r * heads + i) * head;
        double dot = 0.0;
        for (int64_t h = 0; h < head; ++h) dot += static_cast<double>(g_at[off + h]) * o_at[off + h];
        dots[i * rows + r] = static_cast<float>(dot);
        const int64_t row = (b * t_len + t0 + r) * heads + j * group + i;
        tops_all[row] = tops[i * rows + r];
        inverses_all[row] = static_cast<float>(1.0 / totals[i * rows + r]);
        dots_all[row] = dots[i * rows + r];
        std::fill(dq_at + off, dq_at + off + head, 0.0f);
      }
    }
    alignas(64) float e[kKC];
    for (int64_t s0 = first_chunk; s0 < len; s0 += kSlots) {
      const int64_t n = std::min(kSlots, len - s0), width = (n + kLanes - 1) / kLanes * kLanes;
      chunk_scores(key_rows, q_at, s0, n, scores);
      chunk_scores(value_rows, g_at, s0, n, products);
      for (int64_t i = 0; i < group; ++i) {
        for (int64_t r = 0; r < rows; ++r) {  // the row's scores become dS · c: 0 outside its slots
          const int64_t end = row_pos[t0 + r] + 1, first = FirstSlot(row_pos[t0 + r], window);
          const int64_t lo = std::clamp<int64_t>(first - s0, 0, n), hi = std::clamp<int64_t>(end - s0, 0, n);
          float* row = scores + (i * rows + r) * kSlots;
          const float* product = products + (i * rows + r) * kSlots;
          const float top = tops[i * rows + r], inverse = inverses_all[(b * t_len + t0 + r) * heads + j * group + i];
          const float dot = dots[i * rows + r];
          std::fill(e, e + width, -INFINITY);
          for (int64_t s = lo; s < hi; ++s) e[s] = row[s] * scale - top;
          for (int64_t s = 0; s < width; s += kLanes) VStoreU(e + s, ExpNonPositive(VLoadU(e + s)));
          for (int64_t s = 0; s < n; ++s) row[s] = e[s] * inverse * (product[s] - dot) * scale;  // 0 where exp(-inf)
        }
      }
      // dq[t0 + r, jG + i] += dS[i][r] · k[s0..s0 + n): the keys' columns packed, the slots the inner index
      const int64_t count = PackPanels(key_rows, true, 0, head, s0, n, panels, pack_scratch);
      for (int64_t i = 0; i < group; ++i) {
        Product(scores + i * rows * kSlots, kSlots, rows, panels, count, n, head, dq_at + i * head, heads * head, true);
      }
    }
  };
  RunItems(pool, queries_pass);

  // (2) dk and dv, per chunk of key slots
  const int64_t chunks = (slots + kSlots - 1) / kSlots;
  auto keys_pass = std::make_shared<Items>();
  keys_pass->items = batch * kv * chunks;
  keys_pass->run = [=, &tops_all, &inverses_all, &dots_all](int64_t item) {
    const int64_t c = item % chunks, b = item / chunks / kv, j = item / chunks % kv;
    const int64_t s0 = c * kSlots, n = std::min(kSlots, slots - s0);
    const int32_t* row_pos = positions + b * t_len;
    const float* keys = keys_all + ((b * kv + j) * slots + s0) * head;  // the chunk's rows
    const float* values = values_all + ((b * kv + j) * slots + s0) * head;
    float* dk_at = dk_all + ((b * kv + j) * slots + s0) * head;
    float* dv_at = dv_all + ((b * kv + j) * slots + s0) * head;
    float* panels = Scratch(panel_floats + kNR * kKC + 2 * kSlots * kKC + 4 * kKC + 2 * kKC);
    float* pack_scratch = panels + panel_floats;
    float* scores = pack_scratch + kNR * kKC;  // [n, kKC]: slot s's scores against the block's queries
    float* products = scores + kSlots * kKC;   // v·gᵀ
    float* e = products + kSlots * kKC;        // [kKC]
    float *tops = e + kKC, *inverses = tops + kKC, *dots = inverses + kKC;  // the block's queries' statistics
    int32_t* lasts = reinterpret_cast<int32_t*>(dots + kKC);               // the slots each reads: first..last
    int32_t* firsts = lasts + kKC;
    for (int64_t t0 = 0; t0 < t_len; t0 += kKC) {
      const int64_t tb = std::min(kKC, t_len - t0), width = (tb + kLanes - 1) / kLanes * kLanes;
      bool reads = false;  // whether a query of the block reads a slot of the chunk
      for (int64_t t = 0; t < width; ++t) {
        lasts[t] = t < tb ? row_pos[t0 + t] : -1;  // a column past the block reads nothing
        firsts[t] = t < tb ? static_cast<int32_t>(FirstSlot(row_pos[t0 + t], window)) : 0;
        reads = reads || (lasts[t] >= s0 && firsts[t] < s0 + n);
      }
      if (!reads) continue;
      for (int64_t i = 0; i < group; ++i) {
        const int64_t head_index = j * group + i;
        const StridedRows query_rows{queries + (b * t_len * heads + head_index) * head, heads * head};
        const StridedRows grad_rows{grads + (b * t_len * heads + head_index) * head, heads * head};
        for (int64_t h0 = 0; h0 < head; h0 += kKC) {  // scores[s][t] = k[s0 + s] · q[t0 + t], v·gᵀ alike
          const int64_t hc = std::min(kKC, head - h0);
          int64_t count = PackPanels(query_rows, false, t0, tb, h0, hc, panels, pack_scratch);
          Product(keys + h0, head, n, panels, count, hc, tb, scores, kKC, h0 > 0);
          count = PackPanels(grad_rows, false, t0, tb, h0, hc, panels, pack_scratch);
          Product(values + h0, head, n, panels, count, hc, tb, products, kKC, h0 > 0);
        }
        const int64_t row0 = (b * t_len + t0) * heads + head_index;  // query t0's statistics, then every heads-th
        for (int64_t t = 0; t < tb; ++t) {
          tops[t] = tops_all[row0 + t * heads], inverses[t] = inverses_all[row0 + t * heads];
          dots[t] = dots_all[row0 + t * heads];
        }
        for (int64_t s = 0; s < n; ++s) {  // scores become Pᵀ, products dSᵀ · c; 0 where t does not read s
          float* row = scores + s * kKC;
          float* product = products + s * kKC;
          const int32_t slot = static_cast<int32_t>(s0 + s);
          for (int64_t t = 0; t < width; ++t) {
            const float x = row[t] * scale - tops[t];
            e[t] = firsts[t] <= slot && slot <= lasts[t] ? x : -INFINITY;
          }
          for (int64_t t = 0; t < width; t += kLanes) VStoreU(e + t, ExpNonPositive(VLoadU(e + t)));
          for (int64_t t = 0; t < tb; ++t) {
            const float p = e[t] * inverses[t];  // 0 where not read (exp(-inf))
            row[t] = p;
            product[t] = p * (product[t] - dots[t]) * scale;
          }
        }
        // dv[s0 + s] += Pᵀ[s] · g[t0..t0 + tb), dk[s0 + s] += dSᵀ[s] · q[t0..]: their columns packed, t inner
        int64_t count = PackPanels(grad_rows, true, 0, head, t0, tb, panels, pack_scratch);
        Product(scores, kKC, n, panels, count, tb, head, dv_at, head, true);
        count = PackPanels(query_rows, true, 0, head, t0, tb, panels, pack_scratch);
        Product(products, kKC, n, panels, count, tb, head, dk_at, head, true);
      }
    }
  };
  RunItems(pool, keys_pass);
  return ffi::Error::Success();
}

// ---- A decode step's attention (Attend)

// q · k over a head of H values: one 8-lane accumulator and the fixed tree when H is a multiple of 8, else in order
inline float Dot(const float* q, const float* k, int64_t head) {
  if (head % 8) {
    float dot = 0.0f;
    for (int64_t h = 0; h < head; ++h) dot += q[h] * k[h];
    return dot;
  }
  __m256 acc = _mm256_setzero_ps();
  for (int64_t h = 0; h < head; h += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + h), _mm256_loadu_ps(k + h), acc);
  return HorizontalSum(acc);
}

// out[h] += w * v[h] over a head
inline void AddScaled(float* out, float w, const float* v, int64_t head) {
  int64_t h = 0;
  const __m256 wv = _mm256_set1_ps(w);
  for (; h + 8 <= head; h += 8)
    _mm256_storeu_ps(out + h, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + h), _mm256_loadu_ps(out + h)));
  for (; h < head; ++h) out[h] += w * v[h];
}

// scores[s] = Dot(q, keys + s · H, H) for s < n: with H a multiple of 8, 4 slots side by side (4 independent sums,
// each in Dot's order; their 4 fixed trees as one, the same additions: the same bits)
inline void Dots(const float* q, const float* keys, int64_t n, int64_t head, float* scores) {
  int64_t s = 0;
  if (head % 8 == 0) {
    for (; s + 4 <= n; s += 4) {
      const float* k = keys + s * head;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t h = 0; h < head; h += 8) {
        const __m256 qv = _mm256_loadu_ps(q + h);
        for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * head + h), acc[j]);
      }
      __m128 lo[4];  // HorizontalSum's tree: l0+l4.., then the pairs, then the pairs' pairs
      for (int j = 0; j < 4; ++j) lo[j] = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
      _mm_storeu_ps(scores + s, _mm_hadd_ps(_mm_hadd_ps(lo[0], lo[1]), _mm_hadd_ps(lo[2], lo[3])));
    }
  }
  for (; s < n; ++s) scores[s] = Dot(q, keys + s * head, head);
}

// o[h] += w[s] · v[s, h] for s < n in order (AddScaled's operations, slot after slot: the same bits), 64 of the
// head's values at a time held in registers across the slots
inline void WeightedValues(float* o, const float* w, const float* values, int64_t n, int64_t head) {
  int64_t h0 = 0;
  for (; h0 + 64 <= head; h0 += 64) {
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(o + h0 + 8 * c);
    for (int64_t s = 0; s < n; ++s) {
      const __m256 ws = _mm256_set1_ps(w[s]);
      const float* v = values + s * head + h0;
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(ws, _mm256_loadu_ps(v + 8 * c), acc[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + h0 + 8 * c, acc[c]);
  }
  if (h0 < head) {
    for (int64_t s = 0; s < n; ++s) AddScaled(o + h0, w[s], values + s * head + h0, head - h0);
  }
}

constexpr int64_t kPiece = 256;  // the cache slots of one item of Attend, counted from slot 0 (whole multiples)

// One piece's share of a query head's attention: m, the piece's largest scaled score, and l, the sum of
// exp(score - m) over its slots (nearly exact: Exponentials'); beside it Attend keeps o, the sum of exp(score - m) · v
// over them (f32, in slot order)
struct PieceSums {
  float m;
  double l;
};

// out[b, n] = softmax_s(q[b, n] · k[layer, b, n / G, s] · c, first[b] <= s <= last[b]) · v[layer, b, n / G, s]
// where first[b] = last[b] - window + 1 with a sliding window (window > 0), else 0. The slots are cut into pieces of
// kPiece counted from slot 0, and an item is one (sequence, key/value head, piece), its G query heads together:
// the piece's keys and values are read once, and a deep cache is spread over every thread even at batch 1 (at one
// item per (sequence, head), batch 1 with 3 key/value heads kept one of 2 threads idle half the time). Each item
// keeps its PieceSums and o; then each output is joined over its pieces in order (M = the largest m, the sum of
// exp(m - M) · o over the pieces, divided by the sum of exp(m - M) · l in double, rounded once): the online softmax
// of the block attention, over pieces fixed by slot numbers, so a sequence's bits depend on its position alone,
// not on the batch or the threads.
ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer,
                  ffi::Buffer<ffi::S32> last, ffi::Buffer<ffi::F32> q, ffi::ResultBuffer<ffi::F32> out,
                  int64_t window, float scale) {
  const auto kd = k.dimensions();
  const auto qd = q.dimensions();
  if (kd.size() != 5 || qd.size() != 3 || kd[1] != qd[0] || kd[4] != qd[2] || qd[1] % kd[2] != 0) {
    return ffi::Error::InvalidArgument("llama_jax attend: expected caches [L, B, K, S, H] and q [B, N, H]");
  }
  const int64_t layers = kd[0], batch = kd[1], kv = kd[2], slots = kd[3], head = kd[4], heads = qd[1];
  const int64_t group = heads / kv;
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("llama_jax attend: layer index out of range");
  const int32_t* lasts = last.typed_data();
  for (int64_t b = 0; b < batch; ++b) {
    if (lasts[b] < 0) return ffi::Error::InvalidArgument("llama_jax attend: a sequence without positions");
  }
  // each sequence's slots [first, end) and its pieces [first / kPiece, (end - 1) / kPiece]; items numbered by
  // sequence, then key/value head, then piece
  std::vector<int64_t> firsts(batch), ends(batch), item_start(batch + 1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    ends[b] = std::min<int64_t>(slots, static_cast<int64_t>(lasts[b]) + 1);
    firsts[b] = window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(lasts[b]) + 1 - window) : 0;
    const int64_t pieces = ends[b] > firsts[b] ? (ends[b] - 1) / kPiece - firsts[b] / kPiece + 1 : 0;
    item_start[b + 1] = item_start[b] + kv * pieces;
  }
  const int64_t items = item_start[batch];
  std::vector<PieceSums> sums(items * group);
  std::vector<float> partial(items * group * head);  // each item's o for its G query heads
  const float *keys_all = k.typed_data(), *values_all = v.typed_data(), *queries = q.typed_data();
  float* results = out->typed_data();
  PieceSums* sums_at = sums.data();
  float* partial_at = partial.data();
  const int64_t *first_at = firsts.data(), *end_at = ends.data(), *start_at = item_start.data();
  auto work = std::make_shared<Items>();
  work->items = items;
  work->run = [=](int64_t item) {
    const int64_t b = std::upper_bound(start_at, start_at + batch + 1, item) - start_at - 1;
    const int64_t pieces = (start_at[b + 1] - start_at[b]) / kv, local = item - start_at[b];
    const int64_t j = local / pieces, piece = first_at[b] / kPiece + local % pieces;
    const int64_t s0 = std::max(first_at[b], piece * kPiece), s1 = std::min(end_at[b], (piece + 1) * kPiece);
    const int64_t n = s1 - s0, width = (n + 15) / 16 * 16;
    const int64_t base = ((static_cast<int64_t>(l) * batch + b) * kv + j) * slots * head + s0 * head;
    const float *keys = keys_all + base, *values = values_all + base;
    const float* q_at = queries + (b * heads + j * group) * head;  // query head jG + i: + i·H
    float* scores = Scratch(group * width);  // [G, width]: exp(score - m), 0 past the piece's slots
    for (int64_t i = 0; i < group; ++i) Dots(q_at + i * head, keys, n, head, scores + i * width);
    for (int64_t i = 0; i < group; ++i) {
      float top = -INFINITY;  // a piece's softmax: the online one's first chunk
      double total = 0.0;
      Exponentials(scores + i * width, 0, n, n, scale, top, total);
      sums_at[item * group + i] = {top, total};
      std::fill(partial_at + (item * group + i) * head, partial_at + (item * group + i + 1) * head, 0.0f);
    }
    for (int64_t i = 0; i < group; ++i)
      WeightedValues(partial_at + (item * group + i) * head, scores + i * width, values, n, head);
  };
  RunItems(pool, work);
  // each output joined over its pieces, in piece order
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pieces = (start_at[b + 1] - start_at[b]) / kv;
    for (int64_t j = 0; j < kv; ++j) {
      for (int64_t i = 0; i < group; ++i) {
        const int64_t item0 = start_at[b] + j * pieces;
        float top = -INFINITY;
        for (int64_t p = 0; p < pieces; ++p) top = std::max(top, sums[(item0 + p) * group + i].m);
        float* o = results + (b * heads + j * group + i) * head;
        std::fill(o, o + head, 0.0f);
        double total = 0.0;
        for (int64_t p = 0; p < pieces; ++p) {
          const PieceSums& piece = sums[(item0 + p) * group + i];
          const float factor = std::exp(piece.m - top);
          total += static_cast<double>(factor) * piece.l;
          AddScaled(o, factor, partial.data() + ((item0 + p) * group + i) * head, head);
        }
        for (int64_t h = 0; h < head; ++h) o[h] = static_cast<float>(o[h] / total);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace llama_jax

using namespace llama_jax;  // the handlers below name its functions

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlamaJaxAttend, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlamaJaxAttendBlock, AttendBlock,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlamaJaxAttendBlockGrads, AttendBlockGrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale"));
