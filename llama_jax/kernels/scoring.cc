// Scoring's LM head: for each scored row r of the final norm x, log p(target[r]) = logit[target] - log Σ_v
// exp(logit[v]) and the argmax over the vocabulary, with logit = x[r] · W[v] / divisor (W [V, D], the head as held;
// the divisor Granite's logits_scaling, 1 for the rest, where no division is done), called
// from jitted code through XLA's FFI. Never a [rows, V] array: the vocabulary is cut into chunks of kChunk
// columns, each chunk's logits live in a thread's tile (kMR rows × kChunk, in L1) only until its statistics are
// taken. Rows whose target is -1 are not scored (not computed at all): scoring asks only for the positions whose
// log-probabilities it returns.
//
// Order (batch invariance): a logit is gemm.h's chunked sum over D; a chunk's statistics are its maximum m_c, its
// first argmax, and s_c = Σ exp(logit - m_c) in column order (the exp of attention.cc); a row's are then, chunk by
// chunk in vocabulary order, M = max m_c and S = Σ_c s_c · exp(m_c - M); log p = (logit[target] - M) - log S (M
// and log S are returned too, and the logits of the rows asked for: the whole vocabulary's log-probabilities
// follow from them in the same bits, from one pass over the head). All
// fixed by V and D alone: a row's bits are the same alone or among any rows, on AVX-512 and AVX2.
#include "gemm.h"
#include "handlers.h"
#include "held.h"

namespace llama_jax {
namespace {  // this file's own

constexpr int64_t kChunk = 256;  // vocabulary columns per chunk: a whole number of panels on both instruction sets

// The statistics of chunk c (columns n0..n0+cols-1) for rows [m, m + mr) of the scored rows x [rows, d]: their
// logits in `tile` [kMR, kChunk] from the chunk's packed panels, then each row's maximum, first argmax, sum of
// exp(logit - maximum), and its target's logit where the target lies in the chunk
struct ChunkStats {
  int64_t rows, d, vocab;
  const float* x;
  const int32_t* target;
  const int64_t* kept;  // [rows]: where a row's logits are kept among the kept rows, or -1
  float *max, *sum, *target_logit, *logits_out;  // max, sum [chunks, rows]; logits_out [kept rows, vocab]
  int32_t* arg;
  float divisor;  // each logit divided by it (Granite's logits_scaling; 1: none)

