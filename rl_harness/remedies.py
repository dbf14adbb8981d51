"""Mismatch remedies: importance weights / rejection masks, and the fp16 precision remedy.

Every weighting remedy returns ``(weights [B, T], keep [B, T])`` from the old-policy log-probs
the trainer recomputed (``old``) and the rollout's (``rollout``), with rho = exp(old - rollout).
Names follow verl / slime usage (see the metrics reference). The fp16 remedy does not weight
tokens: it runs both sides in float16 with a static loss scale (:func:`precision`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from .errors import ConfigError
from .metrics import masked_mean
from .sections import Section, spec

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


@dataclass(frozen=True)
class _Ratios:
    """What every weighting remedy reads: r_t = old_t - rollout_t on valid tokens (0
    elsewhere), rho_t = exp(r_t), the float mask ``m`` and the boolean ``valid`` tokens."""

    r: torch.Tensor
    rho: torch.Tensor
    m: torch.Tensor
    valid: torch.Tensor


# A remedy's weight function: (w, keep, clipped). ``w`` and ``keep`` [B, T] or broadcastable
# (None: all ones); ``clipped``: what a truncation capped, [B, T] or [B, 1] (None: nothing).
_Weigh = Callable[["RemedyConfig", _Ratios], tuple]


@dataclass(frozen=True)
class Remedy:
    """One mismatch remedy. level: "token" (weights / drops tokens one by one), "sequence"
    (whole sequences; its remedy/*_frac stats count sequences) or None (weights nothing).
    importance_sampling: it weights by an importance ratio (the rest only keep or drop), so
    it is refused with remedy.bypass under a PPO loss, whose ratio pi_theta / pi_rollout
    already corrects for the rollout policy (config.Config checks it). weigh: its weight
    function (None: every weight 1). summary: one line for the docs."""

    name: str
    level: str | None
    importance_sampling: bool
    weigh: _Weigh | None
    summary: str


def _token_tis(cfg: RemedyConfig, q: _Ratios) -> tuple:
    return q.rho.clamp(max=cfg.clip), None, q.rho > cfg.clip


def _seq_tis(cfg: RemedyConfig, q: _Ratios) -> tuple:
    seq_w = torch.exp(q.r.sum(-1, keepdim=True))  # prod_t rho_t
    return seq_w.clamp(max=cfg.clip).expand_as(q.rho), None, seq_w > cfg.clip


def _token_mis(cfg: RemedyConfig, q: _Ratios) -> tuple:
    inside = ((q.rho >= cfg.low) & (q.rho <= cfg.high)).float()
    return q.rho * inside, inside, None


def _seq_mis(cfg: RemedyConfig, q: _Ratios) -> tuple:
    seq_w = torch.exp(q.r.sum(-1, keepdim=True))
    inside = ((seq_w >= cfg.low) & (seq_w <= cfg.high)).float()
    return (seq_w * inside).expand_as(q.rho), inside.expand_as(q.rho), None


def _geo_is(cfg: RemedyConfig, q: _Ratios) -> tuple:
    geo = torch.exp(_seq_mean(q.r, q.m))
    return geo.clamp(max=cfg.clip).expand_as(q.rho), None, geo > cfg.clip


def _geo_rs(cfg: RemedyConfig, q: _Ratios) -> tuple:
    geo = torch.exp(_seq_mean(q.r, q.m))
    inside = (geo >= cfg.geo_low) & (geo <= cfg.geo_high)
    return None, inside.float().expand_as(q.rho), None


def _k1_rs(cfg: RemedyConfig, q: _Ratios) -> tuple:
    k1 = _seq_mean(-q.r, q.m).abs()
    return None, (k1 <= cfg.k_threshold).float().expand_as(q.rho), None


def _k3_rs(cfg: RemedyConfig, q: _Ratios) -> tuple:
    k3 = _seq_mean(q.rho - q.r - 1.0, q.m)
    return None, (k3 <= cfg.k_threshold).float().expand_as(q.rho), None


def _token_veto(cfg: RemedyConfig, q: _Ratios) -> tuple:
    vetoed = ((q.rho < cfg.veto) & q.valid).any(-1, keepdim=True)
    return None, (~vetoed).float().expand_as(q.rho), None


# Each record's summary is the one statement of its formula: weights() and the README's list
# (markdown(), checked by a test) read it from here.
REMEDIES: dict[str, Remedy] = {
    remedy.name: remedy
    for remedy in (
        Remedy("none", None, False, None, "no remedy: every token weighs 1"),
        Remedy("token_tis", "token", True, _token_tis, "w_t = min(rho_t, clip)"),
        Remedy(
            "seq_tis",
            "sequence",
            True,
            _seq_tis,
            "every token of a sequence gets min(exp(R), clip)",
        ),
        Remedy(
            "geo_is",
            "sequence",
            True,
            _geo_is,
            "min(exp(mean_t r_t), clip) for every token of a sequence (length-invariant)",
        ),
        Remedy(
            "geo_rs",
            "sequence",
            False,
            _geo_rs,
            "drop a sequence whose exp(mean_t r_t) leaves [geo_low, geo_high]",
        ),
        Remedy(
            "token_mis",
            "token",
            True,
            _token_mis,
            "IcePop: w_t = rho_t when low <= rho_t <= high, else the token is dropped; low "
            "near 0 (it must be > 0, e.g. 1e-9) keeps only the upper bound",
        ),
        Remedy(
            "seq_mis",
            "sequence",
            True,
            _seq_mis,
            "sequence-level masked IS (verl's rollout_is=sequence with lo_hi, TRL's "
            "sequence_mask): a sequence is kept only when exp(R) lies in [low, high], its "
            "tokens weighted by exp(R); beware the length trap: exp(R) grows with length",
        ),
        Remedy(
            "k1_rs", "sequence", False, _k1_rs, "drop a sequence whose |mean_t k1| > k_threshold"
        ),
        Remedy("k3_rs", "sequence", False, _k3_rs, "drop a sequence whose mean_t k3 > k_threshold"),
        Remedy(
            "token_veto",
            "sequence",
            False,
            _token_veto,
            "drop a sequence holding a token with rho_t < veto",
        ),
        Remedy(
            "fp16",
            None,
            False,
            None,
            "both sides in float16 with a static loss scale (FP16_LOSS_SCALE); weights nothing",
        ),
    )
}


LEGEND = (
    "rho_t = exp(r_t), r_t the trainer's minus the rollout's log-prob of a token, "
    "R = sum_t r_t over a sequence; w_t a token's weight in the loss"
)


def markdown() -> str:
    """The README's list of remedies, one line per record (``python -m rl_harness remedies``)."""
    return "\n".join(
        f"- `{r.name}`{'' if r.level is None else f' ({r.level})'}: {r.summary}"
        for r in REMEDIES.values()
    )


# The groupings other modules and the tests use, derived from the records.
TOKEN_REMEDIES = tuple(name for name, r in REMEDIES.items() if r.level == "token")
SEQUENCE_REMEDIES = tuple(name for name, r in REMEDIES.items() if r.level == "sequence")
IS_REMEDIES = tuple(name for name, r in REMEDIES.items() if r.importance_sampling)


def weights(
    cfg: RemedyConfig, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(weights, keep, stats) for remedy ``cfg.name`` (its record in ``REMEDIES``).

    rho_t = exp(old_t - rollout_t) per valid token, r_t = old_t - rollout_t, R = sum_t r_t
    per sequence; each remedy's formula is its record's summary (``REMEDIES``).

    stats, each counted at the remedy's own level (token remedies: a fraction of the
    valid tokens; sequence remedies: a fraction of the sequences with at least one
    response token; 0 when there are none):

    - ``remedy/clipped_frac``: what the truncation capped: tokens with rho_t > clip
      (token_tis), sequences with exp(R) > clip (seq_tis) or exp(mean_t r_t) > clip
      (geo_is); 0 for the other remedies.
    - ``remedy/masked_frac``: what the remedy dropped (tokens for token_mis, sequences for
      the sequence remedies); 0 for the remedies that drop nothing.
    """
    remedy = REMEDIES[cfg.name]
    m = mask.float()
    valid_tokens = mask.bool()
    r = (old - rollout) * m
    rho = torch.exp(r)
    ones = torch.ones_like(rho)
    w, keep, clipped = ones, ones, None
    if remedy.weigh is not None:
        w, keep, clipped = remedy.weigh(cfg, _Ratios(r, rho, m, valid_tokens))
        w = ones if w is None else w
        keep = ones if keep is None else keep
    if clipped is None:
        clipped = torch.zeros_like(valid_tokens)
    w = w * keep
    if cfg.self_normalize:
        w = w / masked_mean(w, m).clamp(min=1e-12)
    dropped = (keep == 0) & valid_tokens
    if remedy.level == "sequence":
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


@dataclass(frozen=True)
class RemedyConfig(Section):
    """The mismatch remedy (rl_harness.remedies) and its thresholds.

    ``low`` / ``high`` bound the token ratio of ``token_mis`` (IcePop) and the sequence IS
    weight of ``seq_mis``. One-sided MIS (an upper bound only, as with verl's single-number
    threshold): set ``low`` to a tiny positive number (e.g. 1e-9; it must be > 0), so only
    ratios above ``high`` are dropped. ``bypass`` (pi_old := pi_rollout) is refused with an
    importance-sampling remedy under the PPO loss (see ``Config``).
    """

    SECTION: ClassVar[str] = "remedy"
    name: str = spec("none", choices=tuple(REMEDIES))
    clip: float = spec(2.0, ge=1)  # C of the truncated IS remedies and the IS metrics
    low: float = spec(0.5, gt=0)  # token_mis / seq_mis lower bound (tiny: one-sided MIS)
    high: float = spec(2.0, gt=0)  # token_mis / seq_mis upper bound
    geo_low: float = spec(0.999, gt=0)
    geo_high: float = spec(1.001, gt=0)
    k_threshold: float = spec(0.01, ge=0)
    veto: float = spec(1e-4, ge=0)
    self_normalize: bool = False
    bypass: bool = False

    def _validate(self) -> None:
        for low, high in (("low", "high"), ("geo_low", "geo_high")):
            if getattr(self, high) < getattr(self, low):
                raise ConfigError(
                    f"remedy.{high}: expected at least remedy.{low} ({getattr(self, low)}), "
                    f"got {getattr(self, high)}"
                )
