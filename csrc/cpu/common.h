// Shared pieces of the CPU kernels: element types, fixed-width lanes, a deterministic exp.
//
// Every reduction here has ONE order that does not depend on the number of rows, the
// thread count or the SIMD width the compiler picks:
//   * sums over a row run in LANES interleaved partial sums (lane l takes elements
//     l, l + LANES, ...), then one fixed pairwise tree across the lanes (lane_sum);
//   * a tail shorter than LANES is zero-padded and goes through the same lane code, so a
//     vector body and a tail never use different arithmetic;
//   * products are accumulated with a fused multiply-add (std::fma or its vector form: one
//     rounding) everywhere -- bf16 matmul on AVX512-BF16 CPUs documents its own pair order
//     in matmul.cpp -- and the build uses -ffp-contract=off so the compiler never fuses some
//     a*b+c and not others.
// OpenMP splits work by output rows only: each output element is computed by one thread.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bik/contract.h"
#include "bik/dispatch.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace bik {

constexpr int LANES = CPU_LANES;

// Calls with less work than these run on one thread: waking an OpenMP team costs
// microseconds on a quiet machine and a scheduler time slice on a busy one. Threads decide
// who computes a row, never how: the bits do not change.
constexpr int64_t PARALLEL_FMAS = int64_t{1} << 20;      // matmul, attention: multiply-adds
constexpr int64_t PARALLEL_ELEMENTS = int64_t{1} << 16;  // row ops: elements read
inline bool worth_a_team(int64_t rows, int64_t work, int64_t threshold) {
  return rows > 1 && work >= threshold;
}

// The smallest power of two >= n (>= 1): the width the recurrences' trees pad their sums to.
inline int64_t power_of_two_at_least(int64_t n) {
  int64_t width = 1;
  while (width < n) width *= 2;
  return width;
}

struct bf16 {
  uint16_t bits;
};
using f16 = _Float16;

// The element type of each dtype code, for dispatch_dtype.
struct CpuTypes {
  using Float = float;
  using BFloat16 = bf16;
  using Half = f16;
};

inline float to_float(float x) { return x; }
inline float to_float(f16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline f16 from_float<f16>(float x) {
  return static_cast<f16>(x);
}
template <>
inline bf16 from_float<bf16>(float x) {  // round to nearest even, like torch
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40;
  return bf16{static_cast<uint16_t>(x != x ? quiet_nan : rounded)};  // branch-free select
}

// The fixed pairwise tree over the LANES partial sums.
inline float lane_sum(const float* lanes) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = lanes[l] + lanes[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// Vec: LANES fp32 lanes. With AVX-512 one zmm register, with AVX2 + FMA + F16C two ymm
// registers, elsewhere a plain array; all do the same IEEE operation per lane (vfma is one
// fused rounding in each), so the bits agree.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
struct Vec {
  __m512 v;
};
constexpr int VEC_REGISTERS = 1;  // of the 32 zmm
inline Vec vzero() { return {_mm512_setzero_ps()}; }
inline Vec vbroadcast(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline Vec vmul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }

// The first n (<= LANES) elements at p, widened to fp32 (exact), zeros in the other lanes.
inline __mmask16 first_lanes(int64_t n) {
  return n >= LANES ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}
inline Vec vload_n(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(first_lanes(n), p)}; }
inline Vec vload_n(const bf16* p, int64_t n) {
  const __m256i bits = _mm256_maskz_loadu_epi16(first_lanes(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
}
inline Vec vload_n(const f16* p, int64_t n) {
  return {_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(n), p))};
}

// lane_sum's tree with shuffles: lanes l + (l+8), then l + (l+4), then (0+2) + (1+3).
inline float vsum(Vec a) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Vec {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
constexpr int VEC_REGISTERS = 2;  // of the 16 ymm
inline Vec vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec vbroadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, Vec a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Vec vmul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec vfma(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

// The first n (<= LANES) elements at p, widened to fp32 (exact), zeros in the other lanes:
// 8 at a time from full rows, a tail through a zero-filled copy.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <typename T>
inline Vec vload_n(const T* p, int64_t n) {
  if (n >= LANES) return {load8(p), load8(p + 8)};
  T tail[LANES];
  std::memset(tail, 0, sizeof tail);  // all-zero bits: +0 in every dtype
  std::memcpy(tail, p, static_cast<size_t>(n) * sizeof(T));
  return {load8(tail), load8(tail + 8)};
}

// lane_sum's tree with shuffles: lanes l + (l+8), then l + (l+4), then (0+2) + (1+3).
inline float vsum(Vec a) {
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#else
struct Vec {
  float v[LANES];
};
constexpr int VEC_REGISTERS = LANES;  // scalar registers: blocking cannot keep it in them
inline Vec vbroadcast(float x) {
  Vec r;
  std::fill(r.v, r.v + LANES, x);
  return r;
}
inline Vec vzero() { return vbroadcast(0.0f); }
inline Vec vload(const float* p) {
  Vec r;
  std::copy(p, p + LANES, r.v);
  return r;
}
inline void vstore(float* p, Vec a) { std::copy(a.v, a.v + LANES, p); }
inline Vec vmul(Vec a, Vec b) {
  for (int l = 0; l < LANES; ++l) a.v[l] *= b.v[l];
  return a;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int l = 0; l < LANES; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
  return c;
}
template <typename T>
inline Vec vload_n(const T* p, int64_t n) {
  Vec r;
  for (int l = 0; l < LANES; ++l) r.v[l] = l < n ? to_float(p[l]) : 0.0f;
  return r;
}
inline float vsum(Vec a) { return lane_sum(a.v); }
#endif

// Dot product of two length-n rows: lane l sums elements l, l + LANES, ... with one fma each,
// then lane_sum. ``q`` is fp32 zero-padded to a multiple of LANES; ``k``'s tail is zero-filled.
template <typename T>
inline float dot_lanes(const float* q, const T* k, int64_t n) {
  Vec acc = vzero();
  for (int64_t i = 0; i < n; i += LANES) acc = vfma(vload(q + i), vload_n(k + i, n - i), acc);
  return vsum(acc);
}

// exp(x) for x <= 0 -- every use is exp(value - running max) -- from pure arithmetic: range
// reduction + Cephes' degree-6 polynomial, about 1 ulp. Results below 2^-126 (x < -87) flush
// to 0 (they could not move a sum that holds exp(0) = 1); -inf gives 0 and NaN stays NaN.
// Branch-free, so loops over it vectorise, and a vector lane and a scalar call give the same
// bits (the same IEEE operations in the same order).
inline float exp_nonpositive(float x) {
  constexpr float LOWEST = -87.0f;
  constexpr float ROUNDER =
      12582912.0f;  // 1.5 * 2^23: t = y + ROUNDER holds round(y) in its low bits
  const float xc = x < LOWEST ? LOWEST : x;  // a comparison with NaN is false: NaN flows through
  const float t = std::fma(xc, 1.44269504088896341f, ROUNDER);
  const float n = t - ROUNDER;                     // round(x / ln2), exact
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
