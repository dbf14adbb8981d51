// The invariance contract's numbers, shared by the cpu and cuda backends. bik/contract.py
// holds the same values (the bindings export these and a test compares them), and its
// docstring states each op's reduction order.
#pragma once

#include <cstdint>

namespace bik {

// Attention visits keys in blocks of KEY_BLOCK counted from each row's first valid key, and
// groups the blocks into splits of a fixed number of keys (a multiple of KEY_BLOCK).
constexpr int64_t KEY_BLOCK = 32;
constexpr int64_t DEFAULT_SPLIT_SIZE = 256;

// cpu backend: row reductions and dot products run in CPU_LANES interleaved partial sums
// (lane l takes elements l, l + CPU_LANES, ...), then one fixed pairwise tree.
constexpr int CPU_LANES = 16;

// cuda backend: a row reduction runs on CUDA_ROW_THREADS threads (thread t takes elements
// t, t + CUDA_ROW_THREADS, ...), then one fixed shared-memory tree.
constexpr int CUDA_ROW_THREADS = 256;

// How a tensor's dtype is passed from Python (bik.contract.DTYPE_CODES).
enum DType : int { F32 = 0, BF16 = 1, F16 = 2 };

}  // namespace bik
