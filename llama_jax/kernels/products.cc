// Products of a block of positions by one weight matrix, called from jitted code through XLA's FFI: the layers and
// the LM head of prefill, scoring and `forward` (activations), and the input's gradient of each and the float
// weights' (a custom VJP; WeightGrad, at the end).
//
// Product: y[m, o] = sum_i x[m, i] * W[o, i] (transpose = false: x · Wᵀ, W stored [O, I] as nn.Linear's), or
// y[m, i] = sum_o x[m, o] * W[o, i] (transpose = true: the gradient of x · Wᵀ with respect to x), for every row m
// of x (the positions of every sequence, flattened). W is one layer's matrix as the model holds it: f32, bf16 or
// f16, or ggml's blocks (Q4_0 .. Q8_0, Q4_K .. Q6_K) widened to exactly the loader's f32 values (held.h), so a
// product on stored weights is bit for bit this kernel's product on their dequantized copy. W is read in place:
// layer `layer` of the stacked weights [L, O, I] (a matrix alone: L = 1), not a copy XLA makes of a slice.
//
// How: a register-blocked GEMM (gemm.h). Only a thread's current panels exist in f32 at any moment (a few hundred
// KB, in L2): never a dequantized copy of a matrix.
//
// Contracts:
// - Order: gemm.h's, fixed by the inner dimension alone (chunks of kKC, each a straight fused-multiply-add sum):
//   batch invariance follows, and AVX-512 and AVX2 give the same bits. Accuracy: about a straight f32 sum's
//   (tests/test_products.py measures it against float64).
// - Threads: items of (a block of rows, a group of column panels), claimed as matvec.cc's are (RunItems).
#include "gemm.h"
#include "handlers.h"
#include "held.h"
#include "tiles.h"

