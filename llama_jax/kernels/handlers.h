// The handlers of the native library, listed once: X(symbol, implementation, weight dtype) for each way a matrix
// is held. decode.cc, products.cc and scoring.cc define the handlers from these lists, library.cc names them all in
// LlamaJaxHandlers, which llama_jax/kernels/library.py checks at load against its tables.
#pragma once

// decode.cc: one position per sequence, from the stacked weights of every layer ([L, O, I]) and a layer index
#define LLAMA_JAX_MATVEC_KERNELS(X)                                   \
  X(LlamaJaxMatvecF32, (MatvecElements<ffi::F32, float>), ffi::F32)   \
  X(LlamaJaxMatvecBF16, (MatvecElements<ffi::BF16, Bf16>), ffi::BF16) \
  X(LlamaJaxMatvecF16, (MatvecElements<ffi::F16, Half>), ffi::F16)    \
  X(LlamaJaxMatvecQ4_0, MatvecBlocks<Q4_0>, ffi::U8)                  \
  X(LlamaJaxMatvecQ4_1, MatvecBlocks<Q4_1>, ffi::U8)                  \
  X(LlamaJaxMatvecQ8_0, MatvecBlocks<Q8_0>, ffi::U8)

// products.cc: blocks of positions against one matrix ([O, I]), or its transpose (a gradient)
#define LLAMA_JAX_PRODUCT_KERNELS(X)                                    \
  X(LlamaJaxProductF32, (ProductElements<ffi::F32, float>), ffi::F32)   \
  X(LlamaJaxProductBF16, (ProductElements<ffi::BF16, Bf16>), ffi::BF16) \
  X(LlamaJaxProductF16, (ProductElements<ffi::F16, Half>), ffi::F16)    \
  X(LlamaJaxProductQ4_0, ProductBlocks<Q4_0>, ffi::U8)                  \
  X(LlamaJaxProductQ4_1, ProductBlocks<Q4_1>, ffi::U8)                  \
  X(LlamaJaxProductQ8_0, ProductBlocks<Q8_0>, ffi::U8)

// scoring.cc: the LM head and log-softmax of the scored rows only, blocked over the vocabulary
#define LLAMA_JAX_SCORE_HEAD_KERNELS(X)                                     \
  X(LlamaJaxScoreHeadF32, (ScoreHeadElements<ffi::F32, float>), ffi::F32)   \
  X(LlamaJaxScoreHeadBF16, (ScoreHeadElements<ffi::BF16, Bf16>), ffi::BF16) \
  X(LlamaJaxScoreHeadF16, (ScoreHeadElements<ffi::F16, Half>), ffi::F16)    \
  X(LlamaJaxScoreHeadQ4_0, ScoreHeadBlocks<Q4_0>, ffi::U8)                  \
  X(LlamaJaxScoreHeadQ4_1, ScoreHeadBlocks<Q4_1>, ffi::U8)                  \
  X(LlamaJaxScoreHeadQ8_0, ScoreHeadBlocks<Q8_0>, ffi::U8)
