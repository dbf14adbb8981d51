"""rl_harness mismatch metrics: exact zeros without a mismatch, the metrics against hand-computed
values, signed / sum log-perplexity differences and the mismatch per rollout-probability
bucket (empty batches and buckets), verl's log-ratio clamp, bad shapes."""

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


def test_zero_mismatch_gives_exact_zeros():
    logp = -torch.rand(3, 7)
    m = mismatch_metrics(logp, logp.clone(), torch.ones(3, 7))
    for key in (
        "logprob_abs_diff_mean",
        "logprob_abs_diff_max",
        "tokens_unequal_frac",
        "k1_kl",
        "k3_kl",
        "log_ppl_abs_diff",
        "chi2_token",
        "chi2_seq",
        "is_frac_above_c",
    ):
        assert m[f"mismatch/{key}"] == 0.0, key
    assert m["mismatch/is_ess"] == 1.0 and m["mismatch/is_weight_mean"] == 1.0


def test_metrics_match_hand_computed_values():
    train = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    rollout = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    r = [0.5, 0.0, -1.0, 0.0, -0.5]  # valid tokens only
    m = mismatch_metrics(train, rollout, mask)
    assert m["mismatch/logprob_abs_diff_mean"] == pytest.approx(2.0 / 5)
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(1.0)
    assert m["mismatch/tokens_unequal_frac"] == pytest.approx(3 / 5)
    assert m["mismatch/tokens_unequal_count"] == 3
    assert m["mismatch/k1_kl"] == pytest.approx(-sum(r) / 5)
    assert m["mismatch/k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in r) / 5)
    assert m["mismatch/chi2_token"] == pytest.approx(sum(math.exp(2 * x) for x in r) / 5 - 1)
    assert m["mismatch/chi2_seq"] == pytest.approx(
        (math.exp(2 * -0.5) + math.exp(2 * -0.5)) / 2 - 1
    )
    # log-ppl: per-sequence mean log-prob difference, then mean of the absolute values
    assert m["mismatch/log_ppl_abs_diff"] == pytest.approx((abs(-0.5 / 3) + abs(-0.5 / 2)) / 2)
    assert m["mismatch/is_weight_min"] == pytest.approx(math.exp(-1.0))
    assert m["mismatch/is_weight_max"] == pytest.approx(math.exp(0.5))


@pytest.mark.parametrize("length, expected", [(10, 2.5937424601), (100, 13780.6123398)])
def test_length_trap_sequence_weight(length, expected):
    # per-token ratio 1.1: the sequence IS weight explodes with length (the "length trap")
    rollout = -torch.ones(1, length, dtype=torch.float64)
    train = rollout + math.log(1.1)
    m = mismatch_metrics(train, rollout, torch.ones(1, length))
    assert m["mismatch/seq_is_weight_mean"] == pytest.approx(expected, rel=1e-6)
    assert m["mismatch/is_weight_mean"] == pytest.approx(1.1)


def test_metrics_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="expected equal shapes"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_clamp_log_ratio_follows_verl_when_asked():
    train = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[-30.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    raw = mismatch_metrics(train, rollout, mask)
    assert raw["mismatch/is_weight_max"] == pytest.approx(math.exp(30.0))  # default: no clamp
    verl = mismatch_metrics(train, rollout, mask, clamp_log_ratio=20.0)
    assert verl["mismatch/is_weight_max"] == pytest.approx(math.exp(20.0))
    assert verl["mismatch/seq_is_weight_max"] == pytest.approx(math.exp(20.0))
    assert verl["mismatch/k3_kl"] == pytest.approx((math.exp(20.0) - 20.0 - 1.0) / 2)
    assert verl["mismatch/logprob_abs_diff_max"] == 30.0 and verl["mismatch/k1_kl"] == -15.0


def test_rows_without_response_tokens_are_skipped_by_sequence_metrics():
    train = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -1.5], [0.0, 0.0]])
    m = mismatch_metrics(train, rollout, torch.tensor([[1, 1], [0, 0]]))
    assert m["mismatch/seq_is_weight_mean"] == pytest.approx(math.exp(1.0))
    assert m["mismatch/log_ppl_abs_diff"] == pytest.approx(0.5)
