// Batch-invariant matmul: C[M, N] = A[M, K] . B[K, N] (+ bias), per batch entry.
//
// Every output element is accumulated in one fp32 accumulator in an order that depends only
// on K and the dtype -- not on M, on the tile the element falls in, or on the thread that
// computes it -- so a row's bits never depend on the batch. Tiles and threads decide WHO
// computes an element, never HOW. Vector lanes run along N (16 output columns per vector), so
// no lane reduction is needed. The two orders:
//   * fp32 / fp16 (and bf16 on CPUs without AVX512-BF16): ascending k, one fp32 fma per k,
//     c = fma(a[m,k], b[k,n], c) for k = 0, 1, ..., K-1;
//   * bf16 on CPUs with AVX512-BF16: one vdpbf16ps per pair of k (k = 2j, 2j+1, ascending j;
//     an odd K gets a zero partner). The instruction adds the exact product of the odd k, then
//     of the even k, each rounded to fp32 (denormals flushed) -- a fixed order of its own.
#include <algorithm>
#include <vector>

#include "common.h"
#include "kernels.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace bik {
namespace {

constexpr int64_t ROW_CHUNK = 96;  // rows of A per task (a multiple of RB)
constexpr int64_t PANEL = 64;      // output columns per task = VECS vectors of LANES
constexpr int VECS = PANEL / LANES;
constexpr int RB = 6;  // rows per register block
// B vectors per pass over k: RB x GROUP accumulators, GROUP B vectors and a broadcast A value
// must fit in the register file, or the inner loop spills to memory (AVX-512: 6 x 4 + 4 + 1
// of 32 zmm; AVX2, two ymm per Vec: 6 x 1 x 2 + 2 + 1 of 16 ymm).
constexpr int GROUP = VEC_REGISTERS == 1 ? VECS : 1;
static_assert(VECS % GROUP == 0, "a panel is whole groups of vectors");
// Calls of at most STREAM_ROWS rows (decode) pack B in K_SLICE-deep slices that stay in L1,
// carrying the fp32 accumulators from slice to slice through memory (exact), instead of
// packing a whole [K][PANEL] panel first: the same fma per k in the same order, so the same
// bits, without a panel's round trip through L2 that only one row block would read.
constexpr int64_t STREAM_ROWS = 16;
constexpr int64_t K_SLICE = 64;
static_assert(K_SLICE % 2 == 0, "a slice holds whole bf16 pairs");

// The work of a call for worth_a_team, in fmas: a decode-shaped call (few rows) streams its
// weight from memory, each element costing about as much as WEIGHT_READ_FMAS of its fmas, so
// a large weight gets both threads' bandwidth even at M = 1.
constexpr int64_t WEIGHT_READ_FMAS = 8;
inline int64_t matmul_work(const MatmulArgs& p) {
  return p.batch * std::max(p.M, WEIGHT_READ_FMAS) * p.N * p.K;
}

// Calls kernel.template rows<R>(...) with R = rows (1..RB): every R runs the same
// per-element arithmetic, R only sets how many rows share one pass over the packed B.
template <typename Kernel, typename... Args>
void for_rows(int rows, Args&&... args) {
  switch (rows) {
    case 6: return Kernel::template rows<6>(args...);
    case 5: return Kernel::template rows<5>(args...);
    case 4: return Kernel::template rows<4>(args...);
    case 3: return Kernel::template rows<3>(args...);
    case 2: return Kernel::template rows<2>(args...);
    default: return Kernel::template rows<1>(args...);
  }
}

// dst[k * PANEL + c] = src[c * stride + k] for a 16 x 16 tile, widened to fp32 (exact).
template <typename T>
void transpose_tile(const T* src, int64_t stride, float* dst) {
  for (int64_t c = 0; c < 16; ++c)
    for (int64_t k = 0; k < 16; ++k) dst[k * PANEL + c] = to_float(src[c * stride + k]);
}

#if defined(__AVX512F__)
// The fp32 tile in registers: pairs of rows interleaved (32-bit, then 64-bit steps), then
// 128-bit lanes gathered across rows in two shuffle rounds.
template <>
void transpose_tile<float>(const float* src, int64_t stride, float* dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] =
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * PANEL, r[i]);
}
#elif defined(__AVX2__)
// The fp32 tile as four 8 x 8 blocks, each transposed in registers (32-bit, then 64-bit
// interleaves, then 128-bit lanes): only moves, so the bits of the generic loop.
template <>
void transpose_tile<float>(const float* src, int64_t stride, float* dst) {
  for (int64_t bc = 0; bc < 16; bc += 8)
    for (int64_t bk = 0; bk < 16; bk += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + (bc + i) * stride + bk);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {
        t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
      }
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (bk + i) * PANEL + bc, t[i]);
    }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
