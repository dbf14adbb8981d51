// bik's CUDA kernels: the same fixed orders as the CPU backend, one thread block per row.
//
// Orders (independent of the batch, of the grid size and of the GPU's SM count):
//   * row reductions: thread t of a 256-thread block sums elements t, t + 256, ... in order,
//     then a fixed shared-memory tree (halving strides 128, 64, ..., 1) combines the threads;
//   * matmul: each output element is one thread's fp32 fma chain over ascending k;
//   * attention: per query row, 32-key blocks counted from the row's first valid key, grouped
//     into fixed-size splits; an online softmax runs over a split's blocks in ascending order
//     (one block of threads per (row, split)), then the split partials are merged in ascending
//     split order by a second kernel. A sliding window only masks keys (blocks and splits stay
//     counted from the row's first valid key): blocks and splits wholly before the query's
//     window are skipped, keys before it in its first block score -inf. Soft-capping maps each
//     score s to softcap * tanhf(s / softcap) before the mask.
// Everything is launched on the caller's stream (torch.cuda.current_stream()).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "bik/contract.h"
#include "bik/dispatch.h"
#include "kernels.h"

namespace bik_cuda {
namespace {

constexpr int THREADS = bik::CUDA_ROW_THREADS;
using bik::KEY_BLOCK;
constexpr int TILE = 16;  // matmul tile edge

__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float to_float(__half x) { return __half2float(x); }
template <typename T>
__device__ inline T from_float(float x);
template <>
__device__ inline float from_float<float>(float x) {
  return x;
}
template <>
__device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ inline __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// Fixed tree over the block's THREADS partials; every thread gets the result.
template <bool MAX>
__device__ float block_reduce(float value, float* shared) {
  shared[threadIdx.x] = value;
  __syncthreads();
  for (int stride = THREADS / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float a = shared[threadIdx.x], b = shared[threadIdx.x + stride];
      shared[threadIdx.x] = MAX ? fmaxf(a, b) : a + b;
    }
    __syncthreads();
  }
  const float result = shared[0];
  __syncthreads();
  return result;
}

template <typename T, typename W>
__global__ void rms_norm_kernel(const T* x, const W* w, T* y, int64_t D, int64_t stride,
                                float eps) {
  __shared__ float shared[THREADS];
  const T* xr = x + blockIdx.x * stride;
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += THREADS)
    acc = fmaf(to_float(xr[i]), to_float(xr[i]), acc);
  const float inv_rms =
      1.0f / sqrtf(block_reduce<false>(acc, shared) / static_cast<float>(D) + eps);
  for (int64_t i = threadIdx.x; i < D; i += THREADS)
    y[blockIdx.x * D + i] = from_float<T>(to_float(xr[i]) * inv_rms * to_float(w[i]));
}

struct RowStats {
  float max, log_total;
};

template <typename T>
__device__ RowStats row_stats(const T* xr, int64_t V, float temperature, float* shared) {
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += THREADS)
    m = fmaxf(m, __fdiv_rn(to_float(xr[i]), temperature));
  const float row_max = block_reduce<true>(m, shared);
  const float shift = row_max == -INFINITY ? 0.0f : row_max;
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < V; i += THREADS)
    s += expf(__fdiv_rn(to_float(xr[i]), temperature) - shift);
  return {row_max, logf(block_reduce<false>(s, shared))};
}

__device__ inline float log_prob(float x, float temperature, RowStats s) {
  return (__fdiv_rn(x, temperature) - s.max) - s.log_total;
}

template <typename T, typename O>
__global__ void log_softmax_kernel(const T* x, O* y, int64_t V, int64_t stride, float temperature) {
  __shared__ float shared[THREADS];
  const T* xr = x + blockIdx.x * stride;
  const RowStats s = row_stats(xr, V, temperature, shared);
  for (int64_t i = threadIdx.x; i < V; i += THREADS)
    y[blockIdx.x * V + i] = from_float<O>(log_prob(to_float(xr[i]), temperature, s));
}

