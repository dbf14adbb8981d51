// Entry points of the CPU kernels. Pointers arrive as integers from Python (tensor.data_ptr()),
// strides are in elements, and the innermost dim of every tensor is contiguous.
#pragma once

#include <cstdint>

namespace bik {

struct MatmulArgs {  // C[b] = A[b] . W[b]^T (+ bias); C contiguous [batch, M, N]
  uintptr_t a, w, bias, c;  // bias may be 0
  int64_t batch, M, N, K;
  int64_t a_batch_stride, a_row_stride, w_batch_stride, w_row_stride;
};

struct AttentionArgs {  // see bik/ops/attention.py for the semantics
  uintptr_t q, k, v, kv_start, out;  // kv_start: int32 [B]; out contiguous [B, Hq, Tq, D]
  int64_t B, Hq, Hkv, Tq, Tk, D, split_size;
  int64_t q_strides[3], k_strides[3], v_strides[3];  // batch, head, position
  float scale;
  bool causal;
};

void matmul(int dtype, const MatmulArgs& args);
void rms_norm(int dtype, int w_dtype, uintptr_t x, uintptr_t w, uintptr_t y, int64_t rows,
              int64_t D, int64_t x_row_stride, float eps);
void log_softmax(int dtype, int out_dtype, uintptr_t x, uintptr_t y, int64_t rows, int64_t V,
                 int64_t x_row_stride, float temperature);
void token_logprobs(int dtype, uintptr_t x, uintptr_t tokens, uintptr_t out, int64_t rows,
                    int64_t V, int64_t x_row_stride, float temperature);
void attention(int dtype, const AttentionArgs& args);

}  // namespace bik
