// Split-KV attention, one query row per OpenMP iteration, the same algorithm as the Triton
// backend (bik/ops/attention.py): keys in blocks of KEY_BLOCK counted from the row's first
// valid key, blocks grouped into splits of split_size keys, an online softmax over the blocks
// of a split in ascending order, split partials merged in ascending order. Each query reads
// only its own visible keys, so prefill, chunks and decode give the same bits.
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
  const float old_scale = exp_nonpositive(run.max - safe), part_scale = exp_nonpositive(part.max - safe);
  run.sum = run.sum * old_scale + part.sum * part_scale;
  for (size_t d = 0; d < run.acc.size(); ++d)
    run.acc[d] = run.acc[d] * old_scale + part.acc[d] * part_scale;
  run.max = new_max;
}

// Online softmax over keys [lo, hi) of one split, in ascending blocks; keys before `visible`
// (the window's first key) are masked, blocks wholly before it skipped.
template <typename T>
void split_partial(const float* q, const T* k, const T* v, int64_t k_stride, int64_t v_stride,
                   int64_t D, float scale, float softcap, int64_t lo, int64_t hi,
                   int64_t visible, Partial& part) {
  float scores[KEY_BLOCK], probs[KEY_BLOCK];
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
        s = dot_lanes(q, k + (n0 + j) * k_stride, D) * scale;
        if (softcap > 0.0f) s = std::tanh(s / softcap) * softcap;
      }
      scores[j] = s;
      block_max = s > block_max ? s : block_max;
    }
    const float new_max = block_max > part.max ? block_max : part.max;
    const float safe = new_max == NEG_INF ? 0.0f : new_max;
    const float rescale = exp_nonpositive(part.max - safe);
    for (int64_t j = 0; j < KEY_BLOCK; ++j) probs[j] = j < count ? exp_nonpositive(scores[j] - safe) : 0.0f;
    part.sum = part.sum * rescale + (lane_sum(probs) + lane_sum(probs + LANES));
    // acc[d] = acc[d] * rescale, then one fma per key in ascending order; LANES dims at a
    // time so the accumulator stays in a register across the block's keys.
    for (int64_t d = 0; d < D; d += LANES) {
      Vec acc = vmul(vload(&part.acc[d]), vbroadcast(rescale));
      for (int64_t j = 0; j < count; ++j)
        acc = vfma(vbroadcast(probs[j]), vload_n(v + (n0 + j) * v_stride + d, D - d), acc);
      vstore(&part.acc[d], acc);
    }
    part.max = new_max;
  }
}

template <typename T>
void attention_impl(const AttentionArgs& p) {
  static_assert(2 * LANES == KEY_BLOCK, "block sums use two lane trees");
  const T* Q = reinterpret_cast<const T*>(p.q);
  const T* K = reinterpret_cast<const T*>(p.k);
  const T* V = reinterpret_cast<const T*>(p.v);
  const int32_t* starts = reinterpret_cast<const int32_t*>(p.kv_start);
  const float* sinks = reinterpret_cast<const float*>(p.sinks);  // null: no sinks
  T* out = reinterpret_cast<T*>(p.out);
  const int64_t groups = p.Hq / p.Hkv, rows = p.B * p.Hq * p.Tq;
  const int64_t padded = (p.D + LANES - 1) / LANES * LANES;
#pragma omp parallel if (rows > 1)
  {
    std::vector<float> q(padded, 0.0f);
    Partial run, part, sink;
    run.acc.resize(padded);  // dims past D stay 0
    part.acc.resize(padded);
    sink.acc.assign(padded, 0.0f);  // a sink attends no value
    sink.sum = 1.0f;
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t b = row / (p.Hq * p.Tq), h = (row / p.Tq) % p.Hq, i = row % p.Tq;
      const int64_t first = starts[b], last = p.causal ? p.Tk - p.Tq + i : p.Tk - 1;
      // The window's first key (the op allows a window only when causal).
      const int64_t visible = p.window > 0 ? std::max(first, last - p.window + 1) : first;
      const T* qr = Q + b * p.q_strides[0] + h * p.q_strides[1] + i * p.q_strides[2];
      const T* kh = K + b * p.k_strides[0] + (h / groups) * p.k_strides[1];
      const T* vh = V + b * p.v_strides[0] + (h / groups) * p.v_strides[1];
      for (int64_t d = 0; d < p.D; ++d) q[d] = to_float(qr[d]);
      run.max = NEG_INF;
      run.sum = 0.0f;
      std::fill(run.acc.begin(), run.acc.end(), 0.0f);
      // Ascending splits, from the one holding the window's first key.
      const int64_t skipped = (visible - first) / p.split_size * p.split_size;
      for (int64_t lo = first + skipped; lo <= last; lo += p.split_size) {
        const int64_t hi = std::min(lo + p.split_size, last + 1);
        split_partial(q.data(), kh, vh, p.k_strides[2], p.v_strides[2], p.D, p.scale, p.softcap,
                      lo, hi, visible, part);
        merge(run, part);
      }
      if (sinks != nullptr) {
        sink.max = sinks[h];
        merge(run, sink);
      }
      T* o = out + row * p.D;  // a query before its row's first key sees nothing: zeros
      for (int64_t d = 0; d < p.D; ++d)
        o[d] = from_float<T>(run.sum == 0.0f ? 0.0f : run.acc[d] / run.sum);
    }
  }
}

}  // namespace

void attention(int dtype, const AttentionArgs& args) {
  dispatch_dtype<CpuTypes>(dtype, [&](auto type) { attention_impl<decltype(type)>(args); });
}

}  // namespace bik
