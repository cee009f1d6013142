// What the library says of itself at load (llama_jax/kernels/library.py checks both).
#include <cstdint>

#include "xla/ffi/api/c_api.h"

#include "handlers.h"

// Every handler this library defines, comma-separated: checked at load against the Python side's lists.
#define LLAMA_JAX_NAMES(held) "LlamaJaxMatvec" #held ",LlamaJaxProduct" #held ",LlamaJaxScoreHead" #held ","
extern "C" const char* LlamaJaxHandlers() {
  return "LlamaJaxAttend,LlamaJaxAttendBlock,LlamaJaxAttendBlockGrads,LlamaJaxWeightGrad," LLAMA_JAX_HELD(LLAMA_JAX_NAMES);
}

// The FFI API version these kernels were compiled against, checked at load against the running jaxlib's.
extern "C" int32_t LlamaJaxFfiApiVersion() { return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR; }
