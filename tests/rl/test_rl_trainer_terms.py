"""The trainer (rl_harness.trainer, its Learner): advantages, the loss
aggregations and a mini-batch's policy loss against pi_old (hand-computed), the one logits
formula rollout and trainer share, and the optional terms: group filtering, KL to a
reference, entropy bonus, the bf16-autocast trainer."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from rl_helpers import TINY as RL_TINY
from rl_helpers import loss_batch, resumed_equals_uninterrupted, run_metrics, updates_of_each_step

import bik
from rl_harness import config, losses, policy, runner
from rl_harness.batch import Batch, Tokens
from rl_harness.logits import LogitsProcessor

TINY = [*RL_TINY, "steps=2"]
# TINY's policy answers nothing right (zero advantages): an entropy bonus and a large learning
# rate make its updates move it all the same.
MOVING = ["train.entropy_coef=0.1", "train.lr=1e-2"]
DEFAULTS = [
    "train.filter_groups=false",
    "train.kl_coef=0",
    "train.kl_estimator=k3",
    "train.entropy_coef=0",
    "train.autocast=none",
]


def _run(tmp_path, cache, name, sets=()):
    return run_metrics(tmp_path, cache, name, [*TINY, *sets])


def _job(cache, sets=()):
    return runner.Run(config.build({}, TINY + list(sets)), cache)


def test_defaults_build_no_reference_and_log_no_new_metric(tmp_path, cache, monkeypatch):
    """The keys at their explicit defaults are the default run; it keeps the no-grad entropy,
    builds no reference and logs none of the new metrics."""
    forward = losses.token_logprobs_and_entropy
    grads = []

    def spy(model, batch, *args):
        logp, entropy = forward(model, batch, *args)
        grads.append(entropy.requires_grad)
        return logp, entropy

    monkeypatch.setattr(runner.trainer, "token_logprobs_and_entropy", spy)
    history = _run(tmp_path, cache, "defaults")
    assert _run(tmp_path, cache, "explicit", DEFAULTS) == history
    assert grads and not any(grads)
    assert not any(key.startswith("train/") for m in history for key in m)
    assert _job(cache).learner.reference is None


def _batch(rows: int, width: int = 3) -> Batch:
    gen = torch.Generator().manual_seed(rows)
    logp = -torch.rand(rows, width, generator=gen)
    mask = torch.ones(rows, width)
    mask[:, 0] = 0
    mask[1, 2] = 0  # a shorter row
    return loss_batch(mask, logp)


def test_kept_rows_are_exactly_the_groups_with_unequal_rewards():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.25])
    kept = losses.kept_rows(rewards, 3)
    assert kept.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("how", config.LOSS_AGGS)
def test_filtered_loss_is_the_loss_of_the_kept_rows_alone(how):
    """Every aggregation counts only the kept sequences and tokens: the loss with ``kept``
    equals the loss of the batch made of the kept rows."""
    cfg = config.build({}, ["rollout.max_new_tokens=4", f"train.loss_agg={how}"])
    batch = _batch(6)
    adv = torch.tensor([0.5, -1.0, 0.0, 0.0, 2.0, -0.5])
    kept = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    current = batch.train_logp + 0.1  # after an update: ratios away from 1
    filtered = dataclasses.replace(batch, kept=kept)
    part = losses.prepare(filtered, adv, cfg).take(None, current)
    loss, stats = losses.policy_loss(current, part, cfg)
    rows = kept.bool()
    alone = Batch(**{k: v[rows] for k, v in batch.tensors().items()})
    alone_part = losses.prepare(alone, adv[rows], cfg).take(None, current[rows])
    expected, alone_stats = losses.policy_loss(current[rows], alone_part, cfg)
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    for key in ("loss", "ppo/clip_frac", "ppo/ratio_max", "ppo/ratio_min"):
        assert stats[key] == pytest.approx(alone_stats[key], rel=1e-6), key


def test_a_kl_term_without_the_references_logprobs_is_refused():
    cfg = config.build({}, ["train.kl_coef=0.1"])
    batch = _batch(2)
    with pytest.raises(ValueError, match=r"batch\.ref_logp"):
        losses.prepare(batch, torch.zeros(2), cfg)


def test_a_step_whose_groups_are_all_filtered_does_not_update(cache):
    """warmup.steps=0: a random policy answers nothing right, every group's rewards are
    equal, so every group is dropped: no update, finite metrics."""
    job = _job(cache, ["warmup.steps=0", "train.filter_groups=true", "train.kl_coef=0.1"])
    before = [p.detach().clone() for p in job.master.parameters()]
    state = job.learner.optimizer.state_dict()
    record = job.step(0)
    metrics = record.metrics
    assert metrics["reward/mean"] == 0.0 and metrics["train/groups_kept_frac"] == 0.0
    assert metrics["update_applied"] == 0 and metrics["grad_norm"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)), metrics
    assert metrics["loss"] == 0.0 and metrics["ppo/ratio_max"] == 1.0
    assert all(torch.equal(b, p) for b, p in zip(before, job.master.parameters()))
    assert job.learner.optimizer.state_dict() == state  # no AdamW step either
    assert record.batch.kept.sum() == 0


def test_an_emptied_mini_batch_is_skipped_the_other_updates(cache, monkeypatch):
    """train.mini_batches=2 with only the second mini-batch's groups kept: one update of two."""
    kept = torch.tensor([0.0] * 4 + [1.0] * 4)  # TINY: 4 prompts x 2 samples
    monkeypatch.setattr(runner.trainer, "kept_rows", lambda rewards, size: kept)
    sets = ["train.filter_groups=true", "train.mini_batches=2", "train.entropy_coef=0.1"]
    job, updates = _job(cache, sets), updates_of_each_step(monkeypatch)
    metrics = job.step(0).metrics
    assert [u["update_applied"] for u in updates[0]] == [0, 1]
    assert metrics["update_applied"] == 1 and metrics["train/groups_kept_frac"] == 0.5
    assert updates[0][0]["grad_norm"] == 0.0 and updates[0][1]["grad_norm"] > 0


