"""rl_harness units: mismatch metrics (hand-computed), remedies, advantages, LR schedule, logits
processing, run-directory files and reports."""

import json
import math

import pytest
import torch
from rl_helpers import loss_batch

import bik
from rl_harness import config, remedies, report, rundir, trainer
from rl_harness.config import LRScheduleConfig, RemedyConfig
from rl_harness.errors import RunDirError
from rl_harness.logits import LogitsProcessor
from rl_harness.metrics import mismatch_metrics
from rl_harness.schedule import LRSchedule


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


def _remedy(name, **extra):
    return RemedyConfig(name=name, **extra)


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
    cfg = LRScheduleConfig(name="length_surge", surge_window=2)
    schedule = LRSchedule(cfg, 1.0)
    lrs = [schedule.step(step, 3.0 if step < 10 else 9.0) for step in range(100)]
    assert schedule.surge_step == 10  # the first window whose mean is >= 1.5 x the first one's
    period = round(1.8 * 10)
    assert lrs[period - 1] == 1.0 and lrs[period] == 0.5 and lrs[2 * period] == 0.25
    assert min(lrs) == pytest.approx(0.1)  # floor: min_ratio x lr0
    assert LRSchedule(LRScheduleConfig(), 1.0).step(40, 100.0) == 1.0
    fixed = LRSchedule(LRScheduleConfig(name="length_surge", decay_period=5), 1.0)
    assert [fixed.step(s, 3.0) for s in range(11)][4:] == [1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.25]


def test_rollout_and_trainer_share_one_logits_formula():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    tokens = torch.randint(0, 11, (3, 5))
    processor = LogitsProcessor(temperature=0.7, top_k=6, top_p=0.8)
    filtered = processor.filter(logits)
    kept = torch.isfinite(filtered)
    assert (kept.sum(-1) <= 6).all() and (kept.sum(-1) >= 1).all()
    full = processor.log_probs(filtered)
    picked = processor.token_logprobs(filtered, tokens)
    assert torch.equal(picked, full.gather(-1, tokens[..., None])[..., 0])
    assert torch.equal(full, bik.log_softmax(filtered / 0.7, dtype=torch.float32))
    assert torch.equal(LogitsProcessor(1.0).filter(logits), logits)  # all off: unchanged


def test_write_atomic_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "state.txt"
    rundir.write_atomic(path, "old\n")

    def half_then_crash(tmp):
        tmp.write_text("ha")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rundir.write_atomic(path, half_then_crash)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["state.txt"]


def _write_metrics(tmp_path, text):
    (tmp_path / "metrics.jsonl").write_text(text)
    return tmp_path


def test_read_metrics_drops_a_torn_last_line_with_a_warning(tmp_path):
    rows = [{"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}]
    text = rundir.metrics_text(rows)
    assert rundir.read_metrics(_write_metrics(tmp_path, text)) == rows
    with pytest.warns(UserWarning, match="dropped a torn last line"):
        got = rundir.read_metrics(_write_metrics(tmp_path, text + '{"step": 2, "x"'))
    assert got == rows
    with pytest.raises(RunDirError, match="line 2 is not a metrics record"):
        rundir.read_metrics(_write_metrics(tmp_path, text.replace('{"step": 1', '{"step: 1')))


def test_compare_labels_are_unique(tmp_path):
    dirs = [tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "c" / "other"]
    assert report.unique_labels(dirs) == ["a/run", "b/run", "other"]
    assert report.unique_labels([dirs[0], dirs[0]]) == ["run", "run#2"]


def test_summary_and_compare_read_collapse_flags_from_the_metrics():
    row = {
        "reward/mean": 0.5,
        "mismatch/k3_kl": 0.0,
        "mismatch/tokens_unequal_frac": 0.0,
        "mismatch/logprob_abs_diff_max": 0.0,
    }
    history = [dict(row, step=s, **{"collapse/k3_growth": int(s >= 1)}) for s in range(3)]
    history[2]["collapse/reward_drop"] = 1
    summary = report.summarize(history, config.build(), "x")
    assert summary["first_flags"] == {"k3_growth": 1, "reward_drop": 2}
    assert summary["collapse_step"] == 2
    table = report.compare_markdown({"x": history, "empty": []})
    assert "| x | 3 | 0.500 | 0.500 | 0.00e+00 | 0.000 | 2 |" in table
    assert "| empty | 0 |" in table
    assert json.dumps(summary["first_flags"], sort_keys=True) in report.summary_markdown(summary)


def test_loss_aggregations_match_hand_computed_values():
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    agg = trainer.aggregate
    assert float(agg(loss, mask, "token_mean", 2, 4)) == pytest.approx(10 / 4)
    assert float(agg(loss, mask, "seq_mean_token_mean", 2, 4)) == pytest.approx((2 + 4) / 2)
    assert float(agg(loss, mask, "seq_mean_token_sum_norm", 2, 4)) == pytest.approx(10 / 8)
    for how in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):  # shares add up
        whole = float(agg(loss, mask, how, 2, 4))
        parts = sum(float(agg(loss[i : i + 1], mask[i : i + 1], how, 2, 4)) for i in (0, 1))
        assert parts == pytest.approx(whole)


def test_policy_loss_of_a_mini_batch_against_pi_old():
    cfg = config.build({}, ["rollout.max_new_tokens=4"])
    old = torch.zeros(4, 3)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 1, 1]])
    batch = loss_batch(mask, old)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.0])
    prepared = trainer.prepare(batch, adv, cfg)
    _, stats = trainer.policy_loss(old, prepared, cfg)  # no update yet: ratio 1
    assert stats["ppo/ratio_max"] == stats["ppo/ratio_min"] == 1.0
    assert stats["ppo/clip_frac"] == 0.0 and stats["loss"] == pytest.approx(-(2 - 1 + 4) / 7)
    # rows 2, 3 after an update: token (2, 1) at ratio 2 (clipped at 1.28), (3, 2) at 0.5
    current = torch.zeros(2, 3)
    current[0, 1], current[1, 2] = math.log(2.0), math.log(0.5)
    select = slice(2, 4)
    part = prepared.take(select, current)
    loss, stats = trainer.policy_loss(current.clone(), part, cfg)
    assert stats["ppo/ratio_max"] == pytest.approx(2.0)
    assert stats["ppo/ratio_min"] == pytest.approx(0.5)
    assert stats["ppo/clip_frac"] == pytest.approx(2 / 4)
    per_token = -(1.28 * 2 + 1.0 * 2) - 0.0  # row 2's two tokens; row 3 has advantage 0
    assert float(loss) == pytest.approx(per_token / 4) and stats["loss"] == pytest.approx(
        per_token / 4
    )
    for how, expected in (
        ("seq_mean_token_mean", (per_token / 2 + 0.0) / 2),
        ("seq_mean_token_sum_norm", per_token / (2 * 4)),
    ):
        dr = cfg.replace(**{"train.loss_agg": how})
        loss, stats = trainer.policy_loss(current.clone(), part, dr)
        assert float(loss) == pytest.approx(expected) and stats["loss"] == pytest.approx(expected)
