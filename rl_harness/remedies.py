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


def weights(
    cfg: RemedyConfig, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(weights, keep, stats) for remedy ``cfg.name``; stats: clipped / masked fractions."""
    m = mask.float()
    r = (old - rollout) * m
    rho = torch.exp(r)
    ones = torch.ones_like(rho)
    name, clip = cfg.name, cfg.clip
    w, keep = ones, ones
    if name == "token_tis":  # truncated IS per token
        w = rho.clamp(max=clip)
    elif name == "seq_tis":  # truncated sequence IS: prod_t rho_t, capped
        w = torch.exp(r.sum(-1, keepdim=True)).clamp(max=clip).expand_as(rho)
    elif name == "token_mis":  # IcePop: keep rho only inside [low, high]
        inside = ((rho >= cfg.low) & (rho <= cfg.high)).float()
        w, keep = rho * inside, inside
    elif name == "geo_is":  # geometric-mean sequence IS (length-invariant), capped
        w = torch.exp(_seq_mean(r, m)).clamp(max=clip).expand_as(rho)
    elif name == "geo_rs":  # geometric-mean rejection (length-invariant)
        geo = torch.exp(_seq_mean(r, m))
        keep = ((geo >= cfg.geo_low) & (geo <= cfg.geo_high)).float().expand_as(rho)
    elif name == "k1_rs":
        keep = (_seq_mean(-r, m).abs() <= cfg.k_threshold).float().expand_as(rho)
    elif name == "k3_rs":
        keep = (_seq_mean(rho - r - 1.0, m) <= cfg.k_threshold).float().expand_as(rho)
    elif name == "token_veto":  # drop a sequence holding any token with rho below the veto
        vetoed = ((rho < cfg.veto) & mask.bool()).any(-1, keepdim=True)
        keep = (~vetoed).float().expand_as(rho)
    w = w * keep
    if cfg.self_normalize:
        w = w / masked_mean(w, m).clamp(min=1e-12)
    valid = m.sum().clamp(min=1)
    stats = {
        "remedy/masked_frac": float(((1 - keep) * m).sum() / valid),
        "remedy/clipped_frac": float(((rho > clip) & mask.bool()).float().sum() / valid)
        if name in ("token_tis", "seq_tis", "geo_is")
        else 0.0,
    }
    return w, keep, stats
