"""The logits processing both sides share, and the rollout-only synthetic perturbations.

Sampler and trainer must turn logits into log-probs through one formula, or the processing
itself becomes a mismatch (a missing temperature alone gives a ratio near 2). Both sides use
:class:`LogitsProcessor`: top-k / top-p filtering of the fp32 logits (-inf outside the kept
set), then ``bik.log_softmax`` / ``bik.token_logprobs`` of ``logits / temperature``.
:func:`perturb` holds the mismatch sources a config can inject into the rollout's logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import bik

if TYPE_CHECKING:
    from .config import RolloutConfig


class LogitsProcessor:
    """Temperature, top-k (0: off) and top-p (1: off) of one run, applied identically by the
    rollout and the trainer."""

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    @classmethod
    def of(cls, cfg: RolloutConfig) -> LogitsProcessor:
        return cls(cfg.temperature, cfg.top_k, cfg.top_p)

    def filter(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 ``logits`` with -inf outside the top-k / top-p set (before the temperature)."""
        logits = logits.float()
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
            probs = bik.log_softmax(sorted_logits).exp()
            drop = probs.cumsum(-1) - probs > self.top_p  # smallest prefix reaching top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return logits

    def log_probs(self, filtered: torch.Tensor) -> torch.Tensor:
        """fp32 log-probs over the vocabulary of filtered logits (sampling, entropy)."""
        return bik.log_softmax(filtered / self.temperature, dtype=torch.float32)

    def token_logprobs(self, filtered: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 log-prob of each of ``tokens`` under filtered logits: the one formula both
        sides report (``bik.token_logprobs`` agrees bitwise with :meth:`log_probs`)."""
        return bik.token_logprobs(filtered, tokens, self.temperature)


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded to ``bits`` mantissa bits (quantised-like logits); 0 = unchanged."""
    if not bits:
        return x
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2.0**bits) / 2.0**bits, exponent)


def perturb(
    logits: torch.Tensor,
    cfg: RolloutConfig,
    drift: torch.Tensor,
    generator: torch.Generator,
    rows: slice | None = None,
    total: int | None = None,
) -> torch.Tensor:
    """The synthetic rollout-side mismatch sources: fresh noise (``logit_noise_std``), a fixed
    per-token drift (``logit_noise_bias`` x ``drift``: a systematic, biased error) and
    mantissa rounding (``logit_round_bits``). With all three off, ``logits`` in fp32.

    ``logits`` may be the rows ``rows`` of a ``total``-row batch (a data-parallel share): the
    noise is then drawn for the whole batch and sliced, so each row gets the noise it gets
    in the whole batch (torch.randn's values depend on the shape drawn, not only the order)."""
    out = logits.float()
    if cfg.logit_noise_std:
        shape = out.shape if total is None else (total, *out.shape[1:])
        noise = torch.randn(shape, generator=generator)[rows or slice(None)].to(out.device)
        out = out + cfg.logit_noise_std * noise
    if cfg.logit_noise_bias:
        out = out + cfg.logit_noise_bias * drift.to(out.device)
    return round_mantissa(out, cfg.logit_round_bits)