@pytest.mark.parametrize("estimator", config.KL_ESTIMATORS)
def test_kl_estimators_against_float64(estimator):
    gen = torch.Generator().manual_seed(3)
    logp = -3 * torch.rand(64, generator=gen)
    ref = -3 * torch.rand(64, generator=gen)
    d = logp.double() - ref.double()
    expected = {"k1": d, "k2": d * d / 2, "k3": torch.exp(-d) - 1 + d}[estimator]
    got = losses.kl_per_token(logp, ref, estimator)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-6)
    assert float(losses.kl_per_token(ref, ref, estimator).abs().max()) == 0.0
    # over a whole distribution p (the policy) and q (the reference), k1 and k3 average to
    # KL(p || q) under p, and k2 to a second-order approximation of it
    p = torch.softmax(torch.randn(16, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(16, generator=gen, dtype=torch.float64), -1)
    exact = float((p * (p.log() - q.log())).sum())
    mean = float((p * losses.kl_per_token(p.log(), q.log(), estimator)).sum())
    if estimator == "k2":
        assert mean > 0
    else:
        assert mean == pytest.approx(exact, rel=1e-9)


def test_kl_is_exactly_zero_at_the_first_update_under_bik(tmp_path, cache):
    history = _run(tmp_path, cache, "kl", MOVING + ["train.kl_coef=0.5"])
    assert history[0]["train/kl"] == 0.0  # reference and trainer: the same bits
    assert history[0]["mismatch/logprob_abs_diff_max"] == 0.0
    assert all(m["update_applied"] == 1 for m in history)
    assert history[1]["train/kl"] > 0  # the updates moved the policy off the reference


class _Table(torch.nn.Module):
    """A bigram 'model': the logits of the next token are a table's row of the current one."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab) * 3)

    def forward(self, input_ids, attention_mask, position_ids):
        return SimpleNamespace(logits=self.table[input_ids])


def test_entropy_bonus_gradient_raises_the_entropy():
    """Zero advantages: the loss is the entropy term alone; a gradient step raises the
    entropy, and the bonus's gradient flows only with train.entropy_coef > 0."""
    torch.manual_seed(0)
    model = _Table(8)
    ids = torch.randint(0, 8, (4, 6))
    batch = Tokens(ids, torch.ones_like(ids), torch.tensor([[0, 0, 1, 1, 1, 1]] * 4))
    processor = LogitsProcessor(1.0)
    cfg = config.build({}, ["train.entropy_coef=0.5"])

    def entropy_and_loss():
        logp, entropy = losses.token_logprobs_and_entropy(model, batch, processor, 0, "none", True)
        full = loss_batch(batch.response_mask, logp.detach())
        part = losses.prepare(full, torch.zeros(4), cfg)
        loss, _ = losses.policy_loss(logp, part, cfg, entropy=entropy)
        mask = batch.response_mask
        return float((entropy.detach() * mask).sum() / mask.sum()), loss

    before, loss = entropy_and_loss()
    assert float(loss.detach()) == pytest.approx(-0.5 * before)
    loss.backward()
    with torch.no_grad():
        model.table -= 1.0 * model.table.grad
    after, _ = entropy_and_loss()
    assert after > before
    _, no_grad = losses.token_logprobs_and_entropy(model, batch, processor, 0)
    assert not no_grad.requires_grad


def test_resume_with_kl_and_entropy_equals_an_uninterrupted_run(tmp_path, cache, monkeypatch):
    sets = MOVING + [
        "steps=5",
        "train.kl_coef=0.5",
        "train.kl_estimator=k2",
    ]
    full = resumed_equals_uninterrupted(tmp_path, cache, monkeypatch, [*RL_TINY, *sets])
    assert full[3]["train/kl"] > 0  # step 3 (resumed) needs the restored reference
    assert "reference" in torch.load(tmp_path / "cut" / runner.rundir.CHECKPOINT, weights_only=True)


def test_bik_ops_run_in_bfloat16_under_autocast():
    """bik's patched modules cast as torch.autocast does (bik.hf): the lm_head's logits come
    out in bf16 over fp32 weights."""
    cfg = config.build({}, TINY)
    work = policy.working_copy(policy.build_master(cfg.model, 0), "float32", "bik")
    ids = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = work(input_ids=ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = work(input_ids=ids).logits
    assert plain.dtype == torch.float32 and cast.dtype == torch.bfloat16
    assert not torch.equal(plain, cast.float())


def test_autocast_changes_the_trainer_and_measures_a_mismatch(cache, monkeypatch):
    """The rollout does not autocast: both runs sample the same tokens with the same
    log-probs, but the autocast trainer's log-probs differ, so the mismatch is non-zero.
    Invariance holds under autocast: the reference (autocast too) equals the trainer at the
    first update (KL exactly 0), and a mini-batch's forward equals its rows of the batch
    forward (ratio exactly 1)."""
    sets = ["train.mini_batches=2", "train.kl_coef=0.1"]
    plain, cast = _job(cache, sets), _job(cache, [*sets, "train.autocast=bfloat16"])
    updates = updates_of_each_step(monkeypatch)
    records = [plain.step(0), cast.step(0)]
    metrics = [r.metrics for r in records]
    assert torch.equal(records[0].batch.rollout_logp, records[1].batch.rollout_logp)
    assert not torch.equal(records[0].batch.train_logp, records[1].batch.train_logp)
    assert metrics[0]["mismatch/logprob_abs_diff_max"] == 0.0
    assert metrics[1]["mismatch/logprob_abs_diff_max"] > 0
    assert metrics[1]["mismatch/tokens_unequal_frac"] > 0 and metrics[1]["mismatch/k3_kl"] > 0
    assert metrics[1]["train/kl"] == 0.0
    first = updates[1][0]  # the autocast job's first update
    assert first["ppo/ratio_max"] == first["ppo/ratio_min"] == 1.0


def test_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    assert torch.allclose(
        losses.advantages(rewards, 3, "rloo"), torch.tensor([1.0, -0.5, -0.5, -1.0, 0.5, 0.5])
    )
    grpo = losses.advantages(rewards, 3, "grpo")
    assert grpo[0] > 0 > grpo[1] and grpo[:3].sum().abs() < 1e-6


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


def test_loss_aggregations_match_hand_computed_values():
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    agg = losses.aggregate
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
    prepared = losses.prepare(batch, adv, cfg)
    _, stats = losses.policy_loss(old, prepared, cfg)  # no update yet: ratio 1
    assert stats["ppo/ratio_max"] == stats["ppo/ratio_min"] == 1.0
    assert stats["ppo/clip_frac"] == 0.0 and stats["loss"] == pytest.approx(-(2 - 1 + 4) / 7)
    # rows 2, 3 after an update: token (2, 1) at ratio 2 (clipped at 1.28), (3, 2) at 0.5
    current = torch.zeros(2, 3)
    current[0, 1], current[1, 2] = math.log(2.0), math.log(0.5)
    select = slice(2, 4)
    part = prepared.take(select, current)
    loss, stats = losses.policy_loss(current.clone(), part, cfg)
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
        loss, stats = losses.policy_loss(current.clone(), part, dr)
        assert float(loss) == pytest.approx(expected) and stats["loss"] == pytest.approx(expected)


def test_the_entropys_vocabulary_sum_has_one_order_in_any_batch_shape():
    """The entropy metric sums the vocabulary in bik.linear's order: a token's sum has the same
    bits alone as in its batch (torch's sum picked its order by the tensor's shape: a resumed
    run's entropy differed in its last bit), and agrees with float64."""
    values = torch.randn(3, 7, 37, generator=torch.Generator().manual_seed(0))
    sums = losses.vocabulary_sums(values)
    assert sums.shape == (3, 7)
    assert torch.equal(losses.vocabulary_sums(values[1:2, 4:5]), sums[1:2, 4:5])
    assert torch.allclose(sums.double(), values.double().sum(-1), atol=1e-5)
