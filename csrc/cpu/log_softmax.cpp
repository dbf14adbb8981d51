// log_softmax and token log-probs, one row per OpenMP iteration, fp32 math.
//
// Row statistics in a fixed order: the max over the row (exact, order-free), then the sum of
// exp(x/T - max) in the lane order of common.h. log_softmax and token_logprobs share
// row_stats() and log_prob(), so a token's log-prob equals the gathered log_softmax bit for bit.
#include "common.h"
#include "kernels.h"

namespace bik {
namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct RowStats { float max, log_total; };

template <typename T>
RowStats row_stats(const T* x, int64_t V, float temperature) {
  float row_max = NEG_INF;
  bool nan = false;
  for (int64_t i = 0; i < V; ++i) {
    const float v = to_float(x[i]) / temperature;
    nan |= std::isnan(v);
    row_max = v > row_max ? v : row_max;
  }
  if (nan) return {std::numeric_limits<float>::quiet_NaN(), 0.0f};
  const float shift = row_max == NEG_INF ? 0.0f : row_max;  // an all -inf row sums to 0
  float acc[LANES] = {0};
  for (int64_t i = 0; i < V; i += LANES) {
    float v[LANES];
    const int64_t n = V - i;
    for (int l = 0; l < LANES; ++l)  // padding lanes add exp(-inf) = 0
      v[l] = l < n ? exp_fixed(to_float(x[i + l]) / temperature - shift) : 0.0f;
    for (int l = 0; l < LANES; ++l) acc[l] += v[l];
  }
  return {row_max, std::log(lane_sum(acc))};
}

inline float log_prob(float x, float temperature, const RowStats& s) {
  return (x / temperature - s.max) - s.log_total;
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