template <typename T>
__global__ void token_logprobs_kernel(const T* x, const int64_t* tokens, float* out, int64_t V,
                                      int64_t stride, float temperature) {
  __shared__ float shared[THREADS];
  const T* xr = x + blockIdx.x * stride;
  const RowStats s = row_stats(xr, V, temperature, shared);
  if (threadIdx.x == 0)
    out[blockIdx.x] = log_prob(to_float(xr[tokens[blockIdx.x]]), temperature, s);
}

// C[b] = A[b] . B[b] (+ bias): one thread per output element, fma over ascending k.
template <typename T>
__global__ void matmul_kernel(const T* A, const T* B, const T* bias, T* C, int64_t M, int64_t N,
                              int64_t K, int64_t a_batch, int64_t a_row, int64_t b_batch,
                              int64_t b_k, int64_t b_n) {
  __shared__ float a_tile[TILE][TILE], b_tile[TILE][TILE];
  const int64_t batch = blockIdx.z, row = blockIdx.y * TILE + threadIdx.y,
                col = blockIdx.x * TILE + threadIdx.x;
  const T* a = A + batch * a_batch;
  const T* b = B + batch * b_batch;
  float acc = 0.0f;
  for (int64_t k0 = 0; k0 < K; k0 += TILE) {
    const int64_t ka = k0 + threadIdx.x, kb = k0 + threadIdx.y;
    a_tile[threadIdx.y][threadIdx.x] = row < M && ka < K ? to_float(a[row * a_row + ka]) : 0.0f;
    b_tile[threadIdx.y][threadIdx.x] = kb < K && col < N ? to_float(b[kb * b_k + col * b_n]) : 0.0f;
    __syncthreads();
    for (int k = 0; k < TILE && k0 + k < K; ++k)
      acc = fmaf(a_tile[threadIdx.y][k], b_tile[k][threadIdx.x], acc);
    __syncthreads();
  }
  if (row < M && col < N) {
    const float v = bias ? acc + to_float(bias[col]) : acc;
    C[(batch * M + row) * N + col] = from_float<T>(v);
  }
}

// A row's first key, clamped into the keys: a device-side raise would cost a sync per call,
// and a kv_start written where no version counter saw it (past bik's checks) must not make
// the kernel read out of bounds.
__device__ inline int64_t first_key(const AttentionArgs& p, int64_t b) {
  const int64_t given = reinterpret_cast<const int32_t*>(p.kv_start)[b];
  return min(max(given, int64_t{0}), max(p.Tk - 1, int64_t{0}));
}

