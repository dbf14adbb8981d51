// log_softmax and token log-probs, one row per OpenMP iteration, fp32 math.
//
// Row statistics in a fixed order: the max over the row (exact, order-free), then the sum of
// exp(x/T - max) in the lane order of common.h. log_softmax and token_logprobs share
// row_stats() and log_prob(), so a token's log-prob equals the gathered log_softmax bit for bit.
#include <algorithm>

#include "common.h"
#include "kernels.h"

namespace bik {
namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct RowStats { float max, log_total; };

// x / T; at T == 1 the division is skipped, which is exact (x / 1 == x in IEEE arithmetic).
// The test is loop-invariant, so the compiler unswitches the loops around it.
inline float scaled(float x, float temperature) { return temperature == 1.0f ? x : x / temperature; }

template <typename T>
RowStats row_stats(const T* x, int64_t V, float temperature) {
  // The max is exact in any order. A NaN anywhere makes the exp sum NaN, hence the whole row.
  float lane_max[LANES];
  std::fill(lane_max, lane_max + LANES, NEG_INF);
  for (int64_t i = 0; i < V; i += LANES) {
    const int64_t n = std::min<int64_t>(LANES, V - i);
    for (int l = 0; l < n; ++l) {
      const float v = scaled(to_float(x[i + l]), temperature);
      lane_max[l] = v > lane_max[l] ? v : lane_max[l];
    }
  }
  float row_max = NEG_INF;
  for (int l = 0; l < LANES; ++l) row_max = lane_max[l] > row_max ? lane_max[l] : row_max;
  const float shift = row_max == NEG_INF ? 0.0f : row_max;  // an all -inf row sums to 0
  // Sum of exp(x/T - max) in the lane order; tail lanes add nothing (exact).
  float acc[LANES] = {0};
  const int64_t full = V / LANES * LANES;
  for (int64_t i = 0; i < full; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += exp_fixed(scaled(to_float(x[i + l]), temperature) - shift);
  for (int64_t i = full; i < V; ++i) acc[i - full] += exp_fixed(scaled(to_float(x[i]), temperature) - shift);
  return {row_max, std::log(lane_sum(acc))};
}

inline float log_prob(float x, float temperature, const RowStats& s) {
  return (scaled(x, temperature) - s.max) - s.log_total;
}

template <typename T, typename O>
void log_softmax_impl(const T* x, O* y, int64_t rows, int64_t V, int64_t stride, float temperature) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * stride;
    const RowStats s = row_stats(xr, V, temperature);
    O* yr = y + r * V;
    for (int64_t i = 0; i < V; ++i) yr[i] = from_float<O>(log_prob(to_float(xr[i]), temperature, s));
  }
}

template <typename T>
void log_softmax_out(int out_dtype, uintptr_t x, uintptr_t y, int64_t rows, int64_t V,
                     int64_t stride, float temperature) {
  const T* xp = reinterpret_cast<const T*>(x);
  switch (out_dtype) {
    case F32: return log_softmax_impl(xp, reinterpret_cast<float*>(y), rows, V, stride, temperature);
    case BF16: return log_softmax_impl(xp, reinterpret_cast<bf16*>(y), rows, V, stride, temperature);
    default: return log_softmax_impl(xp, reinterpret_cast<f16*>(y), rows, V, stride, temperature);
  }
}

template <typename T>
void token_logprobs_impl(const T* x, const int64_t* tokens, float* out, int64_t rows, int64_t V,
                         int64_t stride, float temperature) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * stride;
    out[r] = log_prob(to_float(xr[tokens[r]]), temperature, row_stats(xr, V, temperature));
  }
}

}  // namespace

void log_softmax(int dtype, int out_dtype, uintptr_t x, uintptr_t y, int64_t rows, int64_t V,
                 int64_t stride, float temperature) {
  switch (dtype) {
    case F32: return log_softmax_out<float>(out_dtype, x, y, rows, V, stride, temperature);
    case BF16: return log_softmax_out<bf16>(out_dtype, x, y, rows, V, stride, temperature);
    default: return log_softmax_out<f16>(out_dtype, x, y, rows, V, stride, temperature);
  }
}

void token_logprobs(int dtype, uintptr_t x, uintptr_t tokens, uintptr_t out, int64_t rows,
                    int64_t V, int64_t stride, float temperature) {
  const int64_t* tok = reinterpret_cast<const int64_t*>(tokens);
  float* o = reinterpret_cast<float*>(out);
  switch (dtype) {
    case F32: return token_logprobs_impl(reinterpret_cast<const float*>(x), tok, o, rows, V, stride, temperature);
    case BF16: return token_logprobs_impl(reinterpret_cast<const bf16*>(x), tok, o, rows, V, stride, temperature);
    default: return token_logprobs_impl(reinterpret_cast<const f16*>(x), tok, o, rows, V, stride, temperature);
  }
}

}  // namespace bik
