// Causal attention for a block of query positions (prefill, scoring, `forward`), called from jitted code through
// XLA's FFI: out[b, t, n] = softmax_s(q[b, t, n] · k[b, n / G, s] / sqrt(H), s <= pos[b, t]) · v[b, n / G, s], and
// with a sliding window (window > 0) s > pos[b, t] - window too (Mistral's).
//
// Query t attends to the key slots 0..pos[b, t] only, and the work follows: a block of queries computes its scores
// up to the block's last position and no further, so the half of the T × T square that the causal mask hides is
// never computed (XLA's path computes the whole square and masks it). Per item (sequence b, key/value head j, a
// block of 48 query positions), over the slots in chunks of kSlots (192) counted from slot 0: the chunk's keys are
// packed once for the G query heads of the group, its scores are a product (gemm.h) kept in a thread's scratch
// (G x 48 x 192 floats, in L2 at any length), each row's softmax is taken online (a running maximum m and sum l:
// the row's output and l are multiplied by exp(m_old - m_new) when the maximum grows), and the exponentials times
// the chunk's values are added by a second product; at the end each output is divided by its l. A whole T × T
// square of scores (at 8,000 positions several MB a block) is never held.
//
// Order (batch invariance): a row's scores are H fused multiply-adds in order; per chunk its maximum, exp(score -
// m) (the same polynomial, lane for lane, with AVX-512 and AVX2), their sum (in double: 16 lanes over the chunk's
// slots, then the lanes in order) added to l times the factor, its output times the factor plus the chunk's product
// (gemm.h's sum over its slots); at the end the output divided by l in double, rounded once. (l in f32, summed in
// lanes, left one of the real model's activations past the parity test's bound: the order and the accuracy of this
// sum matter there.) Slots outside the
// row's window (past its own position, before its first) hold exactly 0 and a chunk without any of its slots changes
// nothing: a row's bits depend on its position alone (the chunks are fixed by slot numbers), not on the block, the
// batch, T or the thread.
#include "gemm.h"