// One block per (query row, split): online softmax over the split's key blocks, ascending.
// Threads 0..31 score one key each (sequential fma over d); thread d < D owns acc[d].
template <typename T>
__global__ void attention_split_kernel(AttentionArgs p, float* part_acc, float* part_max,
                                       float* part_sum, int64_t n_splits) {
  __shared__ float q[1024], probs[KEY_BLOCK], stats[2];
  const int64_t row = blockIdx.x, split = blockIdx.y;
  const int64_t b = row / (p.Hq * p.Tq), h = (row / p.Tq) % p.Hq, i = row % p.Tq;
  const int64_t kv_h = h / (p.Hq / p.Hkv);
  const T* qr = reinterpret_cast<const T*>(p.q) + b * p.q_strides[0] + h * p.q_strides[1] +
                i * p.q_strides[2];
  const T* kb = reinterpret_cast<const T*>(p.k) + b * p.k_strides[0] + kv_h * p.k_strides[1];
  const T* vb = reinterpret_cast<const T*>(p.v) + b * p.v_strides[0] + kv_h * p.v_strides[1];
  const int64_t first = first_key(p, b);
  const int64_t last = p.causal ? p.Tk - p.Tq + i : p.Tk - 1;
  const int64_t visible =
      p.window > 0 ? max(first, last - p.window + 1) : first;  // window's first key
  for (int64_t d = threadIdx.x; d < p.D; d += blockDim.x) q[d] = to_float(qr[d]);
  float acc = 0.0f, run_max = -INFINITY, run_sum = 0.0f;
  const int64_t lo = first + split * p.split_size;
  const int64_t hi = min(lo + p.split_size, last + 1);
  // Blocks wholly before the window are skipped (a whole split may be: its partial stays empty).
  const int64_t start = visible > lo ? lo + (visible - lo) / KEY_BLOCK * KEY_BLOCK : lo;
  __syncthreads();
  for (int64_t n0 = start; n0 < hi; n0 += KEY_BLOCK) {
    const int64_t count = min(static_cast<int64_t>(KEY_BLOCK), hi - n0);
    if (threadIdx.x < KEY_BLOCK) {
      float score = -INFINITY;
      if (threadIdx.x < count && n0 + threadIdx.x >= visible) {
        const T* kr = kb + (n0 + threadIdx.x) * p.k_strides[2];
        float dot = 0.0f;
        for (int64_t d = 0; d < p.D; ++d) dot = fmaf(q[d], to_float(kr[d]), dot);
        score = dot * p.scale;
        if (p.softcap > 0.0f) score = tanhf(score / p.softcap) * p.softcap;
      }
      probs[threadIdx.x] = score;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // block max and rescale, in ascending key order
      float block_max = -INFINITY;
      for (int j = 0; j < count; ++j) block_max = fmaxf(block_max, probs[j]);
      const float new_max = fmaxf(run_max, block_max);
      const float safe = new_max == -INFINITY ? 0.0f : new_max;
      float sum = 0.0f;
      for (int j = 0; j < KEY_BLOCK; ++j) {
        probs[j] = j < count ? expf(probs[j] - safe) : 0.0f;
        sum += probs[j];
      }
      stats[0] = expf(run_max - safe);
      stats[1] = new_max;
      run_sum = run_sum * stats[0] + sum;
    }
    __syncthreads();
    const float rescale = stats[0];
    run_max = stats[1];
    if (threadIdx.x < p.D) {
      acc *= rescale;
      for (int j = 0; j < count; ++j)
        acc = fmaf(probs[j], to_float(vb[(n0 + j) * p.v_strides[2] + threadIdx.x]), acc);
    }
    __syncthreads();
  }
  const int64_t slot = row * n_splits + split;
  if (threadIdx.x < p.D) part_acc[slot * p.D + threadIdx.x] = acc;
  if (threadIdx.x == 0) {
    part_max[slot] = run_max;
    part_sum[slot] = run_sum;
  }
}

// One block per query row: merge its splits in ascending order, normalise, store.
template <typename T>
__global__ void attention_combine_kernel(AttentionArgs p, const float* part_acc,
                                         const float* part_max, const float* part_sum,
                                         int64_t n_splits) {
  const int64_t row = blockIdx.x;
  const int64_t b = row / (p.Hq * p.Tq), i = row % p.Tq;
  const int64_t first = first_key(p, b);
  const int64_t last = p.causal ? p.Tk - p.Tq + i : p.Tk - 1;
  const int64_t own = last >= first ? (last - first) / p.split_size + 1 : 0;
  const int64_t skipped =
      p.window > 0 ? (max(first, last - p.window + 1) - first) / p.split_size : 0;
  float run_max = -INFINITY, run_sum = 0.0f, acc = 0.0f;
  for (int64_t s = skipped; s < own; ++s) {  // splits wholly before the window hold nothing
    const int64_t slot = row * n_splits + s;
    const float m = part_max[slot];
    const float new_max = fmaxf(run_max, m);
    const float safe = new_max == -INFINITY ? 0.0f : new_max;
    const float old_scale = expf(run_max - safe), part_scale = expf(m - safe);
    run_sum = run_sum * old_scale + part_sum[slot] * part_scale;
    if (threadIdx.x < p.D) acc = acc * old_scale + part_acc[slot * p.D + threadIdx.x] * part_scale;
    run_max = new_max;
  }
  if (threadIdx.x < p.D)
    reinterpret_cast<T*>(p.out)[row * p.D + threadIdx.x] =
        from_float<T>(run_sum == 0.0f ? 0.0f : acc / run_sum);
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("bik cuda ") + what + ": " + cudaGetErrorString(status));
}

