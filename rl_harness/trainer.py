"""Trainer: full forward over finished sequences, advantages, policy loss with remedies."""

import torch

import bik
from bik.hf import generation_position_ids

from . import remedies
from .rollout import process_logits


def advantages(rewards, group_size, kind):
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


def token_logprobs_and_entropy(model, batch, rollout_cfg, micro_batch_size):
    """Trainer log-probs of the sampled tokens ``[B, L]`` (0 at position 0), with grad, plus the
    mean policy entropy over response tokens. The logits get the rollout's processing."""
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
        logits = process_logits(logits, rollout_cfg["top_k"], rollout_cfg["top_p"])
        temperature = rollout_cfg["temperature"]
        logps.append(bik.token_logprobs(logits, ids[part, 1:], temperature))
        with torch.no_grad():
            logp_all = bik.log_softmax(logits / temperature, dtype=torch.float32)
            entropies.append(-(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)).sum(-1))
    logp = torch.cat(logps)
    zeros = torch.zeros_like(logp[:, :1])
    return torch.cat([zeros, logp], 1), torch.cat([zeros, torch.cat(entropies)], 1)


def policy_loss(train_logp, batch, adv, cfg):
    """Token-mean policy loss and its stats. PPO-clip (asymmetric) or REINFORCE, weighted by
    the remedy; ``remedy.bypass`` uses the rollout log-probs as pi_old."""
    mask = batch["response_mask"].float()
    rollout_logp = batch["rollout_logp"]
    old = rollout_logp if cfg["remedy"]["bypass"] else train_logp.detach()
    w, _, stats = remedies.weights(cfg["remedy"], train_logp.detach(), rollout_logp, mask)
    a = adv[:, None].expand_as(train_logp)
    t = cfg["train"]
    if t["loss"] == "ppo":
        ratio = torch.exp(train_logp - old)
        clipped = ratio.clamp(1 - t["clip_low"], 1 + t["clip_high"])
        per_token = -torch.minimum(ratio * a, clipped * a)
        with torch.no_grad():
            stats["ppo/clip_frac"] = float(
                ((ratio != clipped).float() * mask).sum() / mask.sum().clamp(min=1)
            )
    else:
        per_token = -a * train_logp
        stats["ppo/clip_frac"] = 0.0
    loss = (per_token * w * mask).sum() / mask.sum().clamp(min=1)
    return loss, stats
