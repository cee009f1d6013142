// Kernels of a decode step (one new position per sequence), called from jitted code through XLA's FFI.
//
// Matvec: y[b, o] = sum_i W[layer, o, i] * x[b, i], read straight from the stacked weights (no copy of the
// layer's slice, which XLA makes for a dynamic slice), in f32 or bf16 (widened in registers: half the bytes
// read), each row of W read once for all B sequences, the rows split over the intra-op thread pool.
// Memory-bound: decode at batch 1 reads every weight once per token.
//
// Attend: one query position per sequence against the keys and values in the cache, read in place (the layer's
// slice of the cache is not copied), each query head j·G + i against key/value head j, over the slots up to the
// sequence's own position.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxBatch = 8;  // sequences per pass over the rows; more take another pass

inline float HorizontalSum(__m256 v) {
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

// rows [o0, o1) of w ([O, I]) against NB sequences of x ([NB, I]) into y ([NB, O], row stride `out`); NB is a
// template argument so that the accumulators stay in registers
template <int NB, typename W>
void RowsFixed(const W* w, const float* x, float* y, int64_t out, int64_t in, int64_t o0, int64_t o1) {
  const int64_t vec = in - in % 8;
  constexpr int kChains = NB == 1 ? 4 : 1;  // one sequence: four chains for instruction-level parallelism
  for (int64_t o = o0; o < o1; ++o) {
    const W* row = w + o * in;
    __m256 acc[NB][kChains];
    for (int b = 0; b < NB; ++b)
      for (int c = 0; c < kChains; ++c) acc[b][c] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 * kChains <= vec; i += 8 * kChains) {
      for (int c = 0; c < kChains; ++c) {
        const __m256 wv = Load8(row + i + 8 * c);
        for (int b = 0; b < NB; ++b) acc[b][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * in + i + 8 * c), acc[b][c]);
      }
    }
    for (; i < vec; i += 8) {
      const __m256 wv = Load8(row + i);
      for (int b = 0; b < NB; ++b) acc[b][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * in + i), acc[b][0]);
    }
    for (int b = 0; b < NB; ++b) {
      __m256 total = acc[b][0];
      for (int c = 1; c < kChains; ++c) total = _mm256_add_ps(total, acc[b][c]);
      float sum = HorizontalSum(total);
      for (int64_t j = vec; j < in; ++j) sum += Widen(row[j]) * x[b * in + j];
      y[b * out + o] = sum;
    }
  }
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
  const W* weights = reinterpret_cast<const W*>(w.typed_data()) + static_cast<int64_t>(l) * out * in;
  const float* xs = x.typed_data();
  float* ys = y->typed_data();

  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), out / 64));
  for (int64_t b0 = 0; b0 < batch; b0 += kMaxBatch) {
    const int64_t nb = std::min(kMaxBatch, batch - b0);
    const float* xb = xs + b0 * in;
    float* yb = ys + b0 * out;
    std::atomic<int64_t> pending(parts - 1);
    for (int64_t p = 1; p < parts; ++p) {
      pool.Schedule([=, &pending] {
        Rows(weights, xb, yb, nb, out, in, out * p / parts, out * (p + 1) / parts);
        pending.fetch_sub(1, std::memory_order_release);
      });
    }
    Rows(weights, xb, yb, nb, out, in, 0, out / parts);
    while (pending.load(std::memory_order_acquire) > 0) _mm_pause();
  }
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