// The element type of each dtype code, for bik::dispatch_dtype.
struct CudaTypes {
  using Float = float;
  using BFloat16 = __nv_bfloat16;
  using Half = __half;
};

}  // namespace

void rms_norm(int dtype, int w_dtype, uintptr_t x, uintptr_t w, uintptr_t y, int64_t rows,
              int64_t D, int64_t stride, float eps, uintptr_t stream) {
  bik::dispatch_dtype<CudaTypes>(dtype, [&](auto xt) {
    using T = decltype(xt);
    bik::dispatch_dtype<CudaTypes>(w_dtype, [&](auto wt) {
      using W = decltype(wt);
      rms_norm_kernel<T, W><<<rows, THREADS, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
          reinterpret_cast<const T*>(x), reinterpret_cast<const W*>(w), reinterpret_cast<T*>(y), D,
          stride, eps);
    });
  });
  check(cudaGetLastError(), "rms_norm");
}

void log_softmax(int dtype, int out_dtype, uintptr_t x, uintptr_t y, int64_t rows, int64_t V,
                 int64_t stride, float temperature, uintptr_t stream) {
  bik::dispatch_dtype<CudaTypes>(dtype, [&](auto xt) {
    using T = decltype(xt);
    bik::dispatch_dtype<CudaTypes>(out_dtype, [&](auto ot) {
      using O = decltype(ot);
      log_softmax_kernel<T, O><<<rows, THREADS, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
          reinterpret_cast<const T*>(x), reinterpret_cast<O*>(y), V, stride, temperature);
    });
  });
  check(cudaGetLastError(), "log_softmax");
}

void token_logprobs(int dtype, uintptr_t x, uintptr_t tokens, uintptr_t out, int64_t rows,
                    int64_t V, int64_t stride, float temperature, uintptr_t stream) {
  bik::dispatch_dtype<CudaTypes>(dtype, [&](auto xt) {
    using T = decltype(xt);
    token_logprobs_kernel<T><<<rows, THREADS, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        reinterpret_cast<const T*>(x), reinterpret_cast<const int64_t*>(tokens),
        reinterpret_cast<float*>(out), V, stride, temperature);
  });
  check(cudaGetLastError(), "token_logprobs");
}

void matmul(int dtype, const MatmulArgs& a, uintptr_t stream) {
  const dim3 block(TILE, TILE), grid((a.N + TILE - 1) / TILE, (a.M + TILE - 1) / TILE, a.batch);
  bik::dispatch_dtype<CudaTypes>(dtype, [&](auto t) {
    using T = decltype(t);
    matmul_kernel<T><<<grid, block, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        reinterpret_cast<const T*>(a.a), reinterpret_cast<const T*>(a.b),
        reinterpret_cast<const T*>(a.bias), reinterpret_cast<T*>(a.c), a.M, a.N, a.K,
        a.a_batch_stride, a.a_row_stride, a.b_batch_stride, a.b_k_stride, a.b_n_stride);
  });
  check(cudaGetLastError(), "matmul");
}

void attention(int dtype, const AttentionArgs& p, uintptr_t scratch, int64_t n_splits,
               uintptr_t stream) {
  if (p.D > 1024) throw std::runtime_error("bik cuda attention: head dim above 1024");
  const int64_t rows = p.B * p.Hq * p.Tq;
  float* part_acc = reinterpret_cast<float*>(scratch);
  float* part_max = part_acc + rows * n_splits * p.D;
  float* part_sum = part_max + rows * n_splits;
  const int threads = static_cast<int>(p.D < KEY_BLOCK ? KEY_BLOCK : (p.D + 31) / 32 * 32);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  bik::dispatch_dtype<CudaTypes>(dtype, [&](auto t) {
    using T = decltype(t);
    attention_split_kernel<T>
        <<<dim3(rows, n_splits), threads, 0, s>>>(p, part_acc, part_max, part_sum, n_splits);
    attention_combine_kernel<T><<<rows, threads, 0, s>>>(p, part_acc, part_max, part_sum, n_splits);
  });
  check(cudaGetLastError(), "attention");
}

}  // namespace bik_cuda
