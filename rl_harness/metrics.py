"""Mismatch metrics between trainer and rollout log-probs, named as verl / slime users know them.

Notation (per valid token): r = l_train - l_rollout, rho = exp(r). All statistics are computed
in float64 over the tokens where ``mask`` is set, before any remedy masks tokens (a rejection
remedy must not be able to drive the mismatch it reacts to to zero).

Where the conventions deliberately differ from verl's (rollout_corr_helper):

- Sequence-level statistics (``log_ppl_abs_diff``, ``chi2_seq``, ``seq_is_weight_*``) skip
  rows without a response token, where verl averages over every row of the batch. In the
  harness every row has at least one response token, so this never changes its figures.
- ``log_ppl_diff`` keeps verl's sign: per sequence, mean_t l_rollout - mean_t l_train
  (= -mean_t r; positive when the trainer gives the sequence the lower probability).
- Log ratios are not clamped: exp(r) is taken of the float64 r as it is, so a huge mismatch
  shows as a huge (or infinite) chi2 / IS weight rather than a capped one. verl clamps the
  log ratio to [-20, 20] (its SAFETY_BOUND) before exponentiating; ``clamp_log_ratio=20.0``
  does the same here, per token and for the per-sequence sum, in every statistic that
  exponentiates (k3, chi2, IS weights, ESS, fractions beyond C). The abs diffs, the unequal
  count, k1 and k2 always use the raw r.
"""

from __future__ import annotations

import math

import torch

PREFIX = "mismatch/"
# Rollout-probability buckets of the per-bucket mismatch: p = exp(l_rollout) of the sampled
# token falls in [0, 0.5), [0.5, 0.9) or [0.9, 1]. Low-probability tokens carry most mismatch.
PROB_BUCKETS = (
    ("p_lt_0.5", 0.0, 0.5),
    ("p_0.5_to_0.9", 0.5, 0.9),
    ("p_ge_0.9", 0.9, math.inf),
)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the tokens where ``mask`` is 1 (0 when there are none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def mismatch_metrics(
    train_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 2.0,
    clamp_log_ratio: float | None = None,
) -> dict[str, float]:
    """Every mismatch metric of one batch as a dict of floats (keys prefixed 'mismatch/').

    train_logp, rollout_logp: ``[B, T]`` log-probs of the sampled tokens; mask: ``[B, T]``
    (1 = response token). ``clip`` is C of the IS-weight fraction and ESS statistics.
    ``clamp_log_ratio``: None (the harness's convention) or verl's bound (20.0) on the log
    ratios that are exponentiated (see the module docstring).

    Sequence-level log-perplexity statistics (over the sequences with a response token; 0
    when there are none): ``log_ppl_diff`` (mean of d_i = mean_t l_rollout - mean_t l_train,
    verl's sign), ``log_ppl_diff_max`` / ``log_ppl_diff_min`` (max / min of d_i),
    ``log_ppl_abs_diff`` (mean of abs(d_i)) and ``log_ppl_abs_diff_sum`` (mean of
    abs(sum_t r), the per-sequence sum of log-prob differences of Beyond Precision,
    arXiv 2602.01826, eq. 8: unlike the per-token mean it grows with the response length).

    Per rollout-probability bucket (``PROB_BUCKETS``, p = exp(l_rollout)):
    ``abs_diff_<bucket>`` is the mean abs(r) over the bucket's tokens (0 when it has none)
    and ``tokens_<bucket>`` their count, e.g. ``abs_diff_p_lt_0.5`` / ``tokens_p_lt_0.5``.
    """
    if train_logp.shape != rollout_logp.shape or mask.shape != train_logp.shape:
        raise ValueError(
            f"mismatch_metrics: expected equal shapes, got {tuple(train_logp.shape)}, "
            f"{tuple(rollout_logp.shape)}, {tuple(mask.shape)}"
        )
    m = mask.to(torch.float64)
    valid = m.bool()
    r = torch.where(valid, train_logp.double() - rollout_logp.double(), 0.0)
    tokens_per_seq = m.sum(-1)
    has_tokens = tokens_per_seq > 0
    seq_log_ratio = r.sum(-1)  # log of the sequence IS weight prod_t rho_t
    r_exp = r
    if clamp_log_ratio is not None:
        r_exp = r.clamp(-clamp_log_ratio, clamp_log_ratio)
        seq_log_ratio = seq_log_ratio.clamp(-clamp_log_ratio, clamp_log_ratio)
    rho = torch.exp(r_exp)
    seq_mean = lambda x: x[has_tokens].mean() if bool(has_tokens.any()) else x.new_zeros(())
    weights = rho[valid]
    clamped = weights.clamp(1.0 / clip, clip)
    normalised = clamped / clamped.mean() if weights.numel() else clamped
    per_seq_mean = lambda x: (x * m).sum(-1) / tokens_per_seq.clamp(min=1)
    # per sequence: mean_t l_rollout - mean_t l_train (verl's log_ppl_diff), and sum_t r
    log_ppl_diff = -per_seq_mean(r)  # r is 0 off the mask: no -inf * 0 from padding
    seq_extreme = lambda x, pick: pick(x[has_tokens]) if bool(has_tokens.any()) else r.new_zeros(())
    p_rollout = torch.exp(rollout_logp.double())
    buckets = {}
    for bucket, low, high in PROB_BUCKETS:
        inside = (valid & (p_rollout >= low) & (p_rollout < high)).double()
        buckets[f"abs_diff_{bucket}"] = masked_mean(r.abs(), inside)  # 0 when empty
        buckets[f"tokens_{bucket}"] = inside.sum()
    stats = {
        "logprob_abs_diff_mean": masked_mean(r.abs(), m),
        "logprob_abs_diff_max": r.abs().max() if r.numel() else r.new_zeros(()),
        "tokens_unequal_frac": masked_mean((r != 0).double(), m),
        "tokens_unequal_count": ((r != 0) & valid).sum().double(),
        "k1_kl": masked_mean(-r, m),
        "k2_kl": masked_mean(0.5 * r * r, m),
        "k3_kl": masked_mean(rho - r_exp - 1.0, m),
        "log_ppl_abs_diff": seq_mean(log_ppl_diff.abs()),
        "log_ppl_diff": seq_mean(log_ppl_diff),
        "log_ppl_diff_max": seq_extreme(log_ppl_diff, torch.max),
        "log_ppl_diff_min": seq_extreme(log_ppl_diff, torch.min),
        "log_ppl_abs_diff_sum": seq_mean(r.sum(-1).abs()),
        "chi2_token": masked_mean(rho * rho, m) - 1.0,
        "chi2_seq": seq_mean(torch.exp(2.0 * seq_log_ratio)) - 1.0,
        "is_weight_mean": weights.mean() if weights.numel() else r.new_ones(()),
        "is_weight_min": weights.min() if weights.numel() else r.new_ones(()),
        "is_weight_max": weights.max() if weights.numel() else r.new_ones(()),
        "seq_is_weight_mean": seq_mean(torch.exp(seq_log_ratio)),
        "seq_is_weight_max": torch.exp(seq_log_ratio[has_tokens]).max()
        if bool(has_tokens.any())
        else r.new_ones(()),
        "is_ess": 1.0 / (normalised * normalised).mean() if weights.numel() else r.new_ones(()),
        "is_frac_above_c": (weights > clip).double().mean() if weights.numel() else r.new_zeros(()),
        "is_frac_below_inv_c": (weights < 1.0 / clip).double().mean()
        if weights.numel()
        else r.new_zeros(()),
        **buckets,
    }
    return {PREFIX + name: float(value) for name, value in stats.items()}
