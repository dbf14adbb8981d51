// Shared pieces of the CPU kernels: element types, fixed-width lanes, a deterministic exp.
//
// Every reduction here has ONE order that does not depend on the number of rows, the
// thread count or the SIMD width the compiler picks:
//   * sums over a row run in LANES interleaved partial sums (lane l takes elements
//     l, l + LANES, ...), then one fixed pairwise tree across the lanes (lane_sum);
//   * a tail shorter than LANES is zero-padded and goes through the same lane code, so a
//     vector body and a tail never use different arithmetic;
//   * products are accumulated with std::fma (one rounding) everywhere, and the build uses
//     -ffp-contract=off so the compiler never fuses some a*b+c and not others.
// OpenMP splits work by output rows only: each output element is computed by one thread.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace bik {

constexpr int LANES = 16;

enum DType : int { F32 = 0, BF16 = 1, F16 = 2 };

struct bf16 { uint16_t bits; };
using f16 = _Float16;

inline float to_float(float x) { return x; }
inline float to_float(f16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T> inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline f16 from_float<f16>(float x) { return static_cast<f16>(x); }
template <> inline bf16 from_float<bf16>(float x) {  // round to nearest even, like torch
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40;
  return bf16{static_cast<uint16_t>(x != x ? quiet_nan : rounded)};  // branch-free select
}

// Loads up to LANES elements starting at p (n of them valid) as floats, zero-padding the rest.
template <typename T>
inline void load_lanes(const T* p, int64_t n, float* out) {
  if (n >= LANES) {
    for (int l = 0; l < LANES; ++l) out[l] = to_float(p[l]);
  } else {
    for (int l = 0; l < LANES; ++l) out[l] = l < n ? to_float(p[l]) : 0.0f;
  }
}

// The fixed pairwise tree over the LANES partial sums.
inline float lane_sum(const float* lanes) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = lanes[l] + lanes[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// Dot product of two length-n rows in the lane order above.
// ``q`` is zero-padded to a multiple of LANES; the tail of ``k`` is zero-padded on the fly.
template <typename T>
inline float dot_lanes(const float* q, const T* k, int64_t n) {
  float acc[LANES] = {0};
  const int64_t full = n / LANES * LANES;
  for (int64_t i = 0; i < full; i += LANES)  // branch-free body, so it vectorises
    for (int l = 0; l < LANES; ++l) acc[l] = std::fma(q[i + l], to_float(k[i + l]), acc[l]);
  if (full < n) {
    float kv[LANES];
    load_lanes(k + full, n - full, kv);
    for (int l = 0; l < LANES; ++l) acc[l] = std::fma(q[full + l], kv[l], acc[l]);
  }
  return lane_sum(acc);
}

// exp(x) for x <= 0 -- every use is exp(value - running max) -- from pure arithmetic: range
// reduction + Cephes' degree-6 polynomial, about 1 ulp. Results below 2^-126 (x < -87) flush
// to 0 (they could not move a sum that holds exp(0) = 1); -inf gives 0 and NaN stays NaN.
// Branch-free, so loops over it vectorise, and a vector lane and a scalar call give the same
// bits (the same IEEE operations in the same order).
inline float exp_nonpositive(float x) {
  constexpr float LOWEST = -87.0f;
  constexpr float ROUNDER = 12582912.0f;  // 1.5 * 2^23: t = y + ROUNDER holds round(y) in its low bits
  const float xc = x < LOWEST ? LOWEST : x;  // a comparison with NaN is false: NaN flows through
  const float t = std::fma(xc, 1.44269504088896341f, ROUNDER);
  const float n = t - ROUNDER;  // round(x / ln2), exact
  float r = std::fma(n, -0.693145751953125f, xc);  // ln2 split in two for an exact product
  r = std::fma(n, -1.428606765330187045e-06f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;
  int32_t t_bits;  // the integer n sits in t's low mantissa bits: build 2^n from it
  std::memcpy(&t_bits, &t, sizeof t_bits);
  const uint32_t scale_bits = static_cast<uint32_t>(t_bits - 0x4B400000 + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return x < LOWEST ? 0.0f : p * scale;
}

}  // namespace bik
