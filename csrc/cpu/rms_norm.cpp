// RMSNorm, one row per OpenMP iteration. Sum of squares in the lane order of common.h
// (depends only on D), then y = (x * inv_rms) * w in fp32 and one rounding.
#include "common.h"
#include "kernels.h"

namespace bik {
namespace {

template <typename T, typename W>
void rms_norm_impl(const T* x, const W* w, T* y, int64_t rows, int64_t D, int64_t stride,
                   float eps) {
#pragma omp parallel for schedule(static) if (worth_a_team(rows, rows * D, PARALLEL_ELEMENTS))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * stride;
    Vec acc = vzero();
    for (int64_t i = 0; i < D; i += LANES) {
      const Vec v = vload_n(xr + i, D - i);  // a tail's missing lanes are 0 and add nothing
      acc = vfma(v, v, acc);
    }
    const float inv_rms = 1.0f / std::sqrt(vsum(acc) / static_cast<float>(D) + eps);
    T* yr = y + r * D;
    for (int64_t i = 0; i < D; ++i)
      yr[i] = from_float<T>(to_float(xr[i]) * inv_rms * to_float(w[i]));
  }
}

}  // namespace

void rms_norm(int dtype, int w_dtype, uintptr_t x, uintptr_t w, uintptr_t y, int64_t rows,
              int64_t D, int64_t stride, float eps) {
  dispatch_dtype<CpuTypes>(dtype, [&](auto x_type) {
    using T = decltype(x_type);
    dispatch_dtype<CpuTypes>(w_dtype, [&](auto w_type) {
      using W = decltype(w_type);
      rms_norm_impl(reinterpret_cast<const T*>(x), reinterpret_cast<const W*>(w),
                    reinterpret_cast<T*>(y), rows, D, stride, eps);
    });
  });
}

}  // namespace bik
