// Split-KV attention, one query row per OpenMP iteration, the same algorithm as the Triton
// backend (bik/ops/attention.py): keys in blocks of KEY_BLOCK counted from the row's first
// valid key, blocks grouped into splits of split_size keys, an online softmax over the blocks
// of a split in ascending order, split partials merged in ascending order. Each query reads
// only its own visible keys, so prefill, chunks and decode give the same bits. The paged entry
// runs the same rows over keys read through a block table (vLLM's cache), so paged ==
// contiguous bit for bit.
//
// A sliding window only masks keys: the blocks and splits stay counted from the row's first
// valid key. Splits and blocks wholly before the query's window are skipped (processing them
// would leave the empty state max -inf, sum 0, acc 0 unchanged: the same bits); in the block
// where the window starts, the keys before it score -inf, so exp gives them exactly 0.
// Soft-capping maps each score s to softcap * tanh(s / softcap) with the scalar libm tanhf
// (the build has no fast-math, so it is never swapped for a vector variant). An attention
// sink joins after the last split: one more partial (max = the head's sink logit, sum 1,
// acc 0) merged like the splits.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <limits>
#include <vector>

#include "common.h"
#include "kernels.h"

namespace bik {
namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Partial {  // unnormalised softmax state: sum_j exp(s_j - max) * v_j, sum_j exp(s_j - max)
  float max = NEG_INF, sum = 0.0f;
  std::vector<float> acc;
};

// Folds `part` into `run` (the same formula for blocks' rescaling and splits' merging).
inline void merge(Partial& run, const Partial& part) {
  const float new_max = part.max > run.max ? part.max : run.max;
  const float safe = new_max == NEG_INF ? 0.0f : new_max;
  const float old_scale = exp_nonpositive(run.max - safe),
              part_scale = exp_nonpositive(part.max - safe);
  run.sum = run.sum * old_scale + part.sum * part_scale;
  for (size_t d = 0; d < run.acc.size(); ++d)
    run.acc[d] = run.acc[d] * old_scale + part.acc[d] * part_scale;
  run.max = new_max;
}

// Where a head's keys and values are: key j of a sequence (counted from the tensor's first
// position for Strided, from the sequence's first key for Paged) and its value.
template <typename T>
struct Strided {  // one [Tk, D] slice with a position stride: contiguous, padded batch rows
  const T *k, *v;
  int64_t k_stride, v_stride;
  const T* key(int64_t j) const { return k + j * k_stride; }
  const T* value(int64_t j) const { return v + j * v_stride; }
};

template <typename T>
struct Paged {     // key j at slot j % block_size of page pages[j / block_size] (the block table)
  const T *k, *v;  // the kv head's base in each cache
  const int32_t* pages;
  int64_t block_size, k_block_stride, k_pos_stride, v_block_stride, v_pos_stride;
  const T* key(int64_t j) const {
    return k + pages[j / block_size] * k_block_stride + (j % block_size) * k_pos_stride;
  }
  const T* value(int64_t j) const {
    return v + pages[j / block_size] * v_block_stride + (j % block_size) * v_pos_stride;
  }
};

// Online softmax over keys [lo, hi) of one split, in ascending blocks; keys before `visible`
// (the window's first key) are masked, blocks wholly before it skipped. Only the addresses
// depend on `Rows`: the arithmetic, and so the bits, are the same for every key layout.
template <typename T, typename Rows>
void split_partial(const float* q, const Rows& rows, int64_t D, float scale, float softcap,
                   int64_t lo, int64_t hi, int64_t visible, Partial& part) {
  static_assert(2 * LANES == KEY_BLOCK, "block sums use two lane trees");
  float scores[KEY_BLOCK], probs[KEY_BLOCK];
  const T* values[KEY_BLOCK];
  part.max = NEG_INF;
  part.sum = 0.0f;
  std::fill(part.acc.begin(), part.acc.end(), 0.0f);
  const int64_t skipped = visible > lo ? (visible - lo) / KEY_BLOCK * KEY_BLOCK : 0;
  for (int64_t n0 = lo + skipped; n0 < hi; n0 += KEY_BLOCK) {
    const int64_t count = std::min(KEY_BLOCK, hi - n0);
    float block_max = NEG_INF;
    for (int64_t j = 0; j < count; ++j) {
      float s = NEG_INF;
      if (n0 + j >= visible) {
        s = dot_lanes(q, rows.key(n0 + j), D) * scale;
        if (softcap > 0.0f) s = std::tanh(s / softcap) * softcap;
      }
      scores[j] = s;
      block_max = s > block_max ? s : block_max;
      values[j] = rows.value(n0 + j);  // masked keys too: 0 * their value enters the fma
    }
    const float new_max = block_max > part.max ? block_max : part.max;
    const float safe = new_max == NEG_INF ? 0.0f : new_max;
    const float rescale = exp_nonpositive(part.max - safe);
    for (int64_t j = 0; j < KEY_BLOCK; ++j)
      probs[j] = j < count ? exp_nonpositive(scores[j] - safe) : 0.0f;
    part.sum = part.sum * rescale + (lane_sum(probs) + lane_sum(probs + LANES));
    // acc[d] = acc[d] * rescale, then one fma per key in ascending order; LANES dims at a
    // time so the accumulator stays in a register across the block's keys.
    for (int64_t d = 0; d < D; d += LANES) {
      Vec acc = vmul(vload(&part.acc[d]), vbroadcast(rescale));
      for (int64_t j = 0; j < count; ++j)
        acc = vfma(vbroadcast(probs[j]), vload_n(values[j] + d, D - d), acc);
      vstore(&part.acc[d], acc);
    }
    part.max = new_max;
  }
}

// One thread's working memory, reused across its rows.
struct Scratch {
  std::vector<float> q;
  Partial run, part, sink;
  explicit Scratch(int64_t D) {
    const int64_t padded = (D + LANES - 1) / LANES * LANES;
    q.assign(padded, 0.0f);  // dims past D stay 0
    run.acc.resize(padded);
    part.acc.resize(padded);
    sink.acc.assign(padded, 0.0f);  // a sink attends no value
    sink.sum = 1.0f;
  }
};

// What every query row shares: the head size, the split size and the score options.
struct RowOptions {
  int64_t D, split_size, window;
  float scale, softcap;
};

// One query row `qr` over its sequence's keys [first, last] into `o`: ascending splits of
// split_size keys counted from `first`, from the one holding the window's first key, merged
// in ascending order, then the sink (null: none). A row with first > last sees nothing: zeros.
template <typename T, typename Rows>
void attend_row(Scratch& s, const RowOptions& p, const T* qr, const Rows& rows, int64_t first,
                int64_t last, const float* sink, T* o) {
  // The window's first key (the op allows a window only when causal).
  const int64_t visible = p.window > 0 ? std::max(first, last - p.window + 1) : first;
  for (int64_t d = 0; d < p.D; ++d) s.q[d] = to_float(qr[d]);
  s.run.max = NEG_INF;
  s.run.sum = 0.0f;
  std::fill(s.run.acc.begin(), s.run.acc.end(), 0.0f);
  const int64_t skipped = (visible - first) / p.split_size * p.split_size;
  for (int64_t lo = first + skipped; lo <= last; lo += p.split_size) {
    const int64_t hi = std::min(lo + p.split_size, last + 1);
    split_partial<T>(s.q.data(), rows, p.D, p.scale, p.softcap, lo, hi, visible, s.part);
    merge(s.run, s.part);
  }
  if (sink != nullptr) {
    s.sink.max = *sink;
    merge(s.run, s.sink);
  }
  for (int64_t d = 0; d < p.D; ++d)
    o[d] = from_float<T>(s.run.sum == 0.0f ? 0.0f : s.run.acc[d] / s.run.sum);
}

template <typename T>
void attention_impl(const AttentionArgs& p) {
  const T* Q = reinterpret_cast<const T*>(p.q);
  const T* K = reinterpret_cast<const T*>(p.k);
  const T* V = reinterpret_cast<const T*>(p.v);
  const int32_t* starts = reinterpret_cast<const int32_t*>(p.kv_start);
  const float* sinks = reinterpret_cast<const float*>(p.sinks);  // null: no sinks
  T* out = reinterpret_cast<T*>(p.out);
  // Every row's first key inside the keys, whatever the caller vouched for: B comparisons,
  // and no read out of bounds from a kv_start written where no version counter saw it.
  for (int64_t b = 0; b < p.B; ++b)
    if (starts[b] < 0 || starts[b] >= std::max<int64_t>(p.Tk, 1))
      throw std::invalid_argument(
          "bik attention: kv_start[" + std::to_string(b) + "] = " + std::to_string(starts[b]) +
          ", expected 0 <= kv_start < " + std::to_string(std::max<int64_t>(p.Tk, 1)));
  const int64_t groups = p.Hq / p.Hkv, rows = p.B * p.Hq * p.Tq;
  const RowOptions options{p.D, p.split_size, p.window, p.scale, p.softcap};
#pragma omp parallel if (worth_a_team(rows, 2 * rows * p.Tk * p.D, \
                                          PARALLEL_FMAS))  // q.k and p.v per key
  {
    Scratch scratch(p.D);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t b = row / (p.Hq * p.Tq), h = (row / p.Tq) % p.Hq, i = row % p.Tq;
      const int64_t last = p.causal ? p.Tk - p.Tq + i : p.Tk - 1;
      const Strided<T> keys{K + b * p.k_strides[0] + (h / groups) * p.k_strides[1],
                            V + b * p.v_strides[0] + (h / groups) * p.v_strides[1], p.k_strides[2],
                            p.v_strides[2]};
      attend_row(scratch, options, Q + b * p.q_strides[0] + h * p.q_strides[1] + i * p.q_strides[2],
                 keys, starts[b], last, sinks == nullptr ? nullptr : sinks + h, out + row * p.D);
    }
  }
}