// bf16 / fp16 tiles: each 16-deep k row widened to fp32 in vector registers (exact), then the
// fp32 transpose above: the values and places of the generic loop, without its 256 scalar
// conversions per tile.
template <typename T>
void widen_then_transpose(const T* src, int64_t stride, float* dst) {
  float wide[16 * 16];
  for (int64_t c = 0; c < 16; ++c) vstore(wide + c * 16, vload_n(src + c * stride, 16));
  transpose_tile<float>(wide, 16, dst);
}
template <>
void transpose_tile<bf16>(const bf16* src, int64_t stride, float* dst) {
  widen_then_transpose(src, stride, dst);
}
template <>
void transpose_tile<f16>(const f16* src, int64_t stride, float* dst) {
  widen_then_transpose(src, stride, dst);
}
#endif

// The fma kernel: A and B widened to fp32 (packing only moves and widens values, exactly).
template <typename T>
struct FmaKernel {
  using Packed = float;
  static constexpr bool reads_a_in_place = false;
  static int64_t depth(int64_t K) { return K; }  // packed B rows per panel

  // B columns [col0, col0 + cols) -> [K][PANEL], zero past `cols`.
  static void pack_b(const T* b, int64_t k_stride, int64_t n_stride, int64_t cols, int64_t K,
                     float* dst) {
    int64_t done = 0;                      // k rows packed by the fast path
    if (k_stride == 1 && cols == PANEL) {  // W^T: read 16-deep k tiles along W's rows
      constexpr int64_t TILE = 16;
      done = K / TILE * TILE;
      for (int64_t c0 = 0; c0 < PANEL; c0 += TILE)  // 16 W rows at a time, along k
        for (int64_t k0 = 0; k0 < done; k0 += TILE)
          transpose_tile(b + c0 * n_stride + k0, n_stride, dst + k0 * PANEL + c0);
    }
    for (int64_t k = done; k < K; ++k)
      for (int64_t c = 0; c < PANEL; ++c)
        dst[k * PANEL + c] = c < cols ? to_float(b[k * k_stride + c * n_stride]) : 0.0f;
  }

