// The gated delta rule (bik.layers.delta_rule), one (row, head) per OpenMP iteration, in the
// order of its torch composition, so the two give the same bits:
//   S <- S * decay_t;  read = tree_K(S * k_t);  S <- S + k_t (x) ((v_t - read) * beta_t);
//   o_t = tree_K(S * q_t)
// Every product and sum is its own fp32 rounding (-ffp-contract=off: no FMA), and tree_K is
// tree_sum's: the K products zero-padded to a power of two W, then the first half plus the
// second half, halving until one is left. The value dim V is the inner, contiguous loop: each
// value column is independent, so however the compiler vectorises it the bits do not move.
#include <vector>

#include "common.h"
#include "kernels.h"

namespace bik {
namespace {

// Value columns a pass works on at once: a K = 128 block of state and products (16 KiB) stays
// in L1. Columns are independent, so the width never changes a bit.
constexpr int64_t COLUMNS = 16;

// rows [W, COLUMNS] -> row 0 holds tree_K of each column (rows K..W-1 must be zero; they stay
// so: the tree only ever adds them to each other).
void tree_over_rows(float* __restrict rows, int64_t W) {
  for (int64_t width = W; width > 1; width /= 2) {
    const int64_t half = width / 2;
    for (int64_t i = 0; i < half; ++i) {
      float* __restrict left = rows + i * COLUMNS;
      const float* __restrict right = rows + (i + half) * COLUMNS;
      for (int64_t j = 0; j < COLUMNS; ++j) left[j] = left[j] + right[j];
    }
  }
}

struct Token {  // one token of one (row, head)
  const float *k, *q, *v, *decay;
  float beta;
};

// Columns c0 .. c0 + n - 1 (n <= COLUMNS) of one token: the state S [K, V] in place, the
// output row out [V]; products [W, COLUMNS] (rows K..W-1 zero) is scratch, its columns past n
// left over from a wider block: summed among themselves, never stored.
void step(float* __restrict S, const Token& x, bool decay_per_key, float* __restrict products,
          float* __restrict out, int64_t c0, int64_t n, int64_t K, int64_t W, int64_t V) {
  for (int64_t i = 0; i < K; ++i) {  // decay, then the product read at the key
    const float factor = x.decay[decay_per_key ? i : 0], key = x.k[i];
    float* __restrict s = S + i * V + c0;
    float* __restrict p = products + i * COLUMNS;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = s[j] * factor;
      p[j] = s[j] * key;
    }
  }
  tree_over_rows(products, W);
  float delta[COLUMNS];
  for (int64_t j = 0; j < n; ++j) delta[j] = (x.v[c0 + j] - products[j]) * x.beta;
  for (int64_t i = 0; i < K; ++i) {  // the write, then the product read at the query
    const float key = x.k[i], query = x.q[i];
    float* __restrict s = S + i * V + c0;
    float* __restrict p = products + i * COLUMNS;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = s[j] + key * delta[j];
      p[j] = s[j] * query;
    }
  }
  tree_over_rows(products, W);
  std::copy(products, products + n, out + c0);
}

}  // namespace

void delta_rule(const DeltaRuleArgs& a) {
  const int64_t K = a.K, V = a.V, T = a.T, rows = a.B * a.H;
  const int64_t W = power_of_two_at_least(K);
  const auto* q = reinterpret_cast<const float*>(a.q);
  const auto* k = reinterpret_cast<const float*>(a.k);
  const auto* v = reinterpret_cast<const float*>(a.v);
  const auto* decay = reinterpret_cast<const float*>(a.decay);
  const auto* beta = reinterpret_cast<const float*>(a.beta);
  auto* state = reinterpret_cast<float*>(a.state);
  auto* out = reinterpret_cast<float*>(a.out);
  const int64_t decay_width = a.decay_per_key ? K : 1;
#pragma omp parallel for schedule(static) if (worth_a_team(rows, rows * T * K * V, PARALLEL_FMAS))
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> products(W * COLUMNS, 0.0f);
    for (int64_t c0 = 0; c0 < V; c0 += COLUMNS) {  // a block of columns through every token
      for (int64_t t = 0; t < T; ++t) {
        const int64_t token = r * T + t;
        const Token x{k + token * K, q + token * K, v + token * V, decay + token * decay_width,
                      beta[token]};
        step(state + r * K * V, x, a.decay_per_key, products.data(), out + token * V, c0,
             std::min(COLUMNS, V - c0), K, W, V);
      }
    }
  }
}

}  // namespace bik
