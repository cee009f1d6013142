// Kernels of a decode step (one new position per sequence), called from jitted code through XLA's FFI.
//
// Matvec: y[b, o] = sum_i W[layer, o, i] * x[b, i], read straight from the stacked weights (no copy of the
// layer's slice, which XLA makes for a dynamic slice), in f32 or bf16 (widened in registers: half the bytes
// read), each row of W read once for up to kMaxBatch sequences. Memory-bound: decode at batch 1 reads every
// weight once per token.
//
// Two contracts:
// - Batch invariance: every y[b, o] is summed in one order whatever the batch and the sequence's place in it:
//   one 8-lane accumulator over i (x[i..i+7] · w[i..i+7] fused-multiply-added lane by lane, i ascending), the
//   lanes added in one fixed tree, then the tail i >= in - in % 8 in order. Tiles of several rows or sequences
//   (for instruction-level parallelism) change which outputs run side by side, never an output's order.
// - Threads: the work is cut into items (a block of rows for up to kMaxBatch sequences) that the calling thread
//   and any pool workers claim from one atomic counter. The caller never waits for a task that has not started
//   (XLA's pool may have one thread, or be busy with other programs): it only waits for items that a running
//   worker has claimed. A task that starts after the call has returned finds no item left and touches nothing.
//
// Attend: one query position per sequence against the keys and values in the cache, read in place (the layer's
// slice of the cache is not copied), each query head j·G + i against key/value head j, over the slots up to the
// sequence's own position; each sequence alone, so batch-invariant too.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxBatch = 8;  // sequences per pass over the rows; more take another item

