// Products of a block of positions by one weight matrix, called from jitted code through XLA's FFI: the layers and
// the LM head of prefill, scoring and `forward` (activations), and the input's gradient of each (a custom VJP).
//
// Product: y[m, o] = sum_i x[m, i] * W[o, i] (transpose = false: x · Wᵀ, W stored [O, I] as nn.Linear's), or
// y[m, i] = sum_o x[m, o] * W[o, i] (transpose = true: the gradient of x · Wᵀ with respect to x), for every row m
// of x (the positions of every sequence, flattened). W is one layer's matrix as the model holds it: f32, bf16 or
// f16, or ggml's blocks of 32 (Q4_0, Q4_1, Q8_0) widened to exactly the loader's f32 values (common.h), so a
// product on stored weights is bit for bit this kernel's product on their dequantized copy.
//
// How (a register-blocked GEMM, as BLIS and MKL do it): the inner dimension is cut into chunks of kKC. For each
// chunk a thread widens its columns of W into panels of kNR columns × kKC, laid out so that one inner index's kNR
// values are adjacent (kNR = 32 with AVX-512, 16 with AVX2), and runs a microkernel of kMR rows × kNR columns over
// them (12 × 32: 24 zmm accumulators; 6 × 16: 12 ymm): per inner index, two panel loads, one broadcast of x per
// row, two fused multiply-adds per row. Only a thread's current panels exist in f32 at any moment (a few hundred
// KB, in L2): never a dequantized copy of a matrix.
//
// Contracts:
// - Order: every y[m, n] is, for the chunks c = 0, 1, ... in turn, p_c = its kKC products fused-multiply-added
//   from zero in ascending order, then y = p_0, y = y + p_1, ...: an order fixed by the inner dimension alone,
//   whatever the rows, a row's place among them, the threads and the instruction set (AVX-512 and AVX2 give the
//   same bits). Batch invariance follows. Accuracy: a chunk is a straight f32 sum and the chunks add once more,
//   about the error of a straight f32 sum of the whole (tests/test_kernels.py measures it against float64).
// - Threads: items of (a block of rows, a group of column panels), claimed as decode.cc's are (RunItems).
#include <array>
#include <utility>

#include "common.h"
#include "handlers.h"

