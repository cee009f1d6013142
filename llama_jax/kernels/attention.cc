// Causal attention for a block of query positions (prefill, scoring, `forward`), called from jitted code through
// XLA's FFI: out[b, t, n] = softmax_s(q[b, t, n] · k[b, n / G, s] / sqrt(H), s <= pos[b, t]) · v[b, n / G, s], and
// with a sliding window (window > 0) s > pos[b, t] - window too (Mistral's).
//
// Query t attends to the key slots 0..pos[b, t] only, and the work follows: a block of queries computes its scores
// up to the block's last position and no further, so the half of the T × T square that the causal mask hides is
// never computed (XLA's path computes the whole square and masks it). Per item (sequence b, key/value head j, a
// block of query positions): the keys' panels are packed once for the G query heads of the group, the scores are a
// product (gemm.h) kept in a thread's scratch (rows × slots, in L2), each row's softmax is taken over its own slots,
// and the probabilities times the values are a second product.
//
// Order (batch invariance): a row's scores are H fused multiply-adds in order; its softmax takes the maximum, then
// exp(score - max) (the same polynomial, lane for lane, with AVX-512 and AVX2), then their sum in slot order, then
// each divided by the sum; its output is gemm.h's chunked sum over the slots. Slots past the row's own position
// within the block hold probability 0, which adds exact zeros: a row's bits depend on its position alone, not on
// the block, the batch, T or the thread.
#include "gemm.h"

namespace llama_jax {
namespace {  // this file's own

// One row of scores [first, len) (first < len) into probabilities, in place; [0, first) and [len, width) set to 0
inline void Softmax(float* row, int64_t first, int64_t len, int64_t width, float scale) {
  std::fill(row, row + first, 0.0f);
  row += first, len -= first, width -= first;
  float top = -INFINITY;
  for (int64_t s = 0; s < len; ++s) top = std::max(top, row[s] *= scale);
  int64_t s = 0;
  for (; s + kLanes <= len; s += kLanes) VStoreU(row + s, ExpNonPositive(VAdd(VLoadU(row + s), VSet(-top))));
  if (s < len) {  // the tail: the same lanes, the rest of the register unused
    alignas(64) float tail[kLanes] = {};
    std::memcpy(tail, row + s, (len - s) * sizeof(float));
    VStoreU(tail, ExpNonPositive(VAdd(VLoadU(tail), VSet(-top))));
    std::memcpy(row + s, tail, (len - s) * sizeof(float));
  }
  float total = 0.0f;
  for (s = 0; s < len; ++s) total += row[s];
  for (s = 0; s < len; ++s) row[s] /= total;
  std::fill(row + len, row + width, 0.0f);
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
  const int64_t width = (slots + kNR - 1) / kNR * kNR;  // a score row, padded to whole panels
  // queries per block: a multiple of kMR, the block's scores (G x rows x width) at most 256 K floats (1 MB)
  const int64_t fit = std::max<int64_t>(1, (int64_t{1} << 18) / (group * width) / kMR) * kMR;
  const int64_t block = std::min<int64_t>(fit, 4 * kMR);
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
    int64_t len = 0;  // the slots this block reads: up to its last position
    for (int64_t t = t0; t < t1; ++t) len = std::max<int64_t>(len, row_pos[t] + 1);
    const int64_t panels = (len + kNR - 1) / kNR, used = panels * kNR;
    const float* keys = keys_all + (b * kv + j) * slots * head;
    const float* values = values_all + (b * kv + j) * slots * head;
    const int64_t value_panels = (head + kNR - 1) / kNR;
    float* scores = Scratch(group * rows * used + std::max(panels, value_panels) * kKC * kNR + kNR * kKC);
    float* panel = scores + group * rows * used;  // [panels, head, kNR]: the keys (head <= kKC) or the values
    float* pack_scratch = panel + std::max(panels, value_panels) * kKC * kNR;
    const HeldRows<F32> key_rows{reinterpret_cast<const uint8_t*>(keys), head},
        value_rows{reinterpret_cast<const uint8_t*>(values), head};
    const float* q_at = queries + ((b * t_len + t0) * heads + j * group) * head;  // row t, head i: + (t·N + i)·H
    // scores[i][r][s] = q[t0 + r, jG + i] · k[s], chunk by chunk of the head's values
    for (int64_t h0 = 0; h0 < head; h0 += kKC) {
      const int64_t hc = std::min(kKC, head - h0);
      for (int64_t p = 0; p < panels; ++p) {
        Pack(key_rows, false, p * kNR, std::min(kNR, len - p * kNR), h0, hc, panel + p * kKC * kNR, pack_scratch);
      }
      for (int64_t i = 0; i < group; ++i) {
        for (int64_t m = 0; m < rows; m += kMR) {
          const MicroFn micro = kMicro[std::min<int64_t>(kMR, rows - m) - 1];
          for (int64_t p = 0; p < panels; ++p) {
            micro(q_at + (m * heads + i) * head + h0, heads * head, panel + p * kKC * kNR, hc,
                  scores + (i * rows + m) * used + p * kNR, used, kNR, h0 > 0);
          }
        }
      }
    }
    for (int64_t i = 0; i < group; ++i) {
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t end = row_pos[t0 + r] + 1, first = window > 0 ? std::max<int64_t>(0, end - window) : 0;
        Softmax(scores + (i * rows + r) * used, first, end, used, scale);  // the slots before `first`: 0, exactly
      }
    }
    // out[t0 + r, jG + i] = probabilities[i][r] · v, chunk by chunk of the slots
    float* out_at = results + ((b * t_len + t0) * heads + j * group) * head;
    for (int64_t s0 = 0; s0 < len; s0 += kKC) {
      const int64_t sc = std::min(kKC, len - s0);
      for (int64_t p = 0; p < value_panels; ++p) {
        Pack(value_rows, true, p * kNR, std::min(kNR, head - p * kNR), s0, sc, panel + p * kKC * kNR, pack_scratch);
      }
      for (int64_t i = 0; i < group; ++i) {
        for (int64_t m = 0; m < rows; m += kMR) {
          const MicroFn micro = kMicro[std::min<int64_t>(kMR, rows - m) - 1];
          for (int64_t p = 0; p < value_panels; ++p) {
            micro(scores + (i * rows + m) * used + s0, used, panel + p * kKC * kNR, sc,
                  out_at + (m * heads + i) * head + p * kNR, heads * head, std::min(kNR, head - p * kNR), s0 > 0);
          }
        }
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