  // A rows -> blocks of RB rows, k-major ([K][RB] per block) so a block's RB values for one
  // k sit together; rows past `rows` are zero (computed, never stored).
  static void pack_a(const T* a, int64_t row_stride, int64_t rows, int64_t K, float* dst) {
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      float* block = dst + r0 * K;
      for (int64_t k = 0; k < K; ++k)
        for (int64_t r = 0; r < RB; ++r)
          block[k * RB + r] = r0 + r < rows ? to_float(a[(r0 + r) * row_stride + k]) : 0.0f;
    }
  }

  // R rows x PANEL columns starting at packed row block `r0`, over the `depth` k of the
  // packed B slice `b` that starts at k0: ascending k, one fma per k, into accumulators that
  // start at 0 (k0 == 0) or at the previous slice's sums in `out`. The columns run in groups
  // of GROUP vectors (one pass over k each): a column's chain is the same in every grouping.
  template <int R>
  static void rows(const float* a_packed, int64_t r0, int64_t K, int64_t k0, const float* b,
                   int64_t depth, float out[][PANEL]) {
    const float* a = a_packed + r0 * K + k0 * RB;
    for (int g = 0; g < VECS; g += GROUP) {
      Vec acc[R][GROUP];
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < GROUP; ++v)
          acc[r][v] = k0 == 0 ? vzero() : vload(out[r] + (g + v) * LANES);
      for (int64_t k = 0; k < depth; ++k) {
        Vec bv[GROUP];
        for (int v = 0; v < GROUP; ++v) bv[v] = vload(b + k * PANEL + (g + v) * LANES);
        for (int r = 0; r < R; ++r) {
          const Vec av = vbroadcast(a[k * RB + r]);
          for (int v = 0; v < GROUP; ++v) acc[r][v] = vfma(av, bv[v], acc[r][v]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < GROUP; ++v) vstore(out[r] + (g + v) * LANES, acc[r][v]);
    }
  }
};

#if defined(__AVX512BF16__)
// The bf16 pair kernel: B packed as k pairs (one dword = b[2j][c] | b[2j+1][c] << 16), A read
// in place as k pairs (a row's elements 2j, 2j+1 are one dword) and broadcast.
struct PairKernel {
  using Packed = uint32_t;
  static constexpr bool reads_a_in_place = true;
  static int64_t depth(int64_t K) { return (K + 1) / 2; }

  static uint32_t pair(uint16_t even, uint16_t odd) {
    return static_cast<uint32_t>(even) | static_cast<uint32_t>(odd) << 16;
  }

  static void pack_b(const bf16* b, int64_t k_stride, int64_t n_stride, int64_t cols, int64_t K,
                     uint32_t* dst) {
    const int64_t pairs = depth(K), full = K / 2;
    int64_t done = 0;  // pairs packed by the fast path
    if (k_stride == 1 && cols == PANEL && n_stride % 2 == 0) {
      // W^T with even rows: a pair is one dword of a W row, so a 16-pair x 16-column tile is
      // the fp32 tile transpose of dwords (register moves only: every bit pattern kept).
      constexpr int64_t TILE = 16;  // pairs per tile: one 64-byte line of a W row
      done = full / TILE * TILE;
      const float* words = reinterpret_cast<const float*>(b);
      for (int64_t c0 = 0; c0 < PANEL; c0 += TILE)  // 16 W rows at a time, along k
        for (int64_t j0 = 0; j0 < done; j0 += TILE)
          transpose_tile<float>(words + c0 * (n_stride / 2) + j0, n_stride / 2,
                                reinterpret_cast<float*>(dst + j0 * PANEL + c0));
    }
    for (int64_t c = 0; c < PANEL; ++c)
      for (int64_t j = done; j < pairs; ++j) {
        const bf16* column = b + c * n_stride;
        const uint16_t even = c < cols ? column[2 * j * k_stride].bits : 0;
        const uint16_t odd = c < cols && j < full ? column[(2 * j + 1) * k_stride].bits : 0;
        dst[j * PANEL + c] = pair(even, odd);
      }
  }

