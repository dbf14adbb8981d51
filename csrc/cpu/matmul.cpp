// Batch-invariant matmul: C[M, N] = A[M, K] . B[K, N] (+ bias), per batch entry.
//
// Reduction order of every output element: ascending k, one fp32 fma per k into a single
// accumulator (c = fma(a[m,k], b[k,n], c) for k = 0, 1, ..., K-1). It depends only on K --
// not on M, on the tile the element falls in, or on the thread that computes it -- so a row's
// bits never depend on the batch. Tiles and threads decide WHO computes an element, never HOW.
// Vector lanes run along N (16 output columns per vector), so no lane reduction is needed.
#include <algorithm>
#include <vector>

#include "common.h"
#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace bik {
namespace {

constexpr int64_t ROW_CHUNK = 96;  // rows of A per task (a multiple of RB)
constexpr int64_t PANEL = 64;      // output columns per task = VECS vectors of LANES
constexpr int VECS = PANEL / LANES;
constexpr int RB = 6;              // rows per register block: RB x VECS accumulators

#if defined(__AVX512F__)
struct Vec { __m512 v; };
inline Vec vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec vbroadcast(float x) { return {_mm512_set1_ps(x)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec vzero() { return {_mm512_setzero_ps()}; }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
#else  // portable lanes: the same fma per element, whatever the compiler vectorises
struct Vec { float v[LANES]; };
inline Vec vload(const float* p) { Vec r; std::copy(p, p + LANES, r.v); return r; }
inline Vec vbroadcast(float x) { Vec r; std::fill(r.v, r.v + LANES, x); return r; }
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int l = 0; l < LANES; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
  return c;
}
inline Vec vzero() { return vbroadcast(0.0f); }
inline void vstore(float* p, Vec a) { std::copy(a.v, a.v + LANES, p); }
#endif

// Packing only moves and widens values (exact); it never changes an element's sum.
// A rows -> fp32 blocks of RB rows, k-major ([K][RB] per block) so a block's RB values for
// one k sit together; rows past `rows` are zero (computed, never stored).
template <typename T>
void pack_a(const T* a, int64_t row_stride, int64_t rows, int64_t K, float* dst) {
  for (int64_t r0 = 0; r0 < rows; r0 += RB) {
    float* block = dst + r0 * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < RB; ++r)
        block[k * RB + r] = r0 + r < rows ? to_float(a[(r0 + r) * row_stride + k]) : 0.0f;
  }
}

// B columns [col0, col0 + cols) -> fp32 [K][PANEL], zero past `cols`. Read in 16-deep k
// tiles so a transposed B (nn.Linear's W^T) is read along its contiguous rows.
template <typename T>
void pack_b(const T* b, int64_t k_stride, int64_t n_stride, int64_t cols, int64_t K, float* dst) {
  constexpr int64_t TILE = 16;
  for (int64_t k0 = 0; k0 < K; k0 += TILE) {
    const int64_t depth = std::min(TILE, K - k0);
    for (int64_t c = 0; c < PANEL; ++c)
      for (int64_t i = 0; i < depth; ++i)
        dst[(k0 + i) * PANEL + c] = c < cols ? to_float(b[(k0 + i) * k_stride + c * n_stride]) : 0.0f;
  }
}

// R rows x PANEL columns: acc[r][v] = sum over ascending k of a[k][r] * b[k][v-th vector].
template <int R>
void block(const float* a, const float* b, int64_t K, float out[][PANEL]) {
  Vec acc[R][VECS];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    Vec bv[VECS];
    for (int v = 0; v < VECS; ++v) bv[v] = vload(b + k * PANEL + v * LANES);
    for (int r = 0; r < R; ++r) {
      const Vec av = vbroadcast(a[k * RB + r]);
      for (int v = 0; v < VECS; ++v) acc[r][v] = vfma(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < VECS; ++v) vstore(out[r] + v * LANES, acc[r][v]);
}

void block_rows(int rows, const float* a, const float* b, int64_t K, float out[][PANEL]) {
  switch (rows) {  // every size runs the same per-element arithmetic
    case 6: return block<6>(a, b, K, out);
    case 5: return block<5>(a, b, K, out);
    case 4: return block<4>(a, b, K, out);
    case 3: return block<3>(a, b, K, out);
    case 2: return block<2>(a, b, K, out);
    default: return block<1>(a, b, K, out);
  }
}

template <typename T>
void matmul_impl(const MatmulArgs& p) {
  const T* A = reinterpret_cast<const T*>(p.a);
  const T* B = reinterpret_cast<const T*>(p.b);
  const T* bias = reinterpret_cast<const T*>(p.bias);
  T* C = reinterpret_cast<T*>(p.c);
  const int64_t row_chunks = (p.M + ROW_CHUNK - 1) / ROW_CHUNK;
  const int64_t panels = (p.N + PANEL - 1) / PANEL;
  const int64_t tasks = p.batch * panels * row_chunks;
#pragma omp parallel
  {
    std::vector<float> a_buf(ROW_CHUNK * p.K), b_buf(PANEL * p.K);  // fp32 packed operands
    float out[RB][PANEL];
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t batch = t / (panels * row_chunks);
      const int64_t panel = (t / row_chunks) % panels, chunk = t % row_chunks;
      const int64_t row0 = chunk * ROW_CHUNK, rows = std::min(ROW_CHUNK, p.M - row0);
      const int64_t col0 = panel * PANEL, cols = std::min(PANEL, p.N - col0);
      pack_a(A + batch * p.a_batch_stride + row0 * p.a_row_stride, p.a_row_stride, rows, p.K,
             a_buf.data());
      pack_b(B + batch * p.b_batch_stride + col0 * p.b_n_stride, p.b_k_stride, p.b_n_stride, cols,
             p.K, b_buf.data());
      for (int64_t r = 0; r < rows; r += RB) {
        const int n = static_cast<int>(std::min<int64_t>(RB, rows - r));
        block_rows(n, &a_buf[r * p.K], b_buf.data(), p.K, out);
        for (int i = 0; i < n; ++i) {
          T* c_row = C + (batch * p.M + row0 + r + i) * p.N + col0;
          for (int64_t c = 0; c < cols; ++c) {
            const float v = bias ? out[i][c] + to_float(bias[col0 + c]) : out[i][c];  // fp32 epilogue
            c_row[c] = from_float<T>(v);
          }
        }
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
