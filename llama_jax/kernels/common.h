// What every native kernel shares: XLA's FFI, and the work-claiming scheme that spreads a kernel's items over XLA's
// thread pool (see matvec.cc). The ways a matrix is held are in held.h, the SIMD vocabulary in simd.h.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace llama_jax {

// Work cut into items 0..items-1, shared by the caller and the pool tasks it scheduled (which may outlive the
// call: they then find no item left). `run(k)` does item k; the items write disjoint outputs.
struct Items {
  std::function<void(int64_t)> run;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Drain() {
    for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < items;
         k = next.fetch_add(1, std::memory_order_relaxed)) {
      run(k);
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

// Runs every item on the calling thread and up to threads - 1 pool tasks
inline void RunItems(ffi::ThreadPool& pool, std::shared_ptr<Items> work) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min(threads, work->items) - 1;
  for (int64_t p = 0; p < helpers; ++p) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->items) _mm_pause();  // items claimed by running tasks
}

}  // namespace llama_jax
