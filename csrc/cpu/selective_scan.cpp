// The Mamba2 selective scan (bik.layers.mamba2), one (row, head) per OpenMP iteration, in the
// order of its torch composition, so the two give the same bits: for each token,
//   S <- S * decay_t + dtx_t (x) B_t;   read_t = tree_N(S * C_t)
// with S [P, N] fp32, every product and sum its own rounding (-ffp-contract=off: no FMA), and
// tree_N the delta rule's tree_sum over N: the N products zero-padded to a power of two W, then
// the first half plus the second half, halving until one is left. The decay exp(dt A), the
// write scale dt x and the skip D x come from torch.
#include <vector>

#include "common.h"
#include "kernels.h"

namespace bik {
namespace {

// One state row s [N] of one token: decayed and written in place, then its read at c.
// products [W] is scratch whose entries N..W-1 are zero and stay so.
float scan_row(float* __restrict s, float decay, float dtx, const float* __restrict b,
               const float* __restrict c, float* __restrict products, int64_t N, int64_t W) {
  for (int64_t n = 0; n < N; ++n) {
    s[n] = s[n] * decay + dtx * b[n];
    products[n] = s[n] * c[n];
  }
  for (int64_t width = W; width > 1; width /= 2) {
    const int64_t half = width / 2;
    for (int64_t i = 0; i < half; ++i) products[i] = products[i] + products[i + half];
  }
  return products[0];
}

}  // namespace

void selective_scan(const SelectiveScanArgs& a) {
  const int64_t P = a.P, N = a.N, T = a.T, rows = a.B * a.H;
  const int64_t W = power_of_two_at_least(N);
  const auto* decay = reinterpret_cast<const float*>(a.decay);
  const auto* dtx = reinterpret_cast<const float*>(a.dtx);
  const auto* b = reinterpret_cast<const float*>(a.b);
  const auto* c = reinterpret_cast<const float*>(a.c);
  auto* state = reinterpret_cast<float*>(a.state);
  auto* out = reinterpret_cast<float*>(a.out);
#pragma omp parallel for schedule(static) if (worth_a_team(rows, rows * T * P * N, PARALLEL_FMAS))
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t batch = r / a.H, group = (r % a.H) / a.heads_per_group;
    const int64_t group_row = batch * (a.H / a.heads_per_group) + group;  // of b, c [B, G]
    std::vector<float> products(W, 0.0f);
    for (int64_t p = 0; p < P; ++p) {  // a state row through every token: rows are independent
      float* s = state + (r * P + p) * N;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t token = r * T + t, shared = (group_row * T + t) * N;
        out[token * P + p] = scan_row(s, decay[token], dtx[token * P + p], b + shared, c + shared,
                                      products.data(), N, W);
      }
    }
  }
}

}  // namespace bik