  // R rows over the K k of the packed B slice `b` (a0: the rows' first k of the slice), into
  // accumulators that start at 0 (`resume` false) or at the previous slice's sums in `out`.
  // A slice boundary falls between pairs (K_SLICE is even), so the pairs are the same.
  template <int R>
  static void rows(const bf16* a0, int64_t row_stride, const uint32_t* b, int64_t K, bool resume,
                   float out[][PANEL]) {
    __m512 acc[R][VECS];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < VECS; ++v)
        acc[r][v] = resume ? _mm512_loadu_ps(out[r] + v * LANES) : _mm512_setzero_ps();
    auto step = [&](int64_t j, auto a_pair) {
      __m512bh bv[VECS];
      for (int v = 0; v < VECS; ++v)
        bv[v] = (__m512bh)_mm512_loadu_si512(b + j * PANEL + v * LANES);
      for (int r = 0; r < R; ++r) {
        const __m512bh av =
            (__m512bh)_mm512_set1_epi32(static_cast<int>(a_pair(a0 + r * row_stride)));
        for (int v = 0; v < VECS; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], av, bv[v]);
      }
    };
    const int64_t full = K / 2;
    for (int64_t j = 0; j < full; ++j)
      step(j, [j](const bf16* a) {
        uint32_t both;
        std::memcpy(&both, a + 2 * j, sizeof both);
        return both;
      });
    if (K % 2)  // the last k with a zero partner, through the same instruction
      step(full, [K](const bf16* a) { return pair(a[K - 1].bits, 0); });
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < VECS; ++v) _mm512_storeu_ps(out[r] + v * LANES, acc[r][v]);
  }
};
template <typename T>
struct KernelFor {
  using type = FmaKernel<T>;
};
template <>
struct KernelFor<bf16> {
  using type = PairKernel;
};
#else
template <typename T>
struct KernelFor {
  using type = FmaKernel<T>;
};
#endif

// B's packed panels one after another: panel i holds columns [i * PANEL, (i + 1) * PANEL) as
// Kernel::pack_b lays out the whole depth of K (zeros past N).
template <typename T>
int64_t packed_elements(int64_t N, int64_t K) {
  using Kernel = typename KernelFor<T>::type;
  return (N + PANEL - 1) / PANEL * Kernel::depth(K) * PANEL;
}

template <typename T>
void pack_weight_impl(const MatmulArgs& p, uintptr_t dst) {
  using Kernel = typename KernelFor<T>::type;
  using Packed = typename Kernel::Packed;
  const T* B = reinterpret_cast<const T*>(p.b);
  Packed* out = reinterpret_cast<Packed*>(dst);
  const int64_t panels = (p.N + PANEL - 1) / PANEL, depth = Kernel::depth(p.K);
#pragma omp parallel for schedule(static) if (worth_a_team(panels, p.N * p.K, PARALLEL_FMAS))
  for (int64_t panel = 0; panel < panels; ++panel)
    Kernel::pack_b(B + panel * PANEL * p.b_n_stride, p.b_k_stride, p.b_n_stride,
                   std::min(PANEL, p.N - panel * PANEL), p.K, out + panel * depth * PANEL);
}

