// What AMX gives the float32 class (issue 57's question, measured before its kernels are built): a product
// y [32, 32] = x [32, K] · Wᵀ, W [32, K] held as int8 values with one f32 scale per 32 of them (Q8_0's shape: every
// ggml block type is small integers and per-block scales), on the tiles, with every activation split exactly into
// three bf16 terms (hi + mid + lo: 24 significant bits) so that each tile product of a term by a weight is exact in
// f32 and only the order of the sums differs from a straight f32 dot. Two forms, on every thread asked for:
// - "blocks": each block's three tile products into cleared accumulator tiles, stored, and scaled into y by
//   AVX-512 (the per-block scale: what a quantized weight needs);
// - "dense": the tiles accumulate over all of K (what a weight that is bf16-exact as a whole needs: bf16 weights);
// beside f32 FMA's peak (peak.cc), with each form's largest error against float64 and a straight f32 sum's, over
// max |y|. The operands (x's terms 384 KB, W's 128 KB) stay in L2: the tile arithmetic's rate, before packing.
//
//     g++ -O2 -march=native -pthread benchmarks/tile_product.cc -o tile_product && ./tile_product 2
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
namespace {

constexpr int kRows = 32, kCols = 32, kInner = 2048, kBlocks = kInner / 32;

uint16_t Bf16(float f) {  // rounded to nearest, ties to even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
float Widen(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Operands {
  std::vector<float> x, w, scale;  // x [rows, K], w [cols, K] (its values), scale [blocks, cols]
  std::vector<uint16_t> a;  // x's terms as tiles: [block][term][row half][16 rows][32]
  std::vector<uint16_t> b;  // W's integers as tiles: [block][col half][16 pairs][16 cols][2] (pairs of k adjacent)
};

Operands Make() {
  Operands o;
  std::mt19937 random(1);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> quant(-127, 127);
  o.x.resize(kRows * kInner), o.w.resize(kCols * kInner), o.scale.resize(kBlocks * kCols);
  for (float& v : o.x) v = normal(random);
  for (int j = 0; j < kBlocks * kCols; ++j) o.scale[j] = 0.01f * std::exp2(normal(random));
  o.a.resize(kBlocks * 3 * kRows * 32), o.b.resize(kBlocks * kCols * 32);
  for (int m = 0; m < kRows; ++m) {
    for (int k = 0; k < kInner; ++k) {
      float rest = o.x[m * kInner + k];
      for (int t = 0; t < 3; ++t) {  // each term the nearest bf16 to what remains: exact, 8 bits at a time
        const uint16_t term = Bf16(rest);
        rest -= Widen(term);
        o.a[(((k / 32 * 3 + t) * 2 + m / 16) * 16 + m % 16) * 32 + k % 32] = term;
      }
    }
  }
  for (int n = 0; n < kCols; ++n) {
    for (int k = 0; k < kInner; ++k) {
      const int q = quant(random);
      o.w[n * kInner + k] = static_cast<float>(q) * o.scale[k / 32 * kCols + n];
      o.b[(((k / 32 * 2 + n / 16) * 16 + k % 32 / 2) * 16 + n % 16) * 2 + k % 2] = Bf16(static_cast<float>(q));
    }
  }
  return o;
}

void Configure() {
  struct alignas(64) {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config;
  std::memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// The three terms' products of one block (dense: of every block) into tiles 0-3 (rows 0-15, 16-31 x cols 0-15,
// 16-31)
inline void BlockProducts(const Operands& o, int block) {
  const uint16_t* b = o.b.data() + block * kCols * 32;
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b + 512, 64);
  for (int t = 0; t < 3; ++t) {
    const uint16_t* a = o.a.data() + (block * 3 + t) * kRows * 32;
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

inline void ClearTiles() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

inline void StoreTiles(float (*c)[256]) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
}

void Blocks(const Operands& o, float* y) {
  alignas(64) float acc[kRows * kCols] = {};
  alignas(64) float c[4][256];
  for (int block = 0; block < kBlocks; ++block) {
    ClearTiles();
    BlockProducts(o, block);
    StoreTiles(c);
    const __m512 s0 = _mm512_loadu_ps(&o.scale[block * kCols]), s1 = _mm512_loadu_ps(&o.scale[block * kCols + 16]);
    for (int m = 0; m < kRows; ++m) {
      float* row = acc + m * kCols;
      const float* tile = c[m / 16 * 2] + m % 16 * 16;
      _mm512_storeu_ps(row, _mm512_fmadd_ps(_mm512_loadu_ps(tile), s0, _mm512_loadu_ps(row)));
      _mm512_storeu_ps(row + 16, _mm512_fmadd_ps(_mm512_loadu_ps(tile + 256), s1, _mm512_loadu_ps(row + 16)));
    }
  }
  std::memcpy(y, acc, sizeof acc);
}

void Dense(const Operands& o, float* y) {
  alignas(64) float c[4][256];
  ClearTiles();
  for (int block = 0; block < kBlocks; ++block) BlockProducts(o, block);
  StoreTiles(c);
  for (int m = 0; m < kRows; ++m) {
    for (int n = 0; n < kCols; ++n) y[m * kCols + n] = c[m / 16 * 2 + n / 16][m % 16 * 16 + n % 16];
  }
}

// GFLOP/s of `threads` threads running form over and over (the least time of 3 runs), and its last y
template <typename Form>
double Rate(const Operands& o, int threads, Form form, float* y) {
  constexpr int kCalls = 4000;
  double best = 1e30;
  for (int run = 0; run < 3; ++run) {
    std::vector<std::thread> pool;
    const auto start = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        Configure();
        std::vector<float> mine(kRows * kCols);
        for (int call = 0; call < kCalls; ++call) form(o, mine.data());
        if (t == 0) std::copy(mine.begin(), mine.end(), y);
        _tile_release();
      });
    }
    for (auto& th : pool) th.join();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return 2.0 * kRows * kCols * kInner * kCalls * threads / best / 1e9;
}

// max |y - float64| / max |y| over the product with W's values `w` (the dense form's: W's integers unscaled)
double Error(const Operands& o, const float* y, bool unscaled, double* straight) {
  double worst = 0, worst_f32 = 0, largest = 0;
  for (int m = 0; m < kRows; ++m) {
    for (int n = 0; n < kCols; ++n) {
      double exact = 0;
      float sum = 0;
      for (int k = 0; k < kInner; ++k) {
        const float w = unscaled ? o.w[n * kInner + k] / o.scale[k / 32 * kCols + n] : o.w[n * kInner + k];
        exact += static_cast<double>(o.x[m * kInner + k]) * w;
        sum = std::fma(o.x[m * kInner + k], w, sum);
      }
      worst = std::max(worst, std::fabs(y[m * kCols + n] - exact));
      worst_f32 = std::max(worst_f32, std::fabs(sum - exact));
      largest = std::max(largest, std::fabs(exact));
    }
  }
  *straight = worst_f32 / largest;
  return worst / largest;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    std::printf("{\"error\": \"the kernel does not grant this process AMX's tile data\"}\n");
    return 1;
  }
  const Operands o = Make();
  std::vector<float> y(kRows * kCols);
  double straight_blocks, straight_dense;
  const double blocks = Rate(o, threads, Blocks, y.data());
  const double blocks_error = Error(o, y.data(), false, &straight_blocks);
  const double dense = Rate(o, threads, Dense, y.data());
  const double dense_error = Error(o, y.data(), true, &straight_dense);
  std::printf("{\"threads\": %d, \"blocks_gflops\": %.1f, \"blocks_error\": %.3g, \"blocks_f32_error\": %.3g, "
              "\"dense_gflops\": %.1f, \"dense_error\": %.3g, \"dense_f32_error\": %.3g}\n",
              threads, blocks, blocks_error, straight_blocks, dense, dense_error, straight_dense);
}
#else
int main() {
  std::printf("{\"error\": \"compiled without AMX-BF16 and AVX-512 (-march=native on a CPU that has them)\"}\n");
  return 1;
}
#endif