  void Run(const float* panels, int64_t c, int64_t n0, int64_t cols, int64_t m, int64_t mr, float* tile) const {
    const MicroFn micro = kMicro[mr - 1];
    for (int64_t k0 = 0; k0 < d; k0 += kKC) {
      const int64_t kc = std::min(kKC, d - k0);
      for (int64_t p = 0; p * kNR < cols; ++p) {
        micro(x + m * d + k0, d, panels + k0 * kChunk + p * kc * kNR, kNR, kc, tile + p * kNR, kChunk,
              std::min(kNR, cols - p * kNR), k0 > 0);
      }
    }
    for (int64_t r = 0; r < mr; ++r) {
      float* logits = tile + r * kChunk;
      if (divisor != 1.0f) {
        for (int64_t j = 0; j < cols; ++j) logits[j] /= divisor;
      }
      if (kept[m + r] >= 0) std::memcpy(logits_out + kept[m + r] * vocab + n0, logits, cols * sizeof(float));
      int64_t best = 0;
      for (int64_t j = 1; j < cols; ++j) best = logits[j] > logits[best] ? j : best;
      alignas(64) float e[kChunk] = {};
      std::memcpy(e, logits, cols * sizeof(float));
      for (int64_t j = 0; j < cols; j += kLanes) VStoreU(e + j, ExpNonPositive(VAdd(VLoadU(e + j), VSet(-logits[best]))));
      float total = 0.0f;
      for (int64_t j = 0; j < cols; ++j) total += e[j];
      const int64_t at = c * rows + m + r;
      max[at] = logits[best];
      sum[at] = total;
      arg[at] = static_cast<int32_t>(n0 + best);
      if (target[m + r] >= n0 && target[m + r] < n0 + cols) target_logit[m + r] = logits[target[m + r] - n0];
    }
  }
};

// The results of each row of x [rows_all, d] against the head w [vocab, d]: its target's log-probability, the
// argmax, the maximum logit M and log S (each log-probability is (logit - M) - log S); rows whose target is -1 get
// 0, -1, 0, 0, uncomputed. logits [kept, vocab]: the whole logits of the rows keep names (indices into x's rows,
// each scored: its target not -1), in order
struct Scored {
  float *logprob, *top, *log_total, *logits;
  int32_t* argmax;
  const int32_t* keep;
  int64_t kept;
};

template <typename Rows>
void RunScoreHead(ffi::ThreadPool& pool, Rows w, int64_t vocab, int64_t d, const float* x_all, const int32_t* targets,
                  int64_t rows_all, Scored out, float divisor) {
  for (float* result : {out.logprob, out.top, out.log_total}) std::fill(result, result + rows_all, 0.0f);
  std::fill(out.logits, out.logits + out.kept * vocab, 0.0f);
  std::fill(out.argmax, out.argmax + rows_all, -1);
  std::vector<int64_t> scored;
  for (int64_t r = 0; r < rows_all; ++r) {
    if (targets[r] >= 0) scored.push_back(r);
  }
  const int64_t rows = static_cast<int64_t>(scored.size()), chunks = (vocab + kChunk - 1) / kChunk;
  if (rows == 0 || chunks == 0) return;
  std::vector<float> x(rows * d), max(chunks * rows), sum(chunks * rows), target_logit(rows);
  std::vector<int32_t> target(rows), arg(chunks * rows);
  std::vector<int64_t> compact(rows_all, -1), kept(rows, -1);  // x's row -> scored row; scored row -> kept slot
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(x.data() + r * d, x_all + scored[r] * d, d * sizeof(float));
    target[r] = targets[scored[r]];
    compact[scored[r]] = r;
  }
  for (int64_t k = 0; k < out.kept; ++k) kept[compact[out.keep[k]]] = k;
  const ChunkStats stats{rows, d, vocab, x.data(), target.data(), kept.data(), max.data(), sum.data(),
                         target_logit.data(), out.logits, arg.data(), divisor};
  auto work = std::make_shared<Items>();
  work->items = chunks;
  work->run = [=](int64_t c) {
    const int64_t n0 = c * kChunk, cols = std::min(kChunk, vocab - n0);
    float* panels = Scratch(d * kChunk + kNR * kKC + kMR * kChunk);  // the chunk's panels over all of d
    float* scratch = panels + d * kChunk;
    float* tile = scratch + kNR * kKC;
    for (int64_t k0 = 0; k0 < d; k0 += kKC) {
      const int64_t kc = std::min(kKC, d - k0);
      for (int64_t p = 0; p * kNR < cols; ++p) {
        Pack(w, false, n0 + p * kNR, std::min(kNR, cols - p * kNR), k0, kc, panels + k0 * kChunk + p * kc * kNR, scratch);
      }
    }
    for (int64_t m = 0; m < rows; m += kMR) stats.Run(panels, c, n0, cols, m, std::min<int64_t>(kMR, rows - m), tile);
  };
  RunItems(pool, work);
  for (int64_t r = 0; r < rows; ++r) {  // the chunks in vocabulary order
    float top = max[r];
    int32_t best = arg[r];
    for (int64_t c = 1; c < chunks; ++c) {
      if (max[c * rows + r] > top) top = max[c * rows + r], best = arg[c * rows + r];
    }
    float total = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) total += sum[c * rows + r] * std::exp(max[c * rows + r] - top);
    out.logprob[scored[r]] = (target_logit[r] - top) - std::log(total);
    out.top[scored[r]] = top;
    out.log_total[scored[r]] = std::log(total);
    out.argmax[scored[r]] = best;
  }
}

