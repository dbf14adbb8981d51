// Entry points of the CPU kernels (argument conventions: bik/args.h).
#pragma once

#include <cstdint>

#include "bik/args.h"

namespace bik {

void matmul(int dtype, const MatmulArgs& args);
// B (args.b, args.N, args.K, args.b_*_stride) packed once into the matmul kernel's layout, at
// dst (packed_weight_bytes long); matmul_prepacked reads it instead of args.b (same bits)
int64_t packed_weight_bytes(int dtype, int64_t N, int64_t K);
void pack_weight(int dtype, const MatmulArgs& args, uintptr_t dst);
void matmul_prepacked(int dtype, const MatmulArgs& args, uintptr_t packed);
// C (fp32) = the TP-invariant chunked order of A . B (batch 1, no bias); see matmul.cpp
void chunked_matmul(int dtype, const MatmulArgs& args, int64_t chunks);
void rms_norm(int dtype, int w_dtype, uintptr_t x, uintptr_t w, uintptr_t y, int64_t rows,
              int64_t D, int64_t x_row_stride, float eps);
void log_softmax(int dtype, int out_dtype, uintptr_t x, uintptr_t y, int64_t rows, int64_t V,
                 int64_t x_row_stride, float temperature);
void token_logprobs(int dtype, uintptr_t x, uintptr_t tokens, uintptr_t out, int64_t rows,
                    int64_t V, int64_t x_row_stride, float temperature);
void attention(int dtype, const AttentionArgs& args);
void paged_attention(int dtype, const PagedAttentionArgs& args);
void delta_rule(const DeltaRuleArgs& args);          // fp32 only
void selective_scan(const SelectiveScanArgs& args);  // fp32 only

}  // namespace bik
