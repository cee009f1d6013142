// The machine's own peaks, for the kernels' figures to be read against (benchmarks/machine.py compiles and runs
// this with -O3 -march=native): f32 fused multiply-adds, and where the CPU has them int8 dot products
// (AVX512-VNNI vpdpbusd, 64 multiply-adds an instruction; AVX-VNNI, 32) and bf16 dot products (AVX512-BF16
// vdpbf16ps, 32 multiply-adds into f32), on every thread asked for, each thread 12 independent accumulator chains
// (enough to cover the latency); AMX's tile products where the CPU has them and the kernel grants the process its
// tile data (tdpbf16ps and tdpbssd: 16 x 16 outputs of 32 bf16 or 64 int8 multiply-adds each, into four
// accumulator tiles from four source tiles held); and the read bandwidth from memory: the threads summing their
// shares of a 1 GiB array (far past the caches), the best of 5 passes. Prints one JSON object; `./peak THREADS
// read` the bandwidth alone.
//
//     g++ -O3 -march=native -pthread benchmarks/peak.cc -o peak && ./peak 2
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr long kIters = 200'000'000 / 12;

#ifdef __AVX512F__
using F = __m512;
constexpr int kLanes = 16;
inline F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F Set(float v) { return _mm512_set1_ps(v); }
inline float Sum(F v) { return _mm512_reduce_add_ps(v); }
inline F Add(F a, F b) { return _mm512_add_ps(a, b); }
inline F Load(const float* p) { return _mm512_loadu_ps(p); }
#else
using F = __m256;
constexpr int kLanes = 8;
inline F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F Set(float v) { return _mm256_set1_ps(v); }
inline float Sum(F v) {
  alignas(32) float x[8];
  _mm256_store_ps(x, v);
  return x[0] + x[7];
}
inline F Add(F a, F b) { return _mm256_add_ps(a, b); }
inline F Load(const float* p) { return _mm256_loadu_ps(p); }
#endif

float FmaChains() {
  F acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = Set(0.001f * i);
  const F a = Set(0.999999f), b = Set(1e-7f);
  for (long n = 0; n < kIters; ++n) {
    for (int i = 0; i < 12; ++i) acc[i] = Fma(acc[i], a, b);
  }
  float s = 0;
  for (int i = 0; i < 12; ++i) s += Sum(acc[i]);
  return s;
}

#if defined(__AVX512VNNI__)
constexpr int kInt8PerInstruction = 64;
int DotChains() {
  __m512i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (long n = 0; n < kIters; ++n) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  }
  int s = 0;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_epi32(acc[i]);
  return s;
}
#elif defined(__AVXVNNI__)
constexpr int kInt8PerInstruction = 32;
int DotChains() {
  __m256i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_epi32(i);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
  for (long n = 0; n < kIters; ++n) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], a, b);
  }
  return _mm256_extract_epi32(acc[0], 0) + _mm256_extract_epi32(acc[11], 0);
}
#else
constexpr int kInt8PerInstruction = 0;
int DotChains() { return 0; }
#endif

#if defined(__AVX512BF16__)
constexpr int kBf16PerInstruction = 32;  // vdpbf16ps: two bf16 products into each of 16 f32 lanes
float Bf16Chains() {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-7f), _mm512_set1_ps(-1e-7f));
  for (long n = 0; n < kIters; ++n) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  float s = 0;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}
#else
constexpr int kBf16PerInstruction = 0;
float Bf16Chains() { return 0; }
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
constexpr bool kAmx = true;
constexpr long kTileIters = 2'000'000;

// Whether this process may use the tiles: Linux grants their state on request (ARCH_REQ_XCOMP_PERM, 0x1023, for
// XFEATURE_XTILEDATA, 18), once per process, before any tile instruction
bool TilesGranted() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

// The calling thread's tiles configured as 8 of 16 rows of 64 bytes (palette 1), each source filled from `row`
void ConfigureTiles(const void* row) {
  struct alignas(64) {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } config;
  std::memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  _tile_zero(0);  // tile numbers are immediates
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, row, 0);
  _tile_loadd(5, row, 0);
  _tile_loadd(6, row, 0);
  _tile_loadd(7, row, 0);
}

float TileBf16Chains() {
  alignas(64) uint16_t row[32];
  std::fill(row, row + 32, uint16_t{0x3380});  // bf16 6e-8: the sums stay finite
  ConfigureTiles(row);
  for (long n = 0; n < kTileIters; ++n) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[256];
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}