namespace llama_jax {
namespace {  // this file's own

// 16 double lanes (one sum per slot lane: two zmm or four ymm), each adding its floats in order: the same bits on
// both instruction sets; their sum in lane order
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
inline Doubles16 AddDoubles16(Doubles16 d, const float* v) {  // lane l += v[l], widened exactly
#ifdef __AVX512F__
  for (int k = 0; k < 2; ++k) d.part[k] = _mm512_add_pd(d.part[k], _mm512_cvtps_pd(_mm256_loadu_ps(v + 8 * k)));
#else
  for (int k = 0; k < 4; ++k) d.part[k] = _mm256_add_pd(d.part[k], _mm256_cvtps_pd(_mm_loadu_ps(v + 4 * k)));
#endif
  return d;
}
inline double SumDoubles16(Doubles16 d) {
  alignas(64) double lanes[16];
  std::memcpy(lanes, d.part, sizeof lanes);
  double sum = 0.0;
  for (const double lane : lanes) sum += lane;
  return sum;
}

constexpr int64_t kSlots = kKC;  // the key slots of a chunk (whole panels), counted from slot 0 for every row

// One row's scores over a chunk's slots [0, n) into exp(score · scale - its new running maximum), in place, and
// exactly 0 outside [lo, hi) (before the row's first slot, past its own position) and on to the next 16; the row's
// running maximum and sum updated, and the factor its output is to be multiplied by returned: the row's softmax,
// online. The sum is in double, nearly exact: 16 lanes (slot s in lane s mod 16, the chunk's slots in order), then
// the lanes in order.
inline float Exponentials(float* row, int64_t lo, int64_t hi, int64_t n, float scale, float& top, double& total) {
  const int64_t width = (n + 15) / 16 * 16;
  if (lo >= hi) {  // no slot of the row here: nothing added, nothing rescaled
    std::fill(row, row + width, 0.0f);
    return 1.0f;
  }
  std::fill(row, row + lo, -INFINITY);  // exp(-inf) is 0 (ExpNonPositive's underflow)
  for (int64_t s = lo; s < hi; ++s) row[s] *= scale;
  std::fill(row + hi, row + width, -INFINITY);
  V16 high = Splat16(-INFINITY);
  for (int64_t s = 0; s < width; s += 16) {
    const V16 v = Load16(row + s);
    for (int k = 0; k < kParts; ++k) high.part[k] = VMax(high.part[k], v.part[k]);
  }
  alignas(64) float lanes[16];
  Store16(lanes, high);
  const float new_top = std::max(top, *std::max_element(lanes, lanes + 16));  // a maximum: any order, exact
  alignas(64) float factor[kLanes] = {};  // exp(top - new_top): 0 at the row's first chunk (top = -inf)
  factor[0] = top - new_top;
  VStoreU(factor, ExpNonPositive(VLoadU(factor)));
  top = new_top;
  Doubles16 sum = ZeroDoubles16();
  for (int64_t s = 0; s < width; s += 16) {
    V16 v = Load16(row + s);
    for (int k = 0; k < kParts; ++k) v.part[k] = ExpNonPositive(VAdd(v.part[k], VSet(-top)));
    Store16(row + s, v);
    sum = AddDoubles16(sum, row + s);
  }
  total = total * factor[0] + SumDoubles16(sum);
  return factor[0];
}

ffi::Error AttendBlock(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out,
                       int64_t window) {
  const auto qd = q.dimensions(), kd = k.dimensions(), pd = pos.dimensions();
  if (qd.size() < 3 || kd.size() != qd.size() || pd.size() + 2 != qd.size()) {
    return ffi::Error::InvalidArgument("llama_jax attend_block: expected q [..., T, N, H], k and v [..., K, S, H], pos [..., T]");
  }
  const size_t lead = qd.size() - 3;
  int64_t batch = 1;
  for (size_t d = 0; d < lead; ++d) {
    if (kd[d] != qd[d] || pd[d] != qd[d]) return ffi::Error::InvalidArgument("llama_jax attend_block: batch sizes differ");
    batch *= qd[d];
  }
  const int64_t t_len = qd[lead], heads = qd[lead + 1], head = qd[lead + 2];
  const int64_t kv = kd[lead], slots = kd[lead + 1];
  if (kd[lead + 2] != head || pd[lead] != t_len || kv == 0 || heads % kv != 0) {
    return ffi::Error::InvalidArgument("llama_jax attend_block: q, k, v and pos do not fit together");
  }
  const int32_t* positions = pos.typed_data();
  for (int64_t r = 0; r < batch * t_len; ++r) {
    if (positions[r] < 0 || positions[r] >= slots) {
      return ffi::Error::InvalidArgument("llama_jax attend_block: a query position outside the key slots");
    }
  }
  if (batch * t_len == 0 || heads == 0 || head == 0) return ffi::Error::Success();
  const int64_t group = heads / kv;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head)));
  const int64_t block = 4 * kMR;  // queries per item: their scores over one chunk of slots, G x 48 x 192, in L2
  const int64_t blocks = (t_len + block - 1) / block;
  const float *queries = q.typed_data(), *keys_all = k.typed_data(), *values_all = v.typed_data();
  float* results = out->typed_data();
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
      start = std::min<int64_t>(start, window > 0 ? std::max<int64_t>(0, row_pos[t] + 1 - window) : 0);
    }
    const float* keys = keys_all + (b * kv + j) * slots * head;
    const float* values = values_all + (b * kv + j) * slots * head;
    const int64_t value_panels = (head + kNR - 1) / kNR;
    const int64_t panel_floats = std::max(kSlots / kNR, value_panels) * kKC * kNR;
    // 64-byte aligned pieces (a panel's loads are aligned): the chunk's keys (head <= kKC at a time) or values,
    // the pack's scratch, the scores [G, rows, kSlots], each row's running maximum and its sum
    float* panel = Scratch(panel_floats + kNR * kKC + group * rows * (kSlots + 3));
    float* pack_scratch = panel + panel_floats;
    float* scores = pack_scratch + kNR * kKC;
    float* tops = scores + group * rows * kSlots;
    double* totals = reinterpret_cast<double*>(tops + group * rows + (group * rows) % 2);
    std::fill(tops, tops + group * rows, -INFINITY);
    std::fill(totals, totals + group * rows, 0.0);
    const HeldRows<F32> key_rows{reinterpret_cast<const uint8_t*>(keys), head},
        value_rows{reinterpret_cast<const uint8_t*>(values), head};
    const float* q_at = queries + ((b * t_len + t0) * heads + j * group) * head;  // row t, head i: + (t·N + i)·H
    float* out_at = results + ((b * t_len + t0) * heads + j * group) * head;
    for (int64_t r = 0; r < rows; ++r) std::fill(out_at + r * heads * head, out_at + (r * heads + group) * head, 0.0f);
    for (int64_t s0 = start / kSlots * kSlots; s0 < len; s0 += kSlots) {  // chunks at multiples of kSlots
      const int64_t n = std::min(kSlots, len - s0), panels = (n + kNR - 1) / kNR;
      // scores[i][r][s] = q[t0 + r, jG + i] · k[s0 + s], chunk by chunk of the head's values
      for (int64_t h0 = 0; h0 < head; h0 += kKC) {
        const int64_t hc = std::min(kKC, head - h0);
        for (int64_t p = 0; p < panels; ++p) {
          Pack(key_rows, false, s0 + p * kNR, std::min(kNR, n - p * kNR), h0, hc, panel + p * kKC * kNR, pack_scratch);
        }
        for (int64_t i = 0; i < group; ++i) {
          for (int64_t m = 0; m < rows; m += kMR) {
            const MicroFn micro = kMicro[std::min<int64_t>(kMR, rows - m) - 1];
            for (int64_t p = 0; p < panels; ++p) {
              micro(q_at + (m * heads + i) * head + h0, heads * head, panel + p * kKC * kNR, hc,
                    scores + (i * rows + m) * kSlots + p * kNR, kSlots, kNR, h0 > 0);
            }
          }
        }
      }
      for (int64_t i = 0; i < group; ++i) {
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t end = row_pos[t0 + r] + 1, first = window > 0 ? std::max<int64_t>(0, end - window) : 0;
          const int64_t lo = std::clamp<int64_t>(first - s0, 0, n), hi = std::clamp<int64_t>(end - s0, 0, n);
          const float factor = Exponentials(scores + (i * rows + r) * kSlots, lo, hi, n, scale, tops[i * rows + r],
                                            totals[i * rows + r]);
          if (factor != 1.0f) {
            float* o = out_at + (r * heads + i) * head;
            for (int64_t h = 0; h < head; ++h) o[h] *= factor;
          }
        }
      }
      // out[t0 + r, jG + i] += exponentials[i][r] · v[s0..], the chunk's slots in one product's sum
      for (int64_t p = 0; p < value_panels; ++p) {
        Pack(value_rows, true, p * kNR, std::min(kNR, head - p * kNR), s0, n, panel + p * kKC * kNR, pack_scratch);
      }
      for (int64_t i = 0; i < group; ++i) {
        for (int64_t m = 0; m < rows; m += kMR) {
          const MicroFn micro = kMicro[std::min<int64_t>(kMR, rows - m) - 1];
          for (int64_t p = 0; p < value_panels; ++p) {
            micro(scores + (i * rows + m) * kSlots, kSlots, panel + p * kKC * kNR, n,
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

}  // namespace
}  // namespace llama_jax

using namespace llama_jax;  // the handler below names its function

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlamaJaxAttendBlock, AttendBlock,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window"));