// `prepacked` (may be null): B already packed by pack_weight_impl, shared by the batch. Each
// panel is then read in place over the whole of K: the same packed values, and the same fma
// (or pair instruction) per k in the same order as the per-call packing, so the same bits.
template <typename T>
void matmul_impl(const MatmulArgs& p, uintptr_t prepacked = 0) {
  using Kernel = typename KernelFor<T>::type;
  using Packed = typename Kernel::Packed;
  const Packed* packed_b = reinterpret_cast<const Packed*>(prepacked);
  const T* A = reinterpret_cast<const T*>(p.a);
  const T* B = reinterpret_cast<const T*>(p.b);
  const T* bias = reinterpret_cast<const T*>(p.bias);
  T* C = reinterpret_cast<T*>(p.c);
  const int64_t row_chunks = (p.M + ROW_CHUNK - 1) / ROW_CHUNK;
  const int64_t panels = (p.N + PANEL - 1) / PANEL;
  const int64_t tasks = p.batch * panels * row_chunks;
  // Decode-shaped calls stream B in slices, their accumulators resumed from slice to slice.
  // (K = 0: one empty slice.)
  const int64_t slice = p.M <= STREAM_ROWS && !packed_b ? K_SLICE : std::max<int64_t>(p.K, 1);
  const bool team = worth_a_team(tasks, matmul_work(p), PARALLEL_FMAS);
#pragma omp parallel if (team)
  {
    std::vector<float> a_buf(Kernel::reads_a_in_place ? 0 : ROW_CHUNK * p.K);
    std::vector<Packed> b_buf(packed_b ? 0 : PANEL * Kernel::depth(std::min(slice, p.K)));
    int64_t packed_panel = -1;  // consecutive tasks of a thread share a B panel: pack it once
    int64_t packed_rows = -1;   // the (batch, row chunk) whose A rows a_buf holds: pack once
    float out[ROW_CHUNK][PANEL];
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t batch = t / (panels * row_chunks);
      const int64_t panel = (t / row_chunks) % panels, chunk = t % row_chunks;
      const int64_t row0 = chunk * ROW_CHUNK, rows = std::min(ROW_CHUNK, p.M - row0);
      const int64_t col0 = panel * PANEL, cols = std::min(PANEL, p.N - col0);
      const T* a = A + batch * p.a_batch_stride + row0 * p.a_row_stride;
      const T* b = B + batch * p.b_batch_stride + col0 * p.b_n_stride;
      if constexpr (!Kernel::reads_a_in_place) {
        if (batch * row_chunks + chunk != packed_rows) {  // e.g. a decode call: every task's rows
          Kernel::pack_a(a, p.a_row_stride, rows, p.K, a_buf.data());
          packed_rows = batch * row_chunks + chunk;
        }
      }
      for (int64_t k0 = 0; k0 < std::max<int64_t>(p.K, 1); k0 += slice) {
        const int64_t depth = std::min(slice, p.K - k0);
        const Packed* b_slice =
            packed_b ? packed_b + panel * Kernel::depth(p.K) * PANEL : b_buf.data();
        if (!packed_b && (slice < p.K || packed_panel != t / row_chunks)) {
          Kernel::pack_b(b + k0 * p.b_k_stride, p.b_k_stride, p.b_n_stride, cols, depth,
                         b_buf.data());
          packed_panel = t / row_chunks;
        }
        for (int64_t r = 0; r < rows; r += RB) {
          const int n = static_cast<int>(std::min<int64_t>(RB, rows - r));
          if constexpr (Kernel::reads_a_in_place)
            for_rows<Kernel>(n, a + r * p.a_row_stride + k0, p.a_row_stride, b_slice, depth, k0 > 0,
                             out + r);
          else
            for_rows<Kernel>(n, a_buf.data(), r, p.K, k0, b_slice, depth, out + r);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        T* c_row = C + (batch * p.M + row0 + i) * p.N + col0;
        for (int64_t c = 0; c < cols; ++c) {
          const float v = bias ? out[i][c] + to_float(bias[col0 + c]) : out[i][c];  // fp32 epilogue
          c_row[c] = from_float<T>(v);
        }
      }
    }
  }
}

