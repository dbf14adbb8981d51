"""Trainer: full forward over finished sequences, advantages, policy loss with remedies."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

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
            entropies.append(-(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)).sum(-1))
    logp = torch.cat(logps)
    zeros = torch.zeros_like(logp[:, :1])
    logp = torch.where(batch.response_mask.bool(), torch.cat([zeros, logp], 1), 0.0)
    return logp, torch.cat([zeros, torch.cat(entropies)], 1)


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


def policy_loss(
    train_logp: torch.Tensor,
    batch: Batch,
    adv: torch.Tensor,
    cfg: Config,
    rows: slice | None = None,
    select: slice | None = None,
    current: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one update and its stats. PPO-clip (asymmetric) or REINFORCE, weighted by
    the remedy, plus train.kl_coef x the KL to the reference and minus train.entropy_coef x
    the entropy (each term only when its coefficient is > 0), each aggregated by
    train.loss_agg (:func:`aggregate`); ``remedy.bypass`` uses the rollout log-probs as pi_old.

    ``batch`` (``train_logp``: pi_old, the trainer log-probs before the step's first
    update, detached; ``ref_logp``, the reference's, when train.kl_coef > 0; ``kept``, the
    :func:`kept_rows` of train.filter_groups, when it is on: the other rows are left out of
    every term and of the sequence and token counts) and ``adv`` are the whole batch;
    ``select`` is the update's mini-batch (rows of the batch; default all of it),
    ``current`` the current policy's detached log-probs of its rows (default
    ``batch.train_logp``: no update yet). ``train_logp`` and ``entropy`` (the per-position
    entropy, needed when train.entropy_coef > 0) are the mini-batch's rows ``rows`` (default
    all) with grad: a data-parallel rank's share. The loss returned is that share's part of
    the mini-batch's loss (the shares' losses add up to the mini-batch's); remedy weights are
    the whole batch's, over all its rows; the stats (``loss``: the mini-batch's
    policy-gradient term; ``ppo/clip_frac``, ``ppo/ratio_max``, ``ppo/ratio_min``: over its
    kept response tokens) are the mini-batch's, the remedy's the whole batch's."""
    t = cfg.train
    rows = rows or slice(None)
    mask = batch.response_mask.float()
    rollout_logp, batch_logp = batch.rollout_logp, batch.train_logp
    old = rollout_logp if cfg.remedy.bypass else batch_logp
    w, _, stats = remedies.weights(cfg.remedy, batch_logp, rollout_logp, mask)
    kept = torch.ones(mask.shape[0]) if batch.kept is None else batch.kept
    mask = mask * kept[:, None]
    ref = _ref_logp(batch) if t.kl_coef else batch_logp  # batch_logp: a stand-in, unused
    a = adv[:, None].expand_as(batch_logp)
    if select is not None:
        mask, old, w, a, batch_logp, ref, kept = (
            x[select] for x in (mask, old, w, a, batch_logp, ref, kept)
        )
    if current is None:
        current = batch_logp
    how, horizon = t.loss_agg, cfg.rollout.max_new_tokens
    sequences = max(int(kept.sum()), 1)  # the mini-batch's kept sequences
    tokens = mask.sum().clamp(min=1)  # token_mean: the mini-batch's, whichever rows a rank holds

    def share_of(per_token: torch.Tensor) -> torch.Tensor:
        """This share's part of the mini-batch's aggregate of ``per_token`` (rows ``rows``)."""
        if how == "token_mean":
            return (per_token * mask[rows]).sum() / tokens
        return aggregate(per_token, mask[rows], how, sequences, horizon)

    with torch.no_grad():
        per_token, clipped = _per_token(current, old, a, cfg)
        stats["ppo/clip_frac"] = (
            0.0
            if clipped is None
            else float((clipped.float() * mask).sum() / mask.sum().clamp(min=1))
        )
        valid = mask.bool()
        ratio = torch.exp(current - old)[valid]
        stats["ppo/ratio_max"] = float(ratio.max()) if valid.any() else 1.0
        stats["ppo/ratio_min"] = float(ratio.min()) if valid.any() else 1.0
        stats["loss"] = float(aggregate(per_token * w, mask, how, sequences, horizon))
    share, _ = _per_token(train_logp, old[rows], a[rows], cfg)
    loss = share_of(share * w[rows])
    if t.kl_coef:
        loss = loss + t.kl_coef * share_of(kl_per_token(train_logp, ref[rows], t.kl_estimator))
    if t.entropy_coef:
        assert entropy is not None, "train.entropy_coef > 0 needs the entropy with grad"
        loss = loss - t.entropy_coef * share_of(entropy)
    return loss, stats