namespace llama_jax {
namespace {  // this file's own

#ifdef __AVX512F__
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int kMR = 12;
inline Vec VZero() { return _mm512_setzero_ps(); }
inline Vec VLoad(const float* p) { return _mm512_load_ps(p); }
inline Vec VLoadU(const float* p) { return _mm512_loadu_ps(p); }
inline void VStoreU(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec VSet(float a) { return _mm512_set1_ps(a); }
inline Vec VFma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec VAdd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline void Store16(float* p, V16 v) { _mm512_storeu_ps(p, v.v); }
#else
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kMR = 6;
inline Vec VZero() { return _mm256_setzero_ps(); }
inline Vec VLoad(const float* p) { return _mm256_load_ps(p); }
inline Vec VLoadU(const float* p) { return _mm256_loadu_ps(p); }
inline void VStoreU(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec VSet(float a) { return _mm256_set1_ps(a); }
inline Vec VFma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec VAdd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline void Store16(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
#endif
constexpr int64_t kNR = 2 * kLanes;  // columns of a panel: two registers
constexpr int64_t kKC = 192;         // inner indices per chunk (a multiple of 32: whole blocks)

// W held as elements of type T, [O, I]: Read gives row o's values i0..i0+n-1 in f32
template <typename T>
struct ElementRows {
  const T* w;
  int64_t cols;
  void Read(int64_t o, int64_t i0, int64_t n, float* out) const {
    const T* row = w + o * cols + i0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) Store16(out + i, Load16(row + i));
    for (; i < n; ++i) out[i] = Widen(row[i]);
  }
};

// W held in blocks of format F, [O, I / 32, F::kBytes]
template <typename F>
struct BlockRows {
  const uint8_t* w;
  int64_t cols;
  void Read(int64_t o, int64_t i0, int64_t n, float* out) const {
    const uint8_t* row = w + o * (cols / 32) * F::kBytes;
    for (int64_t b = i0 / 32; b * 32 < i0 + n; ++b) {
      V16 v[2];
      F::Widen32(row + b * F::kBytes, v);
      const int64_t lo = std::max(i0, b * 32), hi = std::min(i0 + n, b * 32 + 32);
      if (hi - lo == 32) {
        Store16(out + lo - i0, v[0]);
        Store16(out + lo - i0 + 16, v[1]);
        continue;
      }
      alignas(64) float values[32];
      Store16(values, v[0]);
      Store16(values + 16, v[1]);
      std::memcpy(out + lo - i0, values + lo - b * 32, (hi - lo) * sizeof(float));
    }
  }
};

// The panel of columns n0..n0+cols-1 (cols <= kNR; zeros after) over inner indices k0..k0+kc-1:
// panel[k * kNR + j] = B(k0 + k, n0 + j), where B(k, n) = W[n, k] (x · Wᵀ) or W[k, n] (transpose)
template <typename Rows>
void Pack(const Rows& w, bool transpose, int64_t n0, int64_t cols, int64_t k0, int64_t kc, float* panel,
          float* scratch) {
  if (transpose) {  // inner index k is row k of W: its columns n0.. are adjacent
    for (int64_t k = 0; k < kc; ++k) {
      w.Read(k0 + k, n0, cols, panel + k * kNR);
      std::fill(panel + k * kNR + cols, panel + (k + 1) * kNR, 0.0f);
    }
    return;
  }
  for (int64_t j = 0; j < cols; ++j) w.Read(n0 + j, k0, kc, scratch + j * kc);  // [cols, kc]: rows of W
  for (int64_t k = 0; k < kc; ++k) {
    float* line = panel + k * kNR;
    for (int64_t j = 0; j < cols; ++j) line[j] = scratch[j * kc + k];
    std::fill(line + cols, line + kNR, 0.0f);
  }
}

// MR rows of x (row stride ldx, at the chunk's first inner index) against one panel: the chunk's partial sums,
// written to y (the first chunk) or added to it (row stride ldy; cols valid columns)
template <int MR>
void Micro(const float* x, int64_t ldx, const float* panel, int64_t kc, float* y, int64_t ldy, int64_t cols,
           bool add) {
  Vec acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = VZero();
  for (int64_t k = 0; k < kc; ++k) {
    const Vec b0 = VLoad(panel + k * kNR), b1 = VLoad(panel + k * kNR + kLanes);
    for (int r = 0; r < MR; ++r) {
      const Vec a = VSet(x[r * ldx + k]);
      acc[r][0] = VFma(a, b0, acc[r][0]);
      acc[r][1] = VFma(a, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* out = y + r * ldy;
    if (cols == kNR) {
      if (add) {
        acc[r][0] = VAdd(VLoadU(out), acc[r][0]);
        acc[r][1] = VAdd(VLoadU(out + kLanes), acc[r][1]);
      }
      VStoreU(out, acc[r][0]);
      VStoreU(out + kLanes, acc[r][1]);
      continue;
    }
    alignas(64) float part[kNR];
    VStoreU(part, acc[r][0]);
    VStoreU(part + kLanes, acc[r][1]);
    for (int64_t j = 0; j < cols; ++j) out[j] = add ? out[j] + part[j] : part[j];
  }
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, bool);
template <size_t... R>
constexpr std::array<MicroFn, sizeof...(R)> MicroTable(std::index_sequence<R...>) {
  return {&Micro<static_cast<int>(R) + 1>...};
}
constexpr auto kMicro = MicroTable(std::make_index_sequence<kMR>());  // kMicro[r - 1]: r rows

// A thread's panels (and the forward pack's scratch rows), 64-byte aligned, kept for its next items
float* Scratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats + 16) buffer.resize(floats + 16);
  const auto at = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((at + 63) / 64 * 64);
}

// y [rows, n_cols] = x [rows, k_inner] times B (see Pack), on the pool's threads
template <typename Rows>
void RunProduct(ffi::ThreadPool& pool, Rows w, bool transpose, const float* x, float* y, int64_t rows,
                int64_t n_cols, int64_t k_inner) {
  if (rows == 0 || n_cols == 0) return;
  if (k_inner == 0) {
    std::fill(y, y + rows * n_cols, 0.0f);
    return;
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t panels = (n_cols + kNR - 1) / kNR;
  // about 8 items a thread (load balance): groups of up to 8 panels (the rows' x reused from L1 across them);
  // where the columns give too few, the rows are split too (each row block widens the weights again)
  const int64_t group = std::clamp<int64_t>(panels / (8 * threads), 1, 8);
  const int64_t col_items = (panels + group - 1) / group;
  int64_t row_blocks = 1;
  if (col_items < 8 * threads) {
    row_blocks = std::clamp<int64_t>((8 * threads + col_items - 1) / col_items, 1, std::max<int64_t>(1, rows / (4 * kMR)));
  }
  const int64_t block_rows = ((rows + row_blocks - 1) / row_blocks + kMR - 1) / kMR * kMR;
  row_blocks = (rows + block_rows - 1) / block_rows;
  auto work = std::make_shared<Items>();
  work->items = col_items * row_blocks;
  work->run = [=](int64_t item) {
    const int64_t p0 = (item % col_items) * group, p1 = std::min(panels, p0 + group);
    const int64_t r0 = (item / col_items) * block_rows, r1 = std::min(rows, r0 + block_rows);
    float* panel = Scratch((p1 - p0 + 1) * kKC * kNR);  // [p1 - p0, kKC, kNR] and the scratch rows
    float* scratch = panel + (p1 - p0) * kKC * kNR;
    for (int64_t k0 = 0; k0 < k_inner; k0 += kKC) {
      const int64_t kc = std::min(kKC, k_inner - k0);
      for (int64_t p = p0; p < p1; ++p) {
        Pack(w, transpose, p * kNR, std::min(kNR, n_cols - p * kNR), k0, kc, panel + (p - p0) * kKC * kNR, scratch);
      }
      for (int64_t m = r0; m < r1; m += kMR) {
        const MicroFn micro = kMicro[std::min<int64_t>(kMR, r1 - m) - 1];
        for (int64_t p = p0; p < p1; ++p) {
          micro(x + m * k_inner + k0, k_inner, panel + (p - p0) * kKC * kNR, kc, y + m * n_cols + p * kNR, n_cols,
                std::min(kNR, n_cols - p * kNR), k0 > 0);
        }
      }
    }
  };
  RunItems(pool, work);
}

// The sizes of a product by W [O, I]: x [..., K] and y [..., N] with K, N = I, O (O, I transposed); rows = the
// rows of x. A message where they do not fit.
const char* Sizes(int64_t o, int64_t i, ffi::Span<const int64_t> xd, ffi::Span<const int64_t> yd, bool transpose,
                  int64_t& rows) {
  const int64_t k = transpose ? o : i, n = transpose ? i : o;
  if (xd.size() == 0 || yd.size() != xd.size() || xd.back() != k || yd.back() != n) {
    return "llama_jax product: expected x [..., K] and y [..., N] with K, N the matrix's (I, O; O, I transposed)";
  }
  rows = 1;
  for (size_t d = 0; d + 1 < xd.size(); ++d) {
    if (xd[d] != yd[d]) return "llama_jax product: x and y differ in their leading dimensions";
    rows *= xd[d];
  }
  return nullptr;
}

// whether dims has at least `trailing` dimensions and the others (a vmapped call's) are all 1
bool LeadingOnes(ffi::Span<const int64_t> dims, size_t trailing) {
  if (dims.size() < trailing) return false;
  for (size_t d = 0; d + trailing < dims.size(); ++d) {
    if (dims[d] != 1) return false;
  }
  return true;
}

// weights of one element type: w [..., O, I] of T (C++ type W)
template <ffi::DataType T, typename W>
ffi::Error ProductElements(ffi::ThreadPool pool, ffi::Buffer<T> w, ffi::Buffer<ffi::F32> x,
                           ffi::ResultBuffer<ffi::F32> y, bool transpose) {
  const auto wd = w.dimensions();
  if (!LeadingOnes(wd, 2)) return ffi::Error::InvalidArgument("llama_jax product: expected one matrix w [O, I]");
  const int64_t o = wd[wd.size() - 2], i = wd[wd.size() - 1];
  int64_t rows = 0;
  if (const char* e = Sizes(o, i, x.dimensions(), y->dimensions(), transpose, rows)) {
    return ffi::Error::InvalidArgument(e);
  }
  RunProduct(pool, ElementRows<W>{static_cast<const W*>(w.untyped_data()), i}, transpose, x.typed_data(),
             y->typed_data(), rows, transpose ? i : o, transpose ? o : i);
  return ffi::Error::Success();
}

// weights in blocks of 32 of format F: w [..., O, I / 32, F::kBytes] bytes
template <typename F>
ffi::Error ProductBlocks(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> x,
                         ffi::ResultBuffer<ffi::F32> y, bool transpose) {
  const auto wd = w.dimensions();
  if (!LeadingOnes(wd, 3) || wd[wd.size() - 1] != F::kBytes) {
    return ffi::Error::InvalidArgument("llama_jax product: expected one matrix of blocks w [O, I / 32, bytes]");
  }
  const int64_t o = wd[wd.size() - 3], i = wd[wd.size() - 2] * 32;
  int64_t rows = 0;
  if (const char* e = Sizes(o, i, x.dimensions(), y->dimensions(), transpose, rows)) {
    return ffi::Error::InvalidArgument(e);
  }
  RunProduct(pool, BlockRows<F>{w.typed_data(), i}, transpose, x.typed_data(), y->typed_data(), rows,
             transpose ? i : o, transpose ? o : i);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace llama_jax

using namespace llama_jax;  // the handlers below name its functions

#define LLAMA_JAX_PRODUCT(name, impl, dtype)                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                        \
                                ffi::Ffi::Bind()                  \
                                    .Ctx<ffi::ThreadPool>()       \
                                    .Arg<ffi::Buffer<dtype>>()    \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Attr<bool>("transpose"));

LLAMA_JAX_PRODUCT_KERNELS(LLAMA_JAX_PRODUCT)