namespace llama_jax {
namespace {  // this file's own

constexpr int64_t kWidestGroup = 16;  // panels an item packs: 16 x 24 KB of scratch, in L2

// y [rows, n_cols] = x [rows, k_inner] times B (see Pack), on the pool's threads. large_x_bytes: the size of a row
// block's x past which it is taken to stream from L3 or memory (a speed parameter, kernels/tuning.py: 16 x the L2;
// it changes the work's split, never a bit)
template <typename Rows>
void RunProduct(ffi::ThreadPool& pool, Rows w, bool transpose, const float* x, float* y, int64_t rows,
                int64_t n_cols, int64_t k_inner, int64_t large_x_bytes) {
  if (rows == 0 || n_cols == 0) return;
  if (k_inner == 0) {
    std::fill(y, y + rows * n_cols, 0.0f);
    return;
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t panels = (n_cols + kNR - 1) / kNR;
  // about 8 items a thread (load balance): groups of up to 8 panels (the rows' x reused from L1 across them);
  // where the columns give too few, the rows are split too (each row block widens the weights again)
  int64_t group = std::clamp<int64_t>(panels / (8 * threads), 1, 8);
  int64_t col_items = (panels + group - 1) / group;
  int64_t row_blocks = 1;
  if (col_items < 8 * threads) {
    row_blocks = std::clamp<int64_t>((8 * threads + col_items - 1) / col_items, 1, std::max<int64_t>(1, rows / (4 * kMR)));
  }
  const int64_t block_rows = ((rows + row_blocks - 1) / row_blocks + kMR - 1) / kMR * kMR;
  row_blocks = (rows + block_rows - 1) / block_rows;
  // A row block's x is read again by every column item; where it is large (the LM head's transposed product in a
  // gradient: 256 x 49152 floats, 50 MB, read by 18 items of one panel; 8000 rows of 576 inputs, 18 MB), the
  // columns go in as few items as keep every thread busy, a whole number of them each (at most kWidestGroup
  // panels an item)
  const bool large_x = block_rows * k_inner * static_cast<int64_t>(sizeof(float)) > large_x_bytes;
  // Wherever x's rows lie a multiple of 4 KB apart (the LM head's transposed product: 49152 floats; an 8B model's
  // 4096 and 14336 inputs), the microkernel reads them from a copy: the kMR rows it reads at once would fall in one
  // L1 set and evict each other at every step (Zen 4, Llama-3.1-8B's Q4_K layers at 256 rows, ab_kernels.py: 0.87-
  // 0.99 of the time in place, transposed 0.88-0.90; elsewhere x is read in place, as before)
  const bool copy_rows = k_inner % 1024 == 0;
  if (large_x) {
    const int64_t per_thread = (panels + threads * kWidestGroup - 1) / (threads * kWidestGroup);  // items
    group = std::max(group, (panels + threads * per_thread - 1) / (threads * per_thread));
    col_items = (panels + group - 1) / group;
  }
  auto work = std::make_shared<Items>();
  work->items = col_items * row_blocks;
  work->run = [=](int64_t item) {
    const int64_t p0 = (item % col_items) * group, p1 = std::min(panels, p0 + group);
    const int64_t r0 = (item / col_items) * block_rows, r1 = std::min(rows, r0 + block_rows);
    // [p1 - p0, kKC, kNR], the scratch rows, and x's rows copied (kMR x kKC)
    float* panel = Scratch((p1 - p0 + 1) * kKC * kNR + kMR * kKC);
    float* scratch = panel + (p1 - p0) * kKC * kNR;
    float* x_rows = scratch + kKC * kNR;
    const int64_t n0 = p0 * kNR, n1 = std::min(n_cols, p1 * kNR), tiles = (r1 - r0 + kMR - 1) / kMR;
    for (int64_t k0 = 0; k0 < k_inner; k0 += kKC) {
      const int64_t kc = std::min(kKC, k_inner - k0);
      for (int64_t p = p0; p < p1; ++p) {
        Pack(w, transpose, p * kNR, std::min(kNR, n_cols - p * kNR), k0, kc, panel + (p - p0) * kKC * kNR, scratch);
      }
      // the next chunk's pieces of W asked into L2 meanwhile, a share under each row tile: packed from memory, the
      // panels of F32 weights took 10% of a 256-row product's time (W's rows, not in cache: a layer's own)
      const int64_t k1 = k0 + kKC, kc1 = std::min(kKC, k_inner - k1);
      const int64_t pieces = k1 >= k_inner ? 0 : transpose ? kc1 : n1 - n0;  // W's rows the next chunk reads
      for (int64_t m = r0; m < r1; m += kMR) {
        const int64_t tile = (m - r0) / kMR;
        for (int64_t q = pieces * tile / tiles; q < pieces * (tile + 1) / tiles; ++q) {
          if (transpose) {
            w.template Prefetch<_MM_HINT_T1>(k1 + q, n0, n1 - n0);
          } else {
            w.template Prefetch<_MM_HINT_T1>(n0 + q, k1, kc1);
          }
        }
        const int64_t mr = std::min<int64_t>(kMR, r1 - m);
        const MicroFn micro = kMicro[mr - 1];
        const float* xs = x + m * k_inner + k0;
        int64_t ldx = k_inner;
        if (copy_rows) {
          for (int64_t r = 0; r < mr; ++r) std::memcpy(x_rows + r * kc, xs + r * k_inner, kc * sizeof(float));
          xs = x_rows, ldx = kc;
        }
        const int64_t next_rows = std::min<int64_t>(kMR, r1 - m - kMR);
        for (int64_t p = p0; p < p1; ++p) {
          // the next row tile's y under this panel asked into L2 meanwhile: past L3 (8000 rows' y, 18-49 MB) the
          // microkernel's closing loads and stores of y missed to memory, 10% of its samples (a hint, never a fault:
          // addresses as integers)
          const uintptr_t next_y = reinterpret_cast<uintptr_t>(y + p * kNR) + (m + kMR) * n_cols * sizeof(float);
          for (int64_t r = 0; r < next_rows; ++r) {
            const uintptr_t at = next_y + r * n_cols * sizeof(float);
            _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(at + (kNR - 1) * sizeof(float)), _MM_HINT_T1);
          }
          micro(xs, ldx, panel + (p - p0) * kKC * kNR, kNR, kc, y + m * n_cols + p * kNR, n_cols,
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

// w [..., L, O, I] held as H (the leading dimensions 1), its layer `layer`
template <typename H>
ffi::Error Product(ffi::ThreadPool pool, ffi::Buffer<H::kDtype> w, ffi::Buffer<ffi::S32> layer,
                   ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, bool transpose, bool bf16_x,
                   int64_t large_x) {
  if (large_x < 0) return ffi::Error::InvalidArgument("llama_jax product: tuning needs large_x >= 0");
  int64_t layers = 0, o = 0, i = 0, rows = 0;
  if (!MatrixStack<H>(w.dimensions(), layers, o, i) || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("llama_jax product: expected w [L] + " + H::Layout() + " and one layer index");
  }
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= layers) return ffi::Error::InvalidArgument("llama_jax product: layer index out of range");
  if (const char* e = Sizes(o, i, x.dimensions(), y->dimensions(), transpose, rows)) {
    return ffi::Error::InvalidArgument(e);
  }
  const uint8_t* matrix = static_cast<const uint8_t*>(w.untyped_data()) + l * o * H::RowBytes(i);
#if LLAMA_JAX_TILES
  if constexpr (std::is_same_v<H, BF16>) {  // bf16-exact weights: x · Wᵀ and g · W on the tiles (tiles.h)
    RunTileProduct(pool, reinterpret_cast<const uint16_t*>(matrix), transpose, x.typed_data(), y->typed_data(), rows,
                   transpose ? i : o, transpose ? o : i, bf16_x);
    return ffi::Error::Success();
  }
  if constexpr (BlockQuants<H>::kOn) {  // ggml's blocks of 32: x · Wᵀ on the tiles (tiles.h)
    if (!transpose && rows > 0 && o > 0 && i > 0) {  // (no inputs: RunProduct writes the zeros)
      RunBlockTileProduct<H>(pool, matrix, x.typed_data(), y->typed_data(), rows, o, i, bf16_x);
      return ffi::Error::Success();
    }
  }
#endif
  RunProduct(pool, HeldRows<H>{matrix, i}, transpose, x.typed_data(), y->typed_data(), rows, transpose ? i : o,
             transpose ? o : i, large_x);
  return ffi::Error::Success();
}

constexpr int64_t kGradientRows = 4 * kMR;  // rows of dw (columns of g) a weight gradient's item computes
constexpr int64_t kGradientPanels = 8;     // and x's panels it runs over a chunk at a time (192 KB)

// dw [o, i] = gᵀ · x for g [rows, o] and x [rows, i], on the pool's threads. A product whose inner index is the rows
// of g and x (hundreds: positions) and whose outer ones are the matrix's: x's panels are packed once (every item
// reads them all, from L2), then each item transposes its kGradientRows columns of g (8 x 8 blocks in registers)
// and runs the microkernel over every panel. Read in place, gᵀ's rows would be g's columns, their values a row of g
// apart, in a few L1 sets that evict each other (through RunProduct on a transposed copy of g: 82-160 GFLOP/s).
void RunWeightGrad(ffi::ThreadPool& pool, const float* g, const float* x, float* dw, int64_t rows, int64_t o,
                   int64_t i) {
  const int64_t panels = (i + kNR - 1) / kNR, chunks = (rows + kKC - 1) / kKC;
  // panel p's chunk c at (p · chunks + c) · kKC · kNR (uninitialized: every panel is packed whole, zeros included)
  const std::unique_ptr<float[]> packed(new float[panels * chunks * kKC * kNR + 16]);
  float* panel_at = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(packed.get()) + 63) / 64 * 64);
  const HeldRows<F32> x_rows{reinterpret_cast<const uint8_t*>(x), i};
  auto packing = std::make_shared<Items>();
  packing->items = panels * chunks;
  packing->run = [=](int64_t item) {
    const int64_t p = item / chunks, c = item % chunks;
    Pack(x_rows, true, p * kNR, std::min(kNR, i - p * kNR), c * kKC, std::min(kKC, rows - c * kKC),
         panel_at + item * kKC * kNR, nullptr);
  };
  RunItems(pool, packing);
  const int64_t ld = rows % 1024 == 0 ? rows + 16 : rows;  // gᵀ's rows 4 KB apart would share L1 sets
  auto work = std::make_shared<Items>();
  work->items = (o + kGradientRows - 1) / kGradientRows;
  work->run = [=](int64_t item) {
    const int64_t o0 = item * kGradientRows, n = std::min(kGradientRows, o - o0), n8 = n / 8 * 8, r8 = rows / 8 * 8;
    float* gt = Scratch(kGradientRows * ld);  // gt[c · ld + r] = g[r, o0 + c]
    for (int64_t r = 0; r < r8; r += 8) {
      for (int64_t k = r + 16; k < std::min(rows, r + 24); ++k) {  // g's rows far apart: no hardware prefetch
        for (int64_t c = 0; c < n; c += 16) {
          _mm_prefetch(reinterpret_cast<const char*>(g + k * o + o0 + c), _MM_HINT_T0);
        }
      }
      for (int64_t c = 0; c < n8; c += 8) Transpose8(g + r * o + o0 + c, o, gt + c * ld + r, ld);
      for (int64_t c = n8; c < n; ++c)
        for (int64_t k = r; k < r + 8; ++k) gt[c * ld + k] = g[k * o + o0 + c];
    }
    for (int64_t r = r8; r < rows; ++r)
      for (int64_t c = 0; c < n; ++c) gt[c * ld + r] = g[r * o + o0 + c];
    for (int64_t p0 = 0; p0 < panels; p0 += kGradientPanels) {  // the group's panels of a chunk: in L2
      const int64_t p1 = std::min(panels, p0 + kGradientPanels);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t k0 = c * kKC, kc = std::min(kKC, rows - k0);
        for (int64_t m = 0; m < n; m += kMR) {
          const MicroFn micro = kMicro[std::min<int64_t>(kMR, n - m) - 1];
          for (int64_t p = p0; p < p1; ++p) {
            micro(gt + m * ld + k0, ld, panel_at + (p * chunks + c) * kKC * kNR, kNR, kc, dw + (o0 + m) * i + p * kNR,
                  i, std::min(kNR, i - p * kNR), c > 0);
          }
        }
      }
    }
  };
  RunItems(pool, work);
}

// The weight gradient of x · Wᵀ: dw[o, i] = Σ_m g[m, o] · x[m, i] over the rows m of g [..., O] and x [..., I]
// (every position of every sequence), one sum per leading index p of dw [P..., O, I] (a vmapped gradient: g and x
// [P..., ..., O or I]). gemm.h's order, fixed by the number of rows alone: a straight f32 sum in chunks of kKC rows.
// XLA's dot (YNNPACK, after copying g and x transposed) ran at ~150 GFLOP/s in a gradient (Zen 4).
ffi::Error WeightGrad(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> x,
                      ffi::ResultBuffer<ffi::F32> dw) {
  const auto gd = g.dimensions(), xd = x.dimensions(), wd = dw->dimensions();
  if (wd.size() < 2 || gd.size() == 0 || xd.size() == 0 || gd.back() != wd[wd.size() - 2] || xd.back() != wd.back()) {
    return ffi::Error::InvalidArgument("llama_jax weight_grad: expected g [..., O], x [..., I] and dw [..., O, I]");
  }
  const int64_t o = wd[wd.size() - 2], i = wd.back();
  int64_t pieces = 1;
  for (size_t d = 0; d + 2 < wd.size(); ++d) pieces *= wd[d];
  if (o == 0 || i == 0 || pieces == 0) return ffi::Error::Success();
  const int64_t g_rows = g.element_count() / o;
  if (g_rows != x.element_count() / i || g_rows % pieces != 0) {
    return ffi::Error::InvalidArgument("llama_jax weight_grad: g and x hold different numbers of rows");
  }
  const int64_t rows = g_rows / pieces;
  if (rows == 0) {
    std::fill(dw->typed_data(), dw->typed_data() + dw->element_count(), 0.0f);
    return ffi::Error::Success();
  }
  for (int64_t p = 0; p < pieces; ++p) {
    RunWeightGrad(pool, g.typed_data() + p * rows * o, x.typed_data() + p * rows * i, dw->typed_data() + p * o * i,
                  rows, o, i);
  }
  return ffi::Error::Success();
}

// tiles.h's TileProductReference: y [rows, O] = x [rows, I] · Wᵀ for one matrix W [O, I] held as bf16, the tiles'
// arithmetic in plain C++ (every variant: the tests check it against float64 where no tiles exist)
ffi::Error TileReference(ffi::Buffer<ffi::BF16> w, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions(), xd = x.dimensions(), yd = y->dimensions();
  if (wd.size() != 2 || xd.size() != 2 || yd.size() != 2 || xd[1] != wd[1] || yd[0] != xd[0] || yd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("llama_jax tile_product_reference: expected w [O, I], x [R, I], y [R, O]");
  }
  TileProductReference(reinterpret_cast<const uint16_t*>(w.untyped_data()), x.typed_data(), y->typed_data(), xd[0],
                       wd[0], wd[1]);
  return ffi::Error::Success();
}

// tiles.h's BlockTileReference: y [rows, O] = x [rows, I] · Wᵀ for one matrix W [O, I / 32, bytes] of ggml's blocks
// (ggml_type: Q4_0, Q4_1 or Q8_0), the tiles' arithmetic for blocks in plain C++ (every variant)
template <typename H>
ffi::Error BlockReference(ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  int64_t o = 0, i = 0;
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (!H::Matrix(w.dimensions(), 0, o, i) || xd.size() != 2 || yd.size() != 2 || xd[1] != i || yd[0] != xd[0] ||
      yd[1] != o) {
    return ffi::Error::InvalidArgument("llama_jax tile_product_reference: expected w " + H::Layout() +
                                       ", x [R, I], y [R, O]");
  }
  BlockTileReference<H>(w.typed_data(), x.typed_data(), y->typed_data(), xd[0], o, i);
  return ffi::Error::Success();
}
ffi::Error BlockTileReferenceOf(ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y,
                                int64_t ggml_type) {
  switch (ggml_type) {  // gguf's GGMLQuantizationType
    case 2:
      return BlockReference<Q4_0>(w, x, y);
    case 3:
      return BlockReference<Q4_1>(w, x, y);
    case 8:
      return BlockReference<Q8_0>(w, x, y);
    default:
      return ffi::Error::InvalidArgument("llama_jax tile_product_reference: the tiles take Q4_0, Q4_1 and Q8_0 blocks");
  }
}

}  // namespace
}  // namespace llama_jax

using namespace llama_jax;  // the handlers below name its functions

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlamaJaxBlockTileReference, BlockTileReferenceOf,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("ggml_type"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlamaJaxTileProductReference, TileReference,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlamaJaxWeightGrad, WeightGrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#define LLAMA_JAX_PRODUCT(held)                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(LlamaJaxProduct##held, Product<held>,   \
                                ffi::Ffi::Bind()                     \
                                    .Ctx<ffi::ThreadPool>()          \
                                    .Arg<ffi::Buffer<held::kDtype>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>()    \
                                    .Arg<ffi::Buffer<ffi::F32>>()    \
                                    .Ret<ffi::Buffer<ffi::F32>>()    \
                                    .Attr<bool>("transpose")           \
                                    .Attr<bool>("bf16_x")              \
                                    .Attr<int64_t>("large_x"));

LLAMA_JAX_HELD(LLAMA_JAX_PRODUCT)