// Packed varlen queries over a paged cache: query token t of sequence s is its sequence's
// position seq_lens[s] - (query_start[s + 1] - t), and its keys are read through the block
// table counted from the sequence's first key, so each row runs attention_impl's order over
// the same keys as a contiguous [1, Hkv, seq_len, D] prefill would: the same bits.
template <typename T>
void paged_attention_impl(const PagedAttentionArgs& p) {
  const T* Q = reinterpret_cast<const T*>(p.q);
  const T* K = reinterpret_cast<const T*>(p.k_cache);
  const T* V = reinterpret_cast<const T*>(p.v_cache);
  const int32_t* table = reinterpret_cast<const int32_t*>(p.block_table);
  const int32_t* query_start = reinterpret_cast<const int32_t*>(p.query_start);
  const int32_t* seq_lens = reinterpret_cast<const int32_t*>(p.seq_lens);
  const float* sinks = reinterpret_cast<const float*>(p.sinks);  // null: no sinks
  T* out = reinterpret_cast<T*>(p.out);
  std::vector<int32_t> sequence(p.T);  // each query token's sequence
  for (int64_t s = 0; s < p.S; ++s)
    std::fill(sequence.begin() + query_start[s], sequence.begin() + query_start[s + 1], s);
  const int64_t groups = p.Hq / p.Hkv, rows = p.T * p.Hq;
  int64_t keys_read = 0;  // per query head: each query token reads its sequence's keys
  for (int64_t s = 0; s < p.S; ++s)
    keys_read += (query_start[s + 1] - query_start[s]) * seq_lens[s];
  const RowOptions options{p.D, p.split_size, p.window, p.scale, p.softcap};
#pragma omp parallel if (worth_a_team(rows, 2 * keys_read * p.Hq * p.D, PARALLEL_FMAS))
  {
    Scratch scratch(p.D);
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t t = row / p.Hq, h = row % p.Hq, s = sequence[t], g = h / groups;
      const Paged<T> keys{
          K + g * p.k_strides[1], V + g * p.v_strides[1], table + s * p.table_stride,
          p.block_size,           p.k_strides[0],         p.k_strides[2],
          p.v_strides[0],         p.v_strides[2]};
      attend_row(scratch, options, Q + t * p.q_strides[0] + h * p.q_strides[1], keys, 0,
                 seq_lens[s] - query_start[s + 1] + t, sinks == nullptr ? nullptr : sinks + h,
                 out + row * p.D);
    }
  }
}

}  // namespace

void attention(int dtype, const AttentionArgs& args) {
  dispatch_dtype<CpuTypes>(dtype, [&](auto type) { attention_impl<decltype(type)>(args); });
}

void paged_attention(int dtype, const PagedAttentionArgs& args) {
  dispatch_dtype<CpuTypes>(dtype, [&](auto type) { paged_attention_impl<decltype(type)>(args); });
}

}  // namespace bik
