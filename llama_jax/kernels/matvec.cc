// y[b, o] = sum_i W[layer, o, i] * x[b, i]: one decode step's matrix products, read straight from the stacked
// weights (no copy of the layer's slice, which XLA makes for a dynamic slice), in f32 or bf16 (widened in
// registers: half the bytes read), each row of W read once for all B sequences, the rows split over the intra-op
// thread pool. Memory-bound: decode at batch 1 reads every weight once per token.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxBatch = 16;  // sequences per pass over the rows; more take another pass

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

// rows [o0, o1) of w ([O, I]) against the batch x ([B, I], B <= kMaxBatch) into y ([B, O])
template <typename W>
void Rows(const W* w, const float* x, float* y, int64_t batch, int64_t out, int64_t in, int64_t o0, int64_t o1) {
  const int64_t vec = in - in % 8;
  for (int64_t o = o0; o < o1; ++o) {
    const W* row = w + o * in;
    if (batch == 1) {  // four chains for instruction-level parallelism
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 32 <= vec; i += 32) {
        a0 = _mm256_fmadd_ps(Load8(row + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(Load8(row + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(Load8(row + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(Load8(row + i + 24), _mm256_loadu_ps(x + i + 24), a3);
      }
      for (; i < vec; i += 8) a0 = _mm256_fmadd_ps(Load8(row + i), _mm256_loadu_ps(x + i), a0);
      float sum = HorizontalSum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      for (; i < in; ++i) sum += Widen(row[i]) * x[i];
      y[o] = sum;
      continue;
    }
    __m256 acc[kMaxBatch];
    for (int64_t b = 0; b < batch; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < vec; i += 8) {
      const __m256 wv = Load8(row + i);
      for (int64_t b = 0; b < batch; ++b) acc[b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * in + i), acc[b]);
    }
    for (int64_t b = 0; b < batch; ++b) {
      float sum = HorizontalSum(acc[b]);
      for (int64_t i = vec; i < in; ++i) sum += Widen(row[i]) * x[b * in + i];
      y[b * out + o] = sum;
    }
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

}  // namespace

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