// The TP-invariant order (bik.distributed.rank_partial) in one call: K cut into `chunks`
// equal chunks, each reduced from zero in the fma kernel's order on the exact fp32 values of
// A and B (its chain of one fma per k, whatever the dtype: no pair instruction), the chunk
// partials summed by the balanced pairwise tree -- ((p0 + p1) + (p2 + p3)) + ... -- and
// written in fp32 (no bias, no rounding: the caller adds across ranks). A stack of partials
// builds the tree as the chunks finish: a finished partial merges with the top of the stack
// while both cover as many chunks (the left operand is the earlier chunks', as in the tree).
// `chunks` is a power of two dividing K (checked by the caller); batch must be 1.
template <typename T>
void chunked_matmul_impl(const MatmulArgs& p, int64_t chunks) {
  using Kernel = FmaKernel<T>;
  const T* A = reinterpret_cast<const T*>(p.a);
  const T* B = reinterpret_cast<const T*>(p.b);
  float* C = reinterpret_cast<float*>(p.c);
  const int64_t chunk_k = p.K / chunks;
  const int64_t row_chunks = (p.M + ROW_CHUNK - 1) / ROW_CHUNK;
  const int64_t panels = (p.N + PANEL - 1) / PANEL;
  const int64_t tasks = panels * row_chunks;
  int levels = 1;  // stack depth: log2(chunks) + 1
  while ((int64_t{1} << (levels - 1)) < chunks) ++levels;
  const bool team = worth_a_team(tasks, matmul_work(p), PARALLEL_FMAS);
#pragma omp parallel if (team)
  {
    std::vector<float> a_buf(ROW_CHUNK * p.K);
    std::vector<float> b_buf(PANEL * chunk_k);
    std::vector<float> stack(static_cast<size_t>(levels) * ROW_CHUNK * PANEL);
    std::vector<int64_t> covers(levels);  // chunks summed into each stack entry
    float out[ROW_CHUNK][PANEL];
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t panel = t / row_chunks, chunk = t % row_chunks;
      const int64_t row0 = chunk * ROW_CHUNK, rows = std::min(ROW_CHUNK, p.M - row0);
      const int64_t col0 = panel * PANEL, cols = std::min(PANEL, p.N - col0);
      const T* a = A + row0 * p.a_row_stride;
      const T* b = B + col0 * p.b_n_stride;
      Kernel::pack_a(a, p.a_row_stride, rows, p.K, a_buf.data());
      int top = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t k0 = c * chunk_k;
        Kernel::pack_b(b + k0 * p.b_k_stride, p.b_k_stride, p.b_n_stride, cols, chunk_k,
                       b_buf.data());
        // A's packed blocks start at this chunk's k; k0 = 0 for rows(): start from zero
        for (int64_t r = 0; r < rows; r += RB) {
          const int n = static_cast<int>(std::min<int64_t>(RB, rows - r));
          for_rows<Kernel>(n, a_buf.data() + k0 * RB, r, p.K, 0, b_buf.data(), chunk_k, out + r);
        }
        float* entry = stack.data() + static_cast<size_t>(top) * ROW_CHUNK * PANEL;
        std::copy(&out[0][0], &out[0][0] + rows * PANEL, entry);
        covers[top++] = 1;
        while (top > 1 && covers[top - 2] == covers[top - 1]) {  // merge: left + right
          float* left = stack.data() + static_cast<size_t>(top - 2) * ROW_CHUNK * PANEL;
          const float* right = left + ROW_CHUNK * PANEL;
          for (int64_t i = 0; i < rows * PANEL; ++i) left[i] = left[i] + right[i];
          covers[top - 2] *= 2;
          --top;
        }
      }
      for (int64_t i = 0; i < rows; ++i)
        std::copy(stack.data() + i * PANEL, stack.data() + i * PANEL + cols,
                  C + (row0 + i) * p.N + col0);
    }
  }
}

}  // namespace

void matmul(int dtype, const MatmulArgs& args) {
  dispatch_dtype<CpuTypes>(dtype, [&](auto type) { matmul_impl<decltype(type)>(args); });
}

int64_t packed_weight_bytes(int dtype, int64_t N, int64_t K) {
  int64_t bytes = 0;
  dispatch_dtype<CpuTypes>(dtype, [&](auto type) {
    using T = decltype(type);
    bytes = packed_elements<T>(N, K) * sizeof(typename KernelFor<T>::type::Packed);
  });
  return bytes;
}

void pack_weight(int dtype, const MatmulArgs& args, uintptr_t dst) {
  dispatch_dtype<CpuTypes>(dtype, [&](auto type) { pack_weight_impl<decltype(type)>(args, dst); });
}

void matmul_prepacked(int dtype, const MatmulArgs& args, uintptr_t packed) {
  dispatch_dtype<CpuTypes>(dtype, [&](auto type) { matmul_impl<decltype(type)>(args, packed); });
}

void chunked_matmul(int dtype, const MatmulArgs& args, int64_t chunks) {
  dispatch_dtype<CpuTypes>(dtype,
                           [&](auto type) { chunked_matmul_impl<decltype(type)>(args, chunks); });
}

}  // namespace bik
