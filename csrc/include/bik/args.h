// Argument structs of the compiled kernels. Pointers arrive as integers from Python
// (tensor.data_ptr()), strides are in elements, and the innermost dim of every tensor is
// contiguous (except B of matmul, which takes any strides). bik/backends/native.py fills them.
#pragma once

#include <array>
#include <cstdint>

namespace bik {

struct MatmulArgs {         // C[b] = A[b] . B[b] (+ bias); C contiguous [batch, M, N]
  uintptr_t a, b, bias, c;  // bias may be 0; B may have any strides (e.g. W^T)
  int64_t batch, M, N, K;
  int64_t a_batch_stride, a_row_stride, b_batch_stride, b_k_stride, b_n_stride;
};

struct AttentionArgs {               // see bik/ops/attention.py for the semantics
  uintptr_t q, k, v, kv_start, out;  // kv_start: int32 [B]; out contiguous [B, Hq, Tq, D]
  int64_t B, Hq, Hkv, Tq, Tk, D, split_size;
  int64_t q_strides[3], k_strides[3], v_strides[3];  // batch, head, position
  float scale;
  bool causal;
  float softcap;   // > 0: scores s become softcap * tanh(s / softcap); 0: off
  int64_t window;  // > 0 (causal only): the query at position p sees keys (p - window, p]; 0: off
  uintptr_t sinks = 0;  // fp32 [Hq]: attention sinks, one logit per query head (cpu); 0: off
};

struct PagedAttentionArgs {    // see bik/layers/paged_attention.py for the semantics
  uintptr_t q;                 // [T, Hq, D] packed queries of S sequences
  uintptr_t k_cache, v_cache;  // [num_blocks, Hkv, block_size, D] each
  uintptr_t block_table;       // int32 [>= S, table_stride]: each sequence's pages in order
  uintptr_t query_start;       // int32 [S + 1]: sequence s owns query rows [qs[s], qs[s + 1])
  uintptr_t seq_lens;          // int32 [S]: its keys, the new ones (its last queries) included
  uintptr_t out;               // contiguous [T, Hq, D]
  int64_t T, S, Hq, Hkv, D, block_size, split_size, table_stride;
  int64_t q_strides[2], k_strides[3], v_strides[3];  // q: token, head; caches: block, head, slot
  float scale, softcap;                              // softcap 0: off
  int64_t window;   // > 0: the query at position p sees keys (p - window, p]; 0: off
  uintptr_t sinks;  // fp32 [Hq] or 0: off
};

// AttentionArgs from the bindings' flat arguments: sizes = (B, Hq, Hkv, Tq, Tk, D, split_size),
// strides = (batch, head, position) of q, k and v; sinks 0: none.
inline AttentionArgs attention_args(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t kv_start,
                                    uintptr_t out, const std::array<int64_t, 7>& sizes,
                                    const std::array<int64_t, 3>& q_strides,
                                    const std::array<int64_t, 3>& k_strides,
                                    const std::array<int64_t, 3>& v_strides, float scale,
                                    bool causal, float softcap, int64_t window,
                                    uintptr_t sinks = 0) {
  AttentionArgs args{q,        k,        v,        kv_start, out,      sizes[0], sizes[1],
                     sizes[2], sizes[3], sizes[4], sizes[5], sizes[6], {},       {},
                     {},       scale,    causal,   softcap,  window,   sinks};
  for (int i = 0; i < 3; ++i) {
    args.q_strides[i] = q_strides[i];
    args.k_strides[i] = k_strides[i];
    args.v_strides[i] = v_strides[i];
  }
  return args;
}

struct DeltaRuleArgs {  // see bik/layers/delta_rule.py; every tensor fp32 and contiguous
  uintptr_t q, k;       // [B, H, T, K], q already scaled (and both L2-normed if asked)
  uintptr_t v;          // [B, H, T, V]
  uintptr_t decay;      // exp(g): [B, H, T], or [B, H, T, K] when decay_per_key
  uintptr_t beta;       // [B, H, T]
  uintptr_t state;      // [B, H, K, V]: the initial state, overwritten by the final one
  uintptr_t out;        // [B, H, T, V]
  int64_t B, H, T, K, V;
  bool decay_per_key;
};

struct SelectiveScanArgs {  // see bik/layers/mamba2.py; every tensor fp32 and contiguous
  uintptr_t decay;          // exp(dt * A): [B, H, T]
  uintptr_t dtx;            // dt * x: [B, H, T, P]
  uintptr_t b, c;           // [B, G, T, N], head h reading group h / heads_per_group
  uintptr_t state;          // [B, H, P, N]: the initial state, overwritten by the final one
  uintptr_t out;            // [B, H, T, P]: tree_N(S * C), before the skip D x
  int64_t B, H, T, P, N, heads_per_group;
};

}  // namespace bik
