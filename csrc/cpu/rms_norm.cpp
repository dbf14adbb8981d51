// RMSNorm, one row per OpenMP iteration. Sum of squares in the lane order of common.h
// (depends only on D), then y = (x * inv_rms) * w in fp32 and one rounding.
#include "common.h"
#include "kernels.h"

namespace bik {
namespace {

template <typename T, typename W>
void rms_norm_impl(const T* x, const W* w, T* y, int64_t rows, int64_t D, int64_t stride,
                   float eps) {
#pragma omp parallel for schedule(static) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * stride;
    Vec acc = vzero();
    for (int64_t i = 0; i < D; i += LANES) {
      const Vec v = vload_n(xr + i, D - i);  // a tail's missing lanes are 0 and add nothing
      acc = vfma(v, v, acc);
    }
    const float inv_rms = 1.0f / std::sqrt(vsum(acc) / static_cast<float>(D) + eps);
    T* yr = y + r * D;
    for (int64_t i = 0; i < D; ++i) yr[i] = from_float<T>(to_float(xr[i]) * inv_rms * to_float(w[i]));
  }
}

template <typename T>
void with_weight(int w_dtype, uintptr_t x, uintptr_t w, uintptr_t y, int64_t rows, int64_t D,
                 int64_t stride, float eps) {
  const T* xp = reinterpret_cast<const T*>(x);
  T* yp = reinterpret_cast<T*>(y);
  switch (w_dtype) {
    case F32: return rms_norm_impl(xp, reinterpret_cast<const float*>(w), yp, rows, D, stride, eps);
    case BF16: return rms_norm_impl(xp, reinterpret_cast<const bf16*>(w), yp, rows, D, stride, eps);
    default: return rms_norm_impl(xp, reinterpret_cast<const f16*>(w), yp, rows, D, stride, eps);
  }
}

}  // namespace

void rms_norm(int dtype, int w_dtype, uintptr_t x, uintptr_t w, uintptr_t y, int64_t rows,
              int64_t D, int64_t stride, float eps) {
  switch (dtype) {
    case F32: return with_weight<float>(w_dtype, x, w, y, rows, D, stride, eps);
    case BF16: return with_weight<bf16>(w_dtype, x, w, y, rows, D, stride, eps);
    default: return with_weight<f16>(w_dtype, x, w, y, rows, D, stride, eps);
  }
}

}  // namespace bik
