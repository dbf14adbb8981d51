// Entry points of the CUDA kernels; pointers and the stream arrive as integers from Python.
#pragma once

#include <cstdint>

#include "bik/args.h"

namespace bik_cuda {

using bik::AttentionArgs;
using bik::MatmulArgs;

void rms_norm(int dtype, int w_dtype, uintptr_t x, uintptr_t w, uintptr_t y, int64_t rows,
              int64_t D, int64_t stride, float eps, uintptr_t stream);
void log_softmax(int dtype, int out_dtype, uintptr_t x, uintptr_t y, int64_t rows, int64_t V,
                 int64_t stride, float temperature, uintptr_t stream);
void token_logprobs(int dtype, uintptr_t x, uintptr_t tokens, uintptr_t out, int64_t rows,
                    int64_t V, int64_t stride, float temperature, uintptr_t stream);
void matmul(int dtype, const MatmulArgs& args, uintptr_t stream);
void attention(int dtype, const AttentionArgs& args, uintptr_t scratch, int64_t n_splits,
               uintptr_t stream);

}  // namespace bik_cuda
