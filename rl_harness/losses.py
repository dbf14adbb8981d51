"""The trainer's objective: the full forward's token log-probs and entropy over finished
sequences, group advantages, the KL estimators, the token aggregation, and the policy loss with
the remedy's terms (:func:`prepare` once a step, :func:`policy_loss` per mini-batch).
:class:`rl_harness.trainer.Learner` runs them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import bik
from bik.contract import DTYPE_NAMES
from bik.hf import generation_position_ids

from . import remedies
from .batch import Batch, Tokens
from .logits import LogitsProcessor
from .metrics import masked_mean

if TYPE_CHECKING:
    from .config import Config


def advantages(rewards: torch.Tensor, group_size: int, kind: str) -> torch.Tensor:
    """Per-sequence advantages; sequences of one prompt are ``group_size`` consecutive rows.

    grpo: (r - group mean) / (group std + 1e-6); rloo: r - mean of the other samples.
    """
    groups = rewards.view(-1, group_size)
    mean = groups.mean(-1, keepdim=True)
    if kind == "grpo":
        adv = (groups - mean) / (groups.std(-1, keepdim=True) + 1e-6)
    else:
        adv = (groups - mean) * group_size / (group_size - 1)
    return adv.reshape(-1)


def _autocast(device_type: str, autocast: str) -> contextlib.AbstractContextManager[Any]:
    """train.autocast's context: torch.autocast in that dtype, or nothing ("none")."""
    if autocast == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPE_NAMES[autocast])


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    batch: Tokens,
    processor: LogitsProcessor,
    micro_batch_size: int,
    autocast: str = "none",
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-probs of the sampled tokens ``[B, L]``, with grad, plus the policy entropy
    per position. The logits go through the rollout's ``processor``. Off the response the
    log-probs are 0, as the rollout's are: a finished row's PAD tokens may lie outside the
    top-k / top-p set (log-prob -inf), and -inf there would make the masked loss NaN.

    ``autocast`` (train.autocast): the model's forward under ``torch.autocast`` in that dtype
    ("none": off); the processing stays fp32. ``entropy_grad``: the entropy with grad (an
    entropy bonus in the loss); otherwise it is computed under no_grad."""
    ids, attention = batch.sequences, batch.attention_mask
    size = micro_batch_size or ids.shape[0]
    logps, entropies = [], []
    for start in range(0, ids.shape[0], size):
        part = slice(start, start + size)
        with _autocast(ids.device.type, autocast):
            logits = model(
                input_ids=ids[part],
                attention_mask=attention[part],
                position_ids=generation_position_ids(attention[part]),
            ).logits[:, :-1]
        logits = processor.filter(logits)
        logps.append(processor.token_logprobs(logits, ids[part, 1:]))
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            logp_all = processor.log_probs(logits)
            entropies.append(-vocabulary_sums(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)))
    logp = torch.cat(logps)
    zeros = torch.zeros_like(logp[:, :1])
    logp = torch.where(batch.response_mask.bool(), torch.cat([zeros, logp], 1), 0.0)
    return logp, torch.cat([zeros, torch.cat(entropies)], 1)


def vocabulary_sums(values: torch.Tensor) -> torch.Tensor:
    """``values [..., V]`` summed over the vocabulary in bik.linear's fixed order (ascending
    entries, one fp32 chain): a token's sum has the same bits in any batch shape and on any
    thread count, which torch's sum, whose order follows the tensor's shape, does not give."""
    ones = values.new_ones(1, values.shape[-1])
    return bik.linear(values, ones)[..., 0]


def kept_rows(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """train.filter_groups: 1.0 for the rows of the prompt groups (``group_size``
    consecutive rows) whose rewards are not all equal, 0.0 for the others (zero GRPO / RLOO
    advantage: DAPO's dynamic-sampling filter, without resampling)."""
    groups = rewards.view(-1, group_size)
    varied = (groups != groups[:, :1]).any(-1)
    return varied.float().repeat_interleave(group_size)


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs, d = logp -
    ref_logp (train.kl_estimator): ``k1`` d, ``k2`` d^2 / 2, ``k3`` exp(-d) - 1 + d
    (unbiased and >= 0; unclamped, unlike verl's low_var_kl, as the mismatch metrics are).
    0 where both log-probs are 0 (off the response)."""
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"train.kl_estimator: unknown estimator {estimator!r}")


def mean_kl(batch: Batch, estimator: str) -> float:
    """``train/kl``: the mean over the batch's response tokens of the KL estimate between
    pi_old (``batch.train_logp``) and the reference (``batch.ref_logp``)."""
    kl = kl_per_token(batch.train_logp, _ref_logp(batch), estimator)
    return float(masked_mean(kl, batch.response_mask.float()))


def _ref_logp(batch: Batch) -> torch.Tensor:
    """``batch.ref_logp``, which train.kl_coef > 0 needs."""
    if batch.ref_logp is None:
        raise ValueError("batch.ref_logp: train.kl_coef > 0 needs the reference's log-probs")
    return batch.ref_logp


def _per_token(
    logp: torch.Tensor, old: torch.Tensor, a: torch.Tensor, cfg: Config
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-token loss before weighting, and PPO's clipped-or-not mask (None: REINFORCE)."""
    t = cfg.train
    if t.loss == "ppo":
        ratio = torch.exp(logp - old)
        clipped = ratio.clamp(1 - t.clip_low, 1 + t.clip_high)
        return -torch.minimum(ratio * a, clipped * a), ratio != clipped
    return -a * logp, None


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, how: str, sequences: int, horizon: int
) -> torch.Tensor:
    """One number from per-token losses ``loss [b, T]`` (0/1 ``mask``: the response tokens)
    of ``b`` of a mini-batch's ``sequences`` rows (all of them, or a rank's share: the shares'
    results add up to the mini-batch's). ``how`` (train.loss_agg): ``token_mean``, the mean
    over all the mini-batch's response tokens (``mask`` must then be all its rows);
    ``seq_mean_token_mean``, the mean over the sequences of each one's token mean;
    ``seq_mean_token_sum_norm`` (Dr. GRPO), the sum over ``sequences`` x ``horizon``
    (rollout.max_new_tokens)."""
    if how == "token_mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1)
    if how == "seq_mean_token_mean":
        per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / sequences
    if how == "seq_mean_token_sum_norm":
        return (loss * mask).sum() / (sequences * horizon)
    raise ValueError(f"unknown loss aggregation {how!r}")


@dataclass(frozen=True)
class Prepared:
    """What every update of a step reads, computed once from the whole batch (:func:`prepare`),
    or the rows of one mini-batch of it (:meth:`take`). All ``[B, L]`` but ``kept``."""

    old: torch.Tensor  # pi_old: the trainer's log-probs before any update (remedy.bypass: the
    # rollout's)
    adv: torch.Tensor  # each row's advantage, at every position
    weights: torch.Tensor  # the remedy's token weights (over the whole batch)
    mask: torch.Tensor  # float: the response tokens of the rows train.filter_groups keeps
    kept: torch.Tensor  # [B] float: 1 for a kept row
    ref: torch.Tensor | None  # the reference's log-probs (train.kl_coef > 0), else None
    current: torch.Tensor  # the policy's log-probs now, detached (before any update: pi_old)
    remedy_stats: dict[str, float]  # the remedy's metrics, the whole batch's

    def take(self, select: slice | None, current: torch.Tensor | None = None) -> Prepared:
        """The rows ``select`` (None: all), at the current policy's log-probs of those rows
        (None: no update yet, pi_old)."""
        rows = select or slice(None)
        cut = {
            name: getattr(self, name)[rows]
            for name in ("old", "adv", "weights", "mask", "kept", "current")
        }
        if current is not None:
            cut["current"] = current
        ref = None if self.ref is None else self.ref[rows]
        return Prepared(**cut, ref=ref, remedy_stats=self.remedy_stats)


def prepare(batch: Batch, adv: torch.Tensor, cfg: Config) -> Prepared:
    """The step's :class:`Prepared` record: pi_old, the advantages, the remedy's weights and
    stats (a whole-batch quantity: once per step, not once per update), the mask of the kept
    rows (``batch.kept``, train.filter_groups) and the reference's log-probs
    (``batch.ref_logp``, needed when train.kl_coef > 0)."""
    mask = batch.response_mask.float()
    pi_old = batch.train_logp
    weights, _, stats = remedies.weights(cfg.remedy, pi_old, batch.rollout_logp, mask)
    kept = torch.ones(mask.shape[0]) if batch.kept is None else batch.kept
    return Prepared(
        old=batch.rollout_logp if cfg.remedy.bypass else pi_old,
        adv=adv[:, None].expand_as(pi_old),
        weights=weights,
        mask=mask * kept[:, None],
        kept=kept,
        ref=_ref_logp(batch) if cfg.train.kl_coef else None,
        current=pi_old,
        remedy_stats=stats,
    )


def policy_loss(
    train_logp: torch.Tensor,
    part: Prepared,
    cfg: Config,
    rows: slice | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one update over the mini-batch ``part`` (:meth:`Prepared.take`) and its
    stats. PPO-clip (asymmetric) or REINFORCE, weighted by the remedy, plus train.kl_coef x
    the KL to the reference and minus train.entropy_coef x the entropy (each term only when
    its coefficient is > 0), each aggregated by train.loss_agg (:func:`aggregate`) over the
    kept rows' tokens.

    ``train_logp`` and ``entropy`` (the per-position entropy, needed when
    train.entropy_coef > 0) are the rows ``rows`` of the mini-batch (default all) with grad:
    a data-parallel rank's share; the loss returned is that share's part of the mini-batch's
    loss (the shares' losses add up to the mini-batch's). The stats (``loss``: the
    mini-batch's policy-gradient term; ``ppo/clip_frac``, ``ppo/ratio_max``,
    ``ppo/ratio_min``: over its kept response tokens, at ``part.current``) are the
    mini-batch's."""
    t = cfg.train
    rows = rows or slice(None)
    mask, old, a, w = part.mask, part.old, part.adv, part.weights
    how, horizon = t.loss_agg, cfg.rollout.max_new_tokens
    sequences = max(int(part.kept.sum()), 1)  # the mini-batch's kept sequences
    tokens = mask.sum().clamp(min=1)  # token_mean: the mini-batch's, whichever rows a rank holds

    def share_of(per_token: torch.Tensor) -> torch.Tensor:
        """This share's part of the mini-batch's aggregate of ``per_token`` (rows ``rows``)."""
        if how == "token_mean":
            return (per_token * mask[rows]).sum() / tokens
        return aggregate(per_token, mask[rows], how, sequences, horizon)

    stats: dict[str, float] = {}
    with torch.no_grad():
        per_token, clipped = _per_token(part.current, old, a, cfg)
        stats["ppo/clip_frac"] = (
            0.0
            if clipped is None
            else float((clipped.float() * mask).sum() / mask.sum().clamp(min=1))
        )
        valid = mask.bool()
        ratio = torch.exp(part.current - old)[valid]
        stats["ppo/ratio_max"] = float(ratio.max()) if valid.any() else 1.0
        stats["ppo/ratio_min"] = float(ratio.min()) if valid.any() else 1.0
        stats["loss"] = float(aggregate(per_token * w, mask, how, sequences, horizon))
    share, _ = _per_token(train_logp, old[rows], a[rows], cfg)
    loss = share_of(share * w[rows])
    if t.kl_coef:
        assert part.ref is not None  # prepare() refuses a KL term without the reference
        loss = loss + t.kl_coef * share_of(kl_per_token(train_logp, part.ref[rows], t.kl_estimator))
    if t.entropy_coef:
        assert entropy is not None, "train.entropy_coef > 0 needs the entropy with grad"
        loss = loss - t.entropy_coef * share_of(entropy)
    return loss, stats