// The sizes: w [..., V, D] (leading dimensions of 1), x [..., D], targets and the results [...], keep [kept];
// a message where they do not fit, a target lies outside the vocabulary or keep names a row it may not
const char* ScoreSizes(int64_t vocab, int64_t d, ffi::Span<const int64_t> xd, ffi::Span<const int64_t> td,
                       const int32_t* targets, const int32_t* keep, int64_t kept, int64_t& rows) {
  if (xd.size() == 0 || xd.size() != td.size() + 1 || xd[xd.size() - 1] != d) {
    return "llama_jax score_head: expected x [..., D] and targets [...] for a head [V, D]";
  }
  rows = 1;
  for (size_t i = 0; i < td.size(); ++i) {
    if (td[i] != xd[i]) return "llama_jax score_head: x and targets differ in their leading dimensions";
    rows *= td[i];
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] < -1 || targets[r] >= vocab) return "llama_jax score_head: a target outside [-1, vocab)";
  }
  for (int64_t k = 0; k < kept; ++k) {
    if (keep[k] < 0 || keep[k] >= rows || targets[keep[k]] < 0 || (k > 0 && keep[k] <= keep[k - 1])) {
      return "llama_jax score_head: keep names scored rows of x, ascending";
    }
  }
  return nullptr;
}

// w [..., V, D] held as H (the leading dimensions 1)
template <typename H>
ffi::Error ScoreHead(ffi::ThreadPool pool, ffi::Buffer<H::kDtype> w, ffi::Buffer<ffi::F32> x,
                     ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::S32> keep, ffi::ResultBuffer<ffi::F32> logprob,
                     ffi::ResultBuffer<ffi::S32> argmax, ffi::ResultBuffer<ffi::F32> top,
                     ffi::ResultBuffer<ffi::F32> log_total, ffi::ResultBuffer<ffi::F32> logits, float divisor) {
  int64_t vocab = 0, d = 0, rows = 0;
  if (!OneMatrix<H>(w.dimensions(), vocab, d)) {
    return ffi::Error::InvalidArgument("llama_jax score_head: expected one head w " + H::Layout() + " (O = V, I = D)");
  }
  const int64_t kept = keep.element_count();
  if (const char* e = ScoreSizes(vocab, d, x.dimensions(), targets.dimensions(), targets.typed_data(),
                                 keep.typed_data(), kept, rows)) {
    return ffi::Error::InvalidArgument(e);
  }
  RunScoreHead(pool, HeldRows<H>{static_cast<const uint8_t*>(w.untyped_data()), d}, vocab, d, x.typed_data(),
               targets.typed_data(), rows,
               Scored{logprob->typed_data(), top->typed_data(), log_total->typed_data(), logits->typed_data(),
                      argmax->typed_data(), keep.typed_data(), kept},
               divisor);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace llama_jax

using namespace llama_jax;  // the handlers below name its functions

#define LLAMA_JAX_SCORE_HEAD(held)                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(LlamaJaxScoreHead##held, ScoreHead<held>,   \
                                ffi::Ffi::Bind()                         \
                                    .Ctx<ffi::ThreadPool>()              \
                                    .Arg<ffi::Buffer<held::kDtype>>()    \
                                    .Arg<ffi::Buffer<ffi::F32>>()        \
                                    .Arg<ffi::Buffer<ffi::S32>>()        \
                                    .Arg<ffi::Buffer<ffi::S32>>()        \
                                    .Ret<ffi::Buffer<ffi::F32>>()        \
                                    .Ret<ffi::Buffer<ffi::S32>>()        \
                                    .Ret<ffi::Buffer<ffi::F32>>()        \
                                    .Ret<ffi::Buffer<ffi::F32>>()        \
                                    .Ret<ffi::Buffer<ffi::F32>>()        \
                                    .Attr<float>("divisor"));

LLAMA_JAX_HELD(LLAMA_JAX_SCORE_HEAD)
