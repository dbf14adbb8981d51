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


def policy_loss(
    train_logp: torch.Tensor,
    batch: dict[str, Any],
    adv: torch.Tensor,
    cfg: Config,
    rows: slice | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean policy loss and its stats. PPO-clip (asymmetric) or REINFORCE, weighted by
    the remedy; ``remedy.bypass`` uses the rollout log-probs as pi_old.

    ``batch`` (with ``train_logp``, the trainer log-probs, detached) and ``adv`` are the whole
    batch; ``train_logp`` is its rows ``rows`` (default all) with grad: a data-parallel rank's
    share. The loss returned is that share's part of the whole batch's loss (its tokens' sum
    over the batch's token count: the shares' losses add up to the batch's); remedy weights
    and the stats (``loss``: the batch's loss) are the whole batch's."""
    rows = rows or slice(None)
    mask = batch["response_mask"].float()
    rollout_logp, batch_logp = batch["rollout_logp"], batch["train_logp"]
    old = rollout_logp if cfg.remedy.bypass else batch_logp
    w, _, stats = remedies.weights(cfg.remedy, batch_logp, rollout_logp, mask)
    a = adv[:, None].expand_as(batch_logp)
    tokens = mask.sum().clamp(min=1)
    with torch.no_grad():
        per_token, clipped = _per_token(batch_logp, old, a, cfg)
        stats["ppo/clip_frac"] = (
            0.0 if clipped is None else float((clipped.float() * mask).sum() / tokens)
        )
        stats["loss"] = float((per_token * w * mask).sum() / tokens)
    share, _ = _per_token(train_logp, old[rows], a[rows], cfg)
    return (share * w[rows] * mask[rows]).sum() / tokens, stats