float TileInt8Chains() {
  alignas(64) int8_t row[64];
  std::fill(row, row + 64, int8_t{1});
  ConfigureTiles(row);
  for (long n = 0; n < kTileIters; ++n) {
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  alignas(64) int32_t out[256];
  _tile_stored(0, out, 64);
  _tile_release();
  return static_cast<float>(out[0]);
}
#else
constexpr bool kAmx = false;
constexpr long kTileIters = 0;
bool TilesGranted() { return false; }
float TileBf16Chains() { return 0; }
float TileInt8Chains() { return 0; }
#endif

// The least time of 7 runs of fn on every thread at once (~0.05 s each): a peak is the best the units give, and
// on the 2-core virtual machines one run in three lost 10-25% to the host (a single run read 342-462 GFLOP/s of
// f32 FMA on an Intel Xeon within a minute; the best of 7, 458-477)
template <typename Fn>
double Seconds(int threads, Fn fn) {
  double best = 1e30;
  for (int run = 0; run < 7; ++run) {
    std::vector<std::thread> pool;
    volatile double sink = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t) pool.emplace_back([&] { sink = sink + fn(); });
    for (auto& th : pool) th.join();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

// The sum of n floats from p, read as kStreams parts side by side (one accumulator each), in the widest loads.
// Several streams a thread, as a matrix-vector kernel reads several rows at once: one stream a thread measured
// 41-46 GB/s where 8 gave 47-51 and the f32 decode kernel read its weights at 47-48 (Zen 5, 2 threads).
constexpr int kStreams = 8;
float ReadSum(const float* p, size_t n) {
  const size_t part = n / kStreams / kLanes * kLanes;
  F acc[kStreams];
  for (auto& a : acc) a = Set(0.0f);
  for (size_t i = 0; i < part; i += kLanes) {
    for (int s = 0; s < kStreams; ++s) acc[s] = Add(acc[s], Load(p + s * part + i));
  }
  for (int s = 1; s < kStreams; ++s) acc[0] = Add(acc[0], acc[s]);
  return Sum(acc[0]);
}

// GB/s of `threads` threads reading their shares of one 1 GiB array, the best of 5 passes
double ReadBandwidth(int threads) {
  const size_t n = (size_t{1} << 30) / sizeof(float);
  std::vector<float> data(n, 1.0f);  // written once: every page is mapped before the timing
  const size_t share = n / threads / (kStreams * kLanes) * (kStreams * kLanes);
  double best = 1e30;
  for (int pass = 0; pass < 5; ++pass) {
    std::vector<std::thread> pool;
    volatile float sink = 0;
    const auto start = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] { sink = sink + ReadSum(data.data() + share * t, share); });
    }
    for (auto& th : pool) th.join();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return static_cast<double>(share * threads) * sizeof(float) / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  if (argc > 2 && std::string(argv[2]) == "read") {  // the bandwidth alone (~1 s): run.py measures it every trial
    std::printf("{\"threads\": %d, \"read_gbps\": %.1f}\n", threads, ReadBandwidth(threads));
    return 0;
  }
  const double ops = static_cast<double>(threads) * kIters * 12;
  const double fma = Seconds(threads, FmaChains);
  std::printf("{\"threads\": %d, \"f32_fma_gflops\": %.1f", threads, ops * kLanes * 2 / fma / 1e9);
  if (kInt8PerInstruction) {
    const double dot = Seconds(threads, DotChains);
    std::printf(", \"int8_dot_gops\": %.1f", ops * kInt8PerInstruction * 2 / dot / 1e9);
  }
  if (kBf16PerInstruction) {
    const double dot = Seconds(threads, Bf16Chains);
    std::printf(", \"bf16_dot_gflops\": %.1f", ops * kBf16PerInstruction * 2 / dot / 1e9);
  }
  if (kAmx && TilesGranted()) {  // 4 instructions an iteration, each 16 x 16 outputs of 32 (64) multiply-adds
    const double tile_ops = static_cast<double>(threads) * kTileIters * 4 * 256 * 2;
    std::printf(", \"amx_bf16_gflops\": %.1f", tile_ops * 32 / Seconds(threads, TileBf16Chains) / 1e9);
    std::printf(", \"amx_int8_gops\": %.1f", tile_ops * 64 / Seconds(threads, TileInt8Chains) / 1e9);
  }
  std::printf(", \"read_gbps\": %.1f}\n", ReadBandwidth(threads));
}