inline float HorizontalSum(__m256 v) {  // the one fixed tree: (l0+l4, l1+l5, l2+l6, l3+l7), then hadd twice
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 Load8(const uint16_t* p) {  // 8 bf16 -> 8 f32: the bf16 bits are the f32's upper half
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float Widen(float v) { return v; }
inline float Widen(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// rows [o, o + NR) of w ([O, I]) against NB sequences of x ([NB, I], row stride `in`) into y (row stride `out`);
// NR and NB are template arguments so that the NR x NB accumulators stay in registers
template <int NR, int NB, typename W>
inline void Tile(const W* w, const float* x, float* y, int64_t out, int64_t in, int64_t o) {
  const int64_t vec = in - in % 8;
  __m256 acc[NR][NB];
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm256_setzero_ps();
  for (int64_t i = 0; i < vec; i += 8) {
    __m256 xv[NB];
    for (int b = 0; b < NB; ++b) xv[b] = _mm256_loadu_ps(x + b * in + i);
    for (int r = 0; r < NR; ++r) {
      const __m256 wv = Load8(w + (o + r) * in + i);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm256_fmadd_ps(wv, xv[b], acc[r][b]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const W* row = w + (o + r) * in;
    for (int b = 0; b < NB; ++b) {
      float sum = HorizontalSum(acc[r][b]);
      for (int64_t j = vec; j < in; ++j) sum += Widen(row[j]) * x[b * in + j];
      y[b * out + o + r] = sum;
    }
  }
}

// rows [o0, o1) against NB sequences: tiles of NR rows (NR x NB <= 8 accumulators), the last rows one at a time
template <int NB, typename W>
void RowsFixed(const W* w, const float* x, float* y, int64_t out, int64_t in, int64_t o0, int64_t o1) {
  constexpr int NR = NB <= 2 ? 4 : NB <= 4 ? 2 : 1;
  int64_t o = o0;
  for (; o + NR <= o1; o += NR) Tile<NR, NB>(w, x, y, out, in, o);
  for (; o < o1; ++o) Tile<1, NB>(w, x, y, out, in, o);
}

template <typename W>
void Rows(const W* w, const float* x, float* y, int64_t batch, int64_t out, int64_t in, int64_t o0, int64_t o1) {
  switch (batch) {
    case 1: return RowsFixed<1>(w, x, y, out, in, o0, o1);
    case 2: return RowsFixed<2>(w, x, y, out, in, o0, o1);
    case 3: return RowsFixed<3>(w, x, y, out, in, o0, o1);
    case 4: return RowsFixed<4>(w, x, y, out, in, o0, o1);
    case 5: return RowsFixed<5>(w, x, y, out, in, o0, o1);
    case 6: return RowsFixed<6>(w, x, y, out, in, o0, o1);
    case 7: return RowsFixed<7>(w, x, y, out, in, o0, o1);
    default: return RowsFixed<8>(w, x, y, out, in, o0, o1);
  }
}

// One product's work, shared by the caller and the pool tasks it scheduled (which may outlive the call: they then
// find no item left). Item k is rows [chunk * (k % row_items), ...) of sequences [kMaxBatch * (k / row_items), ...).
template <typename W>
struct Work {
  const W* w;
  const float* x;
  float* y;
  int64_t batch, out, in, chunk, row_items, items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < items;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t b0 = kMaxBatch * (k / row_items), o0 = chunk * (k % row_items);
      Rows(w, x + b0 * in, y + b0 * out, std::min(kMaxBatch, batch - b0), out, in, o0, std::min(out, o0 + chunk));
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

template <ffi::DataType T>
ffi::Error Matvec(ffi::ThreadPool pool, ffi::Buffer<T> w, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> x,
                  ffi::ResultBuffer<ffi::F32> y) {
  using W = ffi::NativeType<T>;
  const auto wd = w.dimensions();
  const auto xd = x.dimensions();
  if (wd.size() != 3 || xd.size() != 2 || wd[2] != xd[1]) {
    return ffi::Error::InvalidArgument("llama_jax matvec: expected w [L, O, I] and x [B, I]");
  }
  const int64_t layers = wd[0], out = wd[1], in = wd[2], batch = xd[0];
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("llama_jax matvec: layer index out of range");
  if (out == 0 || batch == 0) return ffi::Error::Success();

  auto work = std::make_shared<Work<W>>();
  work->w = reinterpret_cast<const W*>(w.typed_data()) + static_cast<int64_t>(l) * out * in;
  work->x = x.typed_data();
  work->y = y->typed_data();
  work->batch = batch;
  work->out = out;
  work->in = in;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // about four items per thread (load balance), at least 32 rows each (the scheduling cost), a multiple of 8
  work->chunk = std::max<int64_t>(32, (out / (4 * threads) + 7) / 8 * 8);
  work->row_items = (out + work->chunk - 1) / work->chunk;
  work->items = work->row_items * ((batch + kMaxBatch - 1) / kMaxBatch);

  const int64_t helpers = std::min(threads, work->items) - 1;
  for (int64_t p = 0; p < helpers; ++p) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->items) _mm_pause();  // items claimed by running tasks
  return ffi::Error::Success();
}

// out[b, n] = softmax_s(q[b, n] · k[layer, b, n / G, s] / sqrt(H), s <= last[b]) · v[layer, b, n / G, s]
ffi::Error Attend(ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer,
                  ffi::Buffer<ffi::S32> last, ffi::Buffer<ffi::F32> q, ffi::ResultBuffer<ffi::F32> out) {
  const auto kd = k.dimensions();
  const auto qd = q.dimensions();
  if (kd.size() != 5 || qd.size() != 3 || kd[1] != qd[0] || kd[4] != qd[2] || qd[1] % kd[2] != 0) {
    return ffi::Error::InvalidArgument("llama_jax attend: expected caches [L, B, K, S, H] and q [B, N, H]");
  }
  const int64_t layers = kd[0], batch = kd[1], kv = kd[2], slots = kd[3], head = kd[4], heads = qd[1];
  const int64_t group = heads / kv;
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("llama_jax attend: layer index out of range");
  const float scale = 1.0f / std::sqrt(static_cast<float>(head));
  std::vector<float> scores(slots);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = std::min<int64_t>(slots, static_cast<int64_t>(last.typed_data()[b]) + 1);
    if (len < 1) return ffi::Error::InvalidArgument("llama_jax attend: a sequence without positions");
    for (int64_t n = 0; n < heads; ++n) {
      const int64_t base = ((static_cast<int64_t>(l) * batch + b) * kv + n / group) * slots * head;
      const float* keys = k.typed_data() + base;
      const float* values = v.typed_data() + base;
      const float* query = q.typed_data() + (b * heads + n) * head;
      float top = -INFINITY;
      for (int64_t s = 0; s < len; ++s) {
        float dot = 0.0f;
        for (int64_t h = 0; h < head; ++h) dot += query[h] * keys[s * head + h];
        scores[s] = dot * scale;
        top = std::max(top, scores[s]);
      }
      float total = 0.0f;
      for (int64_t s = 0; s < len; ++s) total += (scores[s] = std::exp(scores[s] - top));
      float* result = out->typed_data() + (b * heads + n) * head;
      std::fill(result, result + head, 0.0f);
      for (int64_t s = 0; s < len; ++s) {
        const float w = scores[s] / total;
        for (int64_t h = 0; h < head; ++h) result[h] += w * values[s * head + h];
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlamaJaxAttend, Attend,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#define LLAMA_JAX_MATVEC(name, dtype)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, Matvec<dtype>,                   \
                                ffi::Ffi::Bind()                       \
                                    .Ctx<ffi::ThreadPool>()            \
                                    .Arg<ffi::Buffer<dtype>>()         \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Arg<ffi::Buffer<ffi::F32>>()      \
                                    .Ret<ffi::Buffer<ffi::F32>>());

LLAMA_JAX_MATVEC(LlamaJaxMatvecF32, ffi::F32)
LLAMA_JAX_MATVEC(LlamaJaxMatvecBF16, ffi::BF16)

// The FFI API version these kernels were compiled against, checked at load against the running jaxlib's.
extern "C" int32_t LlamaJaxFfiApiVersion() { return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR; }
