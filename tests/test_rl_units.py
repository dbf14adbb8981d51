"""rl_harness units: mismatch metrics (hand-computed), remedies, advantages, LR schedule, config."""

import math

import pytest
import torch

from rl_harness import config, remedies, trainer
from rl_harness.metrics import mismatch_metrics


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


def _remedy(name, **extra):
    cfg = dict(config.DEFAULTS["remedy"], name=name)
    cfg.update(extra)
    return cfg


def test_remedy_weights():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-math.log(3.0), 0.0, 0.0], [math.log(4.0), -1e-4, 0.0]])
    mask = torch.ones(2, 3)
    w, _, stats = remedies.weights(_remedy("token_tis"), old, rollout, mask)
    assert w[0, 0] == pytest.approx(2.0) and w[1, 0] == pytest.approx(0.25)
    assert stats["remedy/clipped_frac"] == pytest.approx(1 / 6)
    w, keep, _ = remedies.weights(_remedy("token_mis"), old, rollout, mask)
    assert keep[0, 0] == 0 and keep[1, 0] == 0 and w[0, 1] == 1
    w, _, _ = remedies.weights(_remedy("seq_tis"), old, rollout, mask)
    assert torch.allclose(w[0], torch.full((3,), 2.0)) and w[1, 0] < 0.26
    _, keep, stats = remedies.weights(_remedy("token_veto", veto=0.5), old, rollout, mask)
    assert keep[1].sum() == 0 and keep[0].sum() == 3 and stats["remedy/masked_frac"] == 0.5
    w, _, _ = remedies.weights(_remedy("geo_is"), old, rollout, mask)
    assert torch.allclose(w[0], torch.full((3,), 3.0 ** (1 / 3)), rtol=1e-5)
    _, keep, _ = remedies.weights(_remedy("geo_rs"), old, rollout, mask)
    assert keep.sum() == 0  # both sequences' geometric ratios leave [0.999, 1.001]
    w, _, _ = remedies.weights(_remedy("token_tis", self_normalize=True), old, rollout, mask)
    assert (w * mask).sum() / mask.sum() == pytest.approx(1.0)


def test_geometric_rejection_is_length_invariant():
    for length in (4, 400):
        old, rollout = torch.zeros(1, length), torch.full((1, length), -0.0005)
        _, keep, _ = remedies.weights(_remedy("geo_rs"), old, rollout, torch.ones(1, length))
        assert keep.all()


def test_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    assert torch.allclose(
        trainer.advantages(rewards, 3, "rloo"), torch.tensor([1.0, -0.5, -0.5, -1.0, 0.5, 0.5])
    )
    grpo = trainer.advantages(rewards, 3, "grpo")
    assert grpo[0] > 0 > grpo[1] and grpo[:3].sum().abs() < 1e-6


def test_length_surge_lr_schedule():
    cfg = dict(config.DEFAULTS["lr_schedule"], name="length_surge", surge_window=2)
    schedule = remedies.LengthSurgeLR(cfg, 1.0)
    lrs = [schedule.step(step, 3.0 if step < 10 else 9.0) for step in range(100)]
    assert schedule.surge_step == 10  # the first window whose mean is >= 1.5 x the first one's
    period = round(1.8 * 10)
    assert lrs[period - 1] == 1.0 and lrs[period] == 0.5 and lrs[2 * period] == 0.25
    assert min(lrs) == pytest.approx(0.1)  # floor: min_ratio x lr0
    assert remedies.LengthSurgeLR(dict(cfg, name="constant"), 1.0).step(40, 100.0) == 1.0


@pytest.mark.parametrize(
    "sets, match",
    [
        (["rollout.nope=1"], "unknown config key 'rollout.nope'"),
        (["rollout.kernels=fast"], "rollout.kernels: expected one of"),
        (["train.lr=abc"], "train.lr: expected a number"),
        (["rollout.split_size=32", "rollout.kernels=native"], "split_size only applies"),
        (["rollout.split_size=40"], "multiple of 32"),
        (["model.path=/no/such/model"], "model.path: no model directory"),
        (["remedy.name=fp16", "rollout.dtype=bfloat16"], "remedy.name=fp16 sets both dtypes"),
        (["rollout.samples_per_prompt=1"], "at least 2"),
        (["steps"], "--set: expected key=value"),
    ],
)
def test_bad_configs_raise_before_any_work(sets, match):
    with pytest.raises(config.ConfigError, match=match):
        config.build({}, sets)
