"""Mismatch remedies: importance weights / rejection masks, and the fp16 precision remedy.

Every weighting remedy returns ``(weights [B, T], keep [B, T])`` from the old-policy log-probs
the trainer recomputed (``old``) and the rollout's (``rollout``), with rho = exp(old - rollout).
Names follow verl / slime usage (see the metrics reference). The fp16 remedy does not weight
tokens: it runs both sides in float16 with a static loss scale (:func:`precision`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .errors import ConfigError
from .metrics import masked_mean

if TYPE_CHECKING:
    from .config import RemedyConfig

FP16_LOSS_SCALE = 1024.0  # static loss scale of a float16 trainer copy


@dataclass(frozen=True)
class Precision:
    """The dtype each side runs in, and the scale the trainer's loss is multiplied by before
    backward (its gradients are divided by it again in fp32)."""

    train_dtype: str
    rollout_dtype: str
    loss_scale: float


def precision(remedy: str, train_dtype: str, rollout_dtype: str) -> Precision:
    """The sides' dtypes for ``remedy.name``, ``train.dtype`` and ``rollout.dtype``.

    ``remedy.name=fp16`` (FP16 everywhere, Precision-RL) runs both sides in float16; it sets
    the dtypes itself, so both must be left at float32. A float16 trainer always gets the
    static loss scale ``FP16_LOSS_SCALE``.
    """
    if remedy == "fp16":
        if (train_dtype, rollout_dtype) != ("float32", "float32"):
            raise ConfigError(
                "remedy.name=fp16 sets both dtypes itself; leave train.dtype and "
                "rollout.dtype at float32"
            )
        train_dtype = rollout_dtype = "float16"
    scale = FP16_LOSS_SCALE if train_dtype == "float16" else 1.0
    return Precision(train_dtype, rollout_dtype, scale)


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


# The level each weighting remedy acts at: "token" remedies weight / drop tokens one by one,
# "sequence" remedies weight / drop whole sequences (its remedy/*_frac stats count sequences).
TOKEN_REMEDIES = ("token_tis", "token_mis")
SEQUENCE_REMEDIES = ("seq_tis", "seq_mis", "geo_is", "geo_rs", "k1_rs", "k3_rs", "token_veto")
# The remedies that weight by an importance ratio (the rest only keep or drop): refused with
# remedy.bypass under a PPO loss, whose ratio pi_theta / pi_rollout already corrects for the
# rollout policy (config.Config checks it).
IS_REMEDIES = ("token_tis", "seq_tis", "seq_mis", "geo_is", "token_mis")


def weights(
    cfg: RemedyConfig, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(weights, keep, stats) for remedy ``cfg.name``.

    Remedies (rho_t = exp(old_t - rollout_t) per valid token, R = sum_t (old_t - rollout_t)
    per sequence):

    - ``token_tis``: w_t = min(rho_t, clip).
    - ``token_mis`` (IcePop): w_t = rho_t when low <= rho_t <= high, else the token is dropped.
      One-sided MIS: ``remedy.low`` near 0 (it must be > 0, e.g. 1e-9) keeps only the
      upper bound.
    - ``seq_tis``: every token of a sequence gets min(exp(R), clip).
    - ``seq_mis`` (sequence-level masked IS, verl's ``rollout_is=sequence`` with a
      ``lo_hi`` threshold, TRL's ``sequence_mask``): a sequence is kept only when its IS
      weight exp(R) lies in [low, high], and its tokens are weighted by exp(R); a sequence
      outside is dropped whole. Beware the length trap: exp(R) grows with length.
    - ``geo_is``: min(exp(mean_t r_t), clip) per sequence (length-invariant).
    - ``geo_rs``: drop a sequence whose exp(mean_t r_t) leaves [geo_low, geo_high].
    - ``k1_rs`` / ``k3_rs``: drop a sequence whose mean k1 (abs) / k3 exceeds k_threshold.
    - ``token_veto``: drop a sequence holding a token with rho_t < veto.

    stats, each counted at the remedy's own level (``TOKEN_REMEDIES``: a fraction of the
    valid tokens; ``SEQUENCE_REMEDIES``: a fraction of the sequences with at least one
    response token; 0 when there are none):

    - ``remedy/clipped_frac``: what the truncation capped: tokens with rho_t > clip
      (token_tis), sequences with exp(R) > clip (seq_tis) or exp(mean_t r_t) > clip
      (geo_is); 0 for the other remedies.
    - ``remedy/masked_frac``: what the remedy dropped (tokens for token_mis, sequences for
      the sequence remedies); 0 for the remedies that drop nothing.
    """
    m = mask.float()
    valid_tokens = mask.bool()
    r = (old - rollout) * m
    rho = torch.exp(r)
    ones = torch.ones_like(rho)
    name, clip = cfg.name, cfg.clip
    w, keep = ones, ones
    clipped = torch.zeros_like(valid_tokens)  # [B, T] (token remedies) or [B, 1] (sequence)
    if name == "token_tis":  # truncated IS per token
        w = rho.clamp(max=clip)
        clipped = rho > clip
    elif name == "seq_tis":  # truncated sequence IS: prod_t rho_t, capped
        seq_w = torch.exp(r.sum(-1, keepdim=True))
        w, clipped = seq_w.clamp(max=clip).expand_as(rho), seq_w > clip
    elif name == "token_mis":  # IcePop: keep rho only inside [low, high]
        inside = ((rho >= cfg.low) & (rho <= cfg.high)).float()
        w, keep = rho * inside, inside
    elif name == "seq_mis":  # sequence masked IS: keep prod_t rho_t only inside [low, high]
        seq_w = torch.exp(r.sum(-1, keepdim=True))
        inside = ((seq_w >= cfg.low) & (seq_w <= cfg.high)).float()
        w, keep = (seq_w * inside).expand_as(rho), inside.expand_as(rho)
    elif name == "geo_is":  # geometric-mean sequence IS (length-invariant), capped
        geo = torch.exp(_seq_mean(r, m))
        w, clipped = geo.clamp(max=clip).expand_as(rho), geo > clip
    elif name == "geo_rs":  # geometric-mean rejection (length-invariant)
        geo = torch.exp(_seq_mean(r, m))
        keep = ((geo >= cfg.geo_low) & (geo <= cfg.geo_high)).float().expand_as(rho)
    elif name == "k1_rs":
        keep = (_seq_mean(-r, m).abs() <= cfg.k_threshold).float().expand_as(rho)
    elif name == "k3_rs":
        keep = (_seq_mean(rho - r - 1.0, m) <= cfg.k_threshold).float().expand_as(rho)
    elif name == "token_veto":  # drop a sequence holding any token with rho below the veto
        vetoed = ((rho < cfg.veto) & valid_tokens).any(-1, keepdim=True)
        keep = (~vetoed).float().expand_as(rho)
    w = w * keep
    if cfg.self_normalize:
        w = w / masked_mean(w, m).clamp(min=1e-12)
    dropped = (keep == 0) & valid_tokens
    if name in SEQUENCE_REMEDIES:
        rows = valid_tokens.any(-1)  # sequences with a response token
        n = rows.sum().clamp(min=1)
        clipped_frac = (clipped.any(-1) & rows).sum() / n
        masked_frac = (dropped.any(-1) & rows).sum() / n
    else:
        n = valid_tokens.sum().clamp(min=1)
        clipped_frac = (clipped & valid_tokens).sum() / n
        masked_frac = dropped.sum() / n
    stats = {"remedy/masked_frac": float(masked_frac), "remedy/clipped_frac": float(clipped_frac)}
    return w, keep, stats
