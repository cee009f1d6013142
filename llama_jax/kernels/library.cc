// What the library says of itself at load (llama_jax/kernels/library.py checks each against its own tables).
#include <cstdint>
#include <string>

#include "xla/ffi/api/c_api.h"

#include "gemm.h"
#include "handlers.h"
#include "held.h"
#include "tiles.h"

// Every handler this library defines, comma-separated: checked at load against the Python side's lists.
#define LLAMA_JAX_NAMES(held) "LlamaJaxMatvec" #held ",LlamaJaxProduct" #held ",LlamaJaxScoreHead" #held ","
extern "C" const char* LlamaJaxHandlers() {
  return "LlamaJaxAttend,LlamaJaxAttendBlock,LlamaJaxAttendBlockGrads,LlamaJaxWeightGrad,"
         "LlamaJaxTileProductReference,LlamaJaxBlockTileReference," LLAMA_JAX_HELD(LLAMA_JAX_NAMES);
}

// Whether this library runs products on AMX tiles (tiles.h) and the kernel granted this process their state (asked
// once, here): 0 in a library built without them, or where Linux refuses. Checked at load (library.py): a library
// with tiles the process may not use is passed over for the next variant.
extern "C" int32_t LlamaJaxTilesGranted() {
  static const bool granted = llama_jax::kTiles && llama_jax::RequestTiles();
  return granted ? 1 : 0;
}

// The traits whose matvec multiplies their quants by x's int8 limbs (held.h's kLimbs), comma-separated: checked at
// load against the Python side's LIMBS, which says which kinds' products are f32 class rather than the f32 copy's bits.
#define LLAMA_JAX_LIMBS(held) \
  if (llama_jax::held::kLimbs) names += #held ",";
extern "C" const char* LlamaJaxLimbs() {
  static const std::string listed = [] {
    std::string names;
    LLAMA_JAX_HELD(LLAMA_JAX_LIMBS)
    return names;
  }();
  return listed.c_str();
}

// The traits whose block products x · Wᵀ run on the tiles in this library (tiles.h's BlockQuants, where the library
// has tiles), comma-separated: checked at load against the Python side's TILE_BLOCKS (their products are the f32
// class d · Σ q·x + m · Σ x there, not the f32 copy's bits)
#define LLAMA_JAX_TILE_BLOCKS(held) \
  if (llama_jax::kTiles && llama_jax::BlockQuants<llama_jax::held>::kOn) names += #held ",";
extern "C" const char* LlamaJaxTileBlocks() {
  static const std::string listed = [] {
    std::string names;
    LLAMA_JAX_HELD(LLAMA_JAX_TILE_BLOCKS)
    return names;
  }();
  return listed.c_str();
}

// The block products' shape on the FMA units (gemm.h), for `llama-jax info`: measured, not chosen at run time (no
// alternative measured better on the CPUs tried, RESULTS.md), so a table of one
extern "C" const char* LlamaJaxProductShape() {
  static const std::string shape = std::to_string(llama_jax::kMR) + " x " + std::to_string(llama_jax::kNR) +
                                   " microkernel, " + std::to_string(llama_jax::kKC) + " inputs a chunk";
  return shape.c_str();
}

// The FFI API version these kernels were compiled against, checked at load against the running jaxlib's.
extern "C" int32_t LlamaJaxFfiApiVersion() { return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR; }
