"""rl_harness mismatch metrics: signed / sum log-perplexity differences and the mismatch per
rollout-probability bucket (hand-computed values, empty batches and buckets)."""

import math

import pytest
import torch

from rl_harness.metrics import PROB_BUCKETS, mismatch_metrics

TRAIN = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -0.5, -9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])  # r: [0.5, 0, -1], [0, -0.5]

NEW_KEYS = [
    "log_ppl_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "log_ppl_abs_diff_sum",
    *(f"{kind}_{bucket}" for bucket, _, _ in PROB_BUCKETS for kind in ("abs_diff", "tokens")),
]


def test_log_ppl_differences_by_hand():
    m = mismatch_metrics(TRAIN, ROLLOUT, MASK)
    # d_i = mean_t l_rollout - mean_t l_train = -mean_t r: 1/6 and 1/4 (verl's sign)
    assert m["mismatch/log_ppl_diff"] == pytest.approx((1 / 6 + 1 / 4) / 2)
    assert m["mismatch/log_ppl_diff_max"] == pytest.approx(1 / 4)
    assert m["mismatch/log_ppl_diff_min"] == pytest.approx(1 / 6)
    assert m["mismatch/log_ppl_abs_diff"] == pytest.approx((1 / 6 + 1 / 4) / 2)
    # per-sequence sums of r: -0.5 and -0.5
    assert m["mismatch/log_ppl_abs_diff_sum"] == pytest.approx(0.5)


def test_signed_log_ppl_diff_cancels_where_the_abs_one_does_not():
    train = torch.tensor([[0.0, 0.0], [-1.0, -1.0]])
    rollout = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])
    m = mismatch_metrics(train, rollout, torch.ones(2, 2))
    assert m["mismatch/log_ppl_diff"] == 0.0 and m["mismatch/log_ppl_abs_diff"] == 1.0
    assert m["mismatch/log_ppl_diff_max"] == 1.0 and m["mismatch/log_ppl_diff_min"] == -1.0
    assert m["mismatch/log_ppl_abs_diff_sum"] == 2.0


def test_log_ppl_abs_diff_sum_grows_with_length():
    for length in (10, 100):
        rollout = -torch.ones(1, length, dtype=torch.float64)
        m = mismatch_metrics(rollout + 0.01, rollout, torch.ones(1, length))
        assert m["mismatch/log_ppl_abs_diff"] == pytest.approx(0.01)
        assert m["mismatch/log_ppl_abs_diff_sum"] == pytest.approx(0.01 * length)


def test_mismatch_by_rollout_probability_bucket():
    m = mismatch_metrics(TRAIN, ROLLOUT, MASK)
    # p_rollout: 0.22, 0.14, 0.14 | 0.37, 0.61 (and a masked e^-9)
    assert m["mismatch/tokens_p_lt_0.5"] == 4
    assert m["mismatch/abs_diff_p_lt_0.5"] == pytest.approx((0.5 + 0 + 1 + 0) / 4)
    assert m["mismatch/tokens_p_0.5_to_0.9"] == 1
    assert m["mismatch/abs_diff_p_0.5_to_0.9"] == pytest.approx(0.5)
    assert m["mismatch/tokens_p_ge_0.9"] == 0 and m["mismatch/abs_diff_p_ge_0.9"] == 0.0


def test_top_bucket_holds_certain_tokens():
    rollout = torch.tensor([[0.0, math.log(0.95), math.log(0.7)]], dtype=torch.float64)
    train = rollout + torch.tensor([[0.25, -0.75, 0.125]], dtype=torch.float64)
    m = mismatch_metrics(train, rollout, torch.ones(1, 3))
    assert m["mismatch/tokens_p_ge_0.9"] == 2
    assert m["mismatch/abs_diff_p_ge_0.9"] == pytest.approx(0.5)
    assert m["mismatch/tokens_p_0.5_to_0.9"] == 1
    assert m["mismatch/abs_diff_p_0.5_to_0.9"] == pytest.approx(0.125)
    assert m["mismatch/tokens_p_lt_0.5"] == 0


def test_no_tokens_gives_zeros():
    m = mismatch_metrics(torch.zeros(2, 3), -torch.ones(2, 3), torch.zeros(2, 3))
    for key in NEW_KEYS:
        assert m[f"mismatch/{key}"] == 0.0, key


def test_padding_with_minus_infinity_stays_finite():
    train = torch.tensor([[-1.0, -float("inf")]])
    rollout = torch.tensor([[-1.5, -float("inf")]])
    m = mismatch_metrics(train, rollout, torch.tensor([[1, 0]]))
    assert m["mismatch/log_ppl_diff"] == pytest.approx(-0.5)
    assert m["mismatch/log_ppl_abs_diff_sum"] == pytest.approx(0.5)
    assert all(math.isfinite(m[f"mismatch/{key}"]) for key in NEW_KEYS)


def test_zero_mismatch_gives_exact_zeros_in_the_new_keys():
    logp = -torch.rand(3, 7)
    m = mismatch_metrics(logp, logp.clone(), torch.ones(3, 7))
    for key in NEW_KEYS:
        if not key.startswith("tokens_"):
            assert m[f"mismatch/{key}"] == 0.0, key
    assert sum(m[f"mismatch/tokens_{b}"] for b, _, _ in PROB_BUCKETS) == 21
