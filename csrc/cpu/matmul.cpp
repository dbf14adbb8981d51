// Batch-invariant matmul: C[M, N] = A[M, K] . W[N, K]^T (+ bias), per batch entry.
//
// Reduction order of every output element: K in LANES interleaved fp32 partial sums (fma),
// ascending K, then the fixed lane tree (common.h). It depends only on K -- not on M, the
// tile the element falls in, or the thread that computes it -- so a row's bits never depend
// on the batch. Tiles and threads only decide WHO computes an element, never HOW.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace bik {
namespace {

constexpr int64_t ROW_CHUNK = 64;  // rows of A per task
constexpr int64_t COL_PANEL = 64;  // rows of W (output columns) per task
constexpr int RB = 4, CB = 4;      // register block: RB x CB outputs, each LANES wide

// Copies `rows` rows of length K into fp32, zero-padding K up to `padded` (a LANES multiple).
// Exact: conversion to fp32 and padding with zeros change no value of the sum.
template <typename T>
void pack(const T* src, int64_t row_stride, int64_t rows, int64_t K, int64_t padded, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * row_stride;
    float* d = dst + r * padded;
    for (int64_t k = 0; k < K; ++k) d[k] = to_float(s[k]);
    std::fill(d + K, d + padded, 0.0f);
  }
}

// R x C outputs from packed rows a[R][padded] and w[C][padded].
template <int R, int C>
void block(const float* a, const float* w, int64_t padded, float out[R][C]) {
  float acc[R][C][LANES] = {};
  for (int64_t k = 0; k < padded; k += LANES) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int l = 0; l < LANES; ++l)
          acc[r][c][l] = std::fma(a[r * padded + k + l], w[c * padded + k + l], acc[r][c][l]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = lane_sum(acc[r][c]);
}

template <typename T, int R, int C>
void store(const float* a, const float* w, int64_t padded, const T* bias, int64_t col0,
           T* c_row0, int64_t ldc) {
  float out[R][C];
  block<R, C>(a, w, padded, out);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float v = out[r][c];
      if (bias) v += to_float(bias[col0 + c]);  // epilogue in fp32, one rounding
      c_row0[r * ldc + col0 + c] = from_float<T>(v);
    }
}

template <typename T>
void matmul_impl(const MatmulArgs& p) {
  const T* A = reinterpret_cast<const T*>(p.a);
  const T* W = reinterpret_cast<const T*>(p.w);
  const T* bias = reinterpret_cast<const T*>(p.bias);
  T* Cm = reinterpret_cast<T*>(p.c);
  const int64_t padded = (p.K + LANES - 1) / LANES * LANES;
  const int64_t row_chunks = (p.M + ROW_CHUNK - 1) / ROW_CHUNK;
  const int64_t col_panels = (p.N + COL_PANEL - 1) / COL_PANEL;
  const int64_t tasks = p.batch * col_panels * row_chunks;
#pragma omp parallel
  {
    std::vector<float> a_buf(ROW_CHUNK * padded), w_buf(COL_PANEL * padded);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t b = t / (col_panels * row_chunks);
      const int64_t panel = (t / row_chunks) % col_panels, chunk = t % row_chunks;
      const int64_t row0 = chunk * ROW_CHUNK, rows = std::min(ROW_CHUNK, p.M - row0);
      const int64_t col0 = panel * COL_PANEL, cols = std::min(COL_PANEL, p.N - col0);
      pack(A + b * p.a_batch_stride + row0 * p.a_row_stride, p.a_row_stride, rows, p.K, padded,
           a_buf.data());
      pack(W + b * p.w_batch_stride + col0 * p.w_row_stride, p.w_row_stride, cols, p.K, padded,
           w_buf.data());
      T* c_base = Cm + b * p.M * p.N + row0 * p.N;
      // Full register blocks, then row and column tails with the same per-element arithmetic.
      int64_t r = 0;
      for (; r + RB <= rows; r += RB) {
        int64_t c = 0;
        for (; c + CB <= cols; c += CB)
          store<T, RB, CB>(&a_buf[r * padded], &w_buf[c * padded], padded, bias, col0 + c,
                           c_base + r * p.N, p.N);
        for (; c < cols; ++c)
          store<T, RB, 1>(&a_buf[r * padded], &w_buf[c * padded], padded, bias, col0 + c,
                          c_base + r * p.N, p.N);
      }
      for (; r < rows; ++r) {
        int64_t c = 0;
        for (; c + CB <= cols; c += CB)
          store<T, 1, CB>(&a_buf[r * padded], &w_buf[c * padded], padded, bias, col0 + c,
                          c_base + r * p.N, p.N);
        for (; c < cols; ++c)
          store<T, 1, 1>(&a_buf[r * padded], &w_buf[c * padded], padded, bias, col0 + c,
                         c_base + r * p.N, p.N);
      }
    }
  }
}

}  // namespace

void matmul(int dtype, const MatmulArgs& args) {
  switch (dtype) {
    case F32: return matmul_impl<float>(args);
    case BF16: return matmul_impl<bf16>(args);
    default: return matmul_impl<f16>(args);
  }
}

}  // namespace bik
