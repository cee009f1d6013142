// The ways a matrix is held (held.h), listed once: X(trait) for each. matvec.cc, products.cc and scoring.cc define
// one handler per way from this list (LlamaJaxMatvecQ4_1: Matvec<Q4_1>, its buffer of Q4_1::kDtype), library.cc
// names them all in LlamaJaxHandlers and those whose matvec uses limbs in LlamaJaxLimbs, which
// llama_jax/kernels/library.py checks at load against its tables (HELD, LIMBS).
#pragma once

#define LLAMA_JAX_HELD(X) X(F32) X(BF16) X(F16) X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q8_0) X(Q4_K) X(Q5_K) X(Q6_K)
