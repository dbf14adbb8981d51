"""Trainer: full forward over finished sequences, advantages, policy loss with remedies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from bik.hf import generation_position_ids

from . import remedies
from .logits import LogitsProcessor

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


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    batch: dict[str, Any],
    processor: LogitsProcessor,
    micro_batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-probs of the sampled tokens ``[B, L]``, with grad, plus the policy entropy
    per position. The logits go through the rollout's ``processor``. Off the response the
    log-probs are 0, as the rollout's are: a finished row's PAD tokens may lie outside the
    top-k / top-p set (log-prob -inf), and -inf there would make the masked loss NaN."""
    ids, attention = batch["sequences"], batch["attention_mask"]
    size = micro_batch_size or ids.shape[0]
    logps, entropies = [], []
    for start in range(0, ids.shape[0], size):
        part = slice(start, start + size)
        logits = model(
            input_ids=ids[part],
            attention_mask=attention[part],
            position_ids=generation_position_ids(attention[part]),
        ).logits[:, :-1]
        logits = processor.filter(logits)
        logps.append(processor.token_logprobs(logits, ids[part, 1:]))
        with torch.no_grad():
            logp_all = processor.log_probs(logits)
            entropies.append(-(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)).sum(-1))
    logp = torch.cat(logps)
    zeros = torch.zeros_like(logp[:, :1])
    logp = torch.where(batch["response_mask"].bool(), torch.cat([zeros, logp], 1), 0.0)
    return logp, torch.cat([zeros, torch.cat(entropies)], 1)


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
    batch: dict[str, Any],
    adv: torch.Tensor,
    cfg: Config,
    rows: slice | None = None,
    select: slice | None = None,
    current: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of one update and its stats. PPO-clip (asymmetric) or REINFORCE,
    weighted by the remedy, aggregated by train.loss_agg (:func:`aggregate`);
    ``remedy.bypass`` uses the rollout log-probs as pi_old.

    ``batch`` (with ``train_logp``, pi_old: the trainer log-probs before the step's first
    update, detached) and ``adv`` are the whole batch; ``select`` is the update's mini-batch
    (rows of the batch; default all of it), ``current`` the current policy's detached
    log-probs of its rows (default ``batch["train_logp"]``: no update yet). ``train_logp`` is
    the mini-batch's rows ``rows`` (default all) with grad: a data-parallel rank's share. The
    loss returned is that share's part of the mini-batch's loss (the shares' losses add up to
    the mini-batch's); remedy weights are the whole batch's; the stats (``loss``: the
    mini-batch's loss; ``ppo/clip_frac``, ``ppo/ratio_max``, ``ppo/ratio_min``: over its
    response tokens) are the mini-batch's, the remedy's the whole batch's."""
    rows = rows or slice(None)
    mask = batch["response_mask"].float()
    rollout_logp, batch_logp = batch["rollout_logp"], batch["train_logp"]
    old = rollout_logp if cfg.remedy.bypass else batch_logp
    w, _, stats = remedies.weights(cfg.remedy, batch_logp, rollout_logp, mask)
    a = adv[:, None].expand_as(batch_logp)
    if select is not None:
        mask, old, w, a, batch_logp = (x[select] for x in (mask, old, w, a, batch_logp))
    if current is None:
        current = batch_logp
    how, horizon = cfg.train.loss_agg, cfg.rollout.max_new_tokens
    sequences = mask.shape[0]
    if how == "token_mean":  # the mini-batch's token count, whichever rows a rank holds
        tokens = mask.sum().clamp(min=1)
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
    if how == "token_mean":
        return (share * w[rows] * mask[rows]).sum() / tokens, stats
    return aggregate(share * w[rows], mask[rows], how, sequences, horizon), stats
