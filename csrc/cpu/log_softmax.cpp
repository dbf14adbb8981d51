// log_softmax and token log-probs, one row per OpenMP iteration, fp32 math.
//
// Row statistics in a fixed order: the max over the row (exact, order-free), then the sum of
// exp(x/T - max) in the lane order of common.h. log_softmax and token_logprobs share
// row_stats() and log_prob(), so a token's log-prob equals the gathered log_softmax bit for bit.
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace bik {
namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct RowStats {
  float max, log_total;
};

// x / T as a type, so the loops compile without a branch inside. At T == 1 the division is
// skipped, which is exact (x / 1 == x in IEEE arithmetic).
struct Unscaled {
  float operator()(float x) const { return x; }
};
struct Scaled {
  float temperature;
  float operator()(float x) const { return x / temperature; }
};

template <typename Body>
void with_temperature(float temperature, Body&& body) {
  if (temperature == 1.0f)
    body(Unscaled{});
  else
    body(Scaled{temperature});
}

template <typename T, typename Scale>
RowStats row_stats(const T* x, int64_t V, Scale scale) {
  // The max is exact in any order. A NaN anywhere makes the exp sum NaN, hence the whole row.
  float lane_max[LANES];
  std::fill(lane_max, lane_max + LANES, NEG_INF);
  const int64_t full = V / LANES * LANES;
  auto take_max = [&](int l, float v) { lane_max[l] = v > lane_max[l] ? v : lane_max[l]; };
  for (int64_t i = 0; i < full; i += LANES)  // branch-free body, so it vectorises
    for (int l = 0; l < LANES; ++l) take_max(l, scale(to_float(x[i + l])));
  for (int64_t i = full; i < V; ++i) take_max(static_cast<int>(i - full), scale(to_float(x[i])));
  float row_max = NEG_INF;
  for (int l = 0; l < LANES; ++l) row_max = lane_max[l] > row_max ? lane_max[l] : row_max;
  const float shift = row_max == NEG_INF ? 0.0f : row_max;  // an all -inf row sums to 0
  // Sum of exp(x/T - max) in the lane order; tail lanes add nothing (exact).
  float acc[LANES] = {0};
  for (int64_t i = 0; i < full; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] += exp_nonpositive(scale(to_float(x[i + l])) - shift);
  for (int64_t i = full; i < V; ++i)
    acc[i - full] += exp_nonpositive(scale(to_float(x[i])) - shift);
  return {row_max, std::log(lane_sum(acc))};
}

template <typename Scale>
inline float log_prob(float x, Scale scale, const RowStats& s) {
  return (scale(x) - s.max) - s.log_total;
}

// A row as fp32: fp32 rows are read in place, 16-bit rows widened once into `buffer` (exact)
// so the three passes over the row do not each convert it.
template <typename T>
const float* fp32_row(const T* row, int64_t V, std::vector<float>& buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    if (static_cast<int64_t>(buffer.size()) < V) buffer.resize(V);
    for (int64_t i = 0; i < V; ++i) buffer[i] = to_float(row[i]);
    return buffer.data();
  }
}

// Calls body(r, row r as fp32, scale) for every row, one row per OpenMP iteration.
template <typename T, typename Body>
void for_each_row(const T* x, int64_t rows, int64_t V, int64_t stride, float temperature,
                  Body&& body) {
  with_temperature(temperature, [&](auto scale) {
#pragma omp parallel for schedule(static) if (worth_a_team(rows, rows * V, PARALLEL_ELEMENTS))
    for (int64_t r = 0; r < rows; ++r) {
      thread_local std::vector<float> buffer;  // kept across calls: no allocation per row
      body(r, fp32_row(x + r * stride, V, buffer), scale);
    }
  });
}

template <typename T, typename O>
void log_softmax_impl(const T* x, O* y, int64_t rows, int64_t V, int64_t stride,
                      float temperature) {
  for_each_row(x, rows, V, stride, temperature, [&](int64_t r, const float* xr, auto scale) {
    const RowStats s = row_stats(xr, V, scale);
    O* yr = y + r * V;
    for (int64_t i = 0; i < V; ++i) yr[i] = from_float<O>(log_prob(xr[i], scale, s));
  });
}

template <typename T>
void token_logprobs_impl(const T* x, const int64_t* tokens, float* out, int64_t rows, int64_t V,
                         int64_t stride, float temperature) {
  for_each_row(x, rows, V, stride, temperature, [&](int64_t r, const float* xr, auto scale) {
    out[r] = log_prob(xr[tokens[r]], scale, row_stats(xr, V, scale));
  });
}

}  // namespace

void log_softmax(int dtype, int out_dtype, uintptr_t x, uintptr_t y, int64_t rows, int64_t V,
                 int64_t stride, float temperature) {
  dispatch_dtype<CpuTypes>(dtype, [&](auto x_type) {
    using T = decltype(x_type);
    dispatch_dtype<CpuTypes>(out_dtype, [&](auto out_type) {
      using O = decltype(out_type);
      log_softmax_impl(reinterpret_cast<const T*>(x), reinterpret_cast<O*>(y), rows, V, stride,
                       temperature);
    });
  });
}

void token_logprobs(int dtype, uintptr_t x, uintptr_t tokens, uintptr_t out, int64_t rows,
                    int64_t V, int64_t stride, float temperature) {
  dispatch_dtype<CpuTypes>(dtype, [&](auto x_type) {
    using T = decltype(x_type);
    token_logprobs_impl(reinterpret_cast<const T*>(x), reinterpret_cast<const int64_t*>(tokens),
                        reinterpret_cast<float*>(out), rows, V, stride, temperature);
  });
}

}  // namespace bik
