"""The records a step's rows travel in: rollout -> runner -> trainer.

Shapes: ``B`` rows (a data-parallel rank's share, or the whole batch), ``L`` columns (the
left-padded prompt, ``prompt_width`` wide, then the response, PAD after EOS; every rank's
share is right-padded to the batch's longest response). Per-position tensors put a token's
value at the token's own column (its log-prob is that of predicting it from the columns
before), 0 off the response.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class Tokens:
    """What a trainer forward reads (rl_harness.losses.token_logprobs_and_entropy)."""

    sequences: torch.Tensor  # [B, L] long: prompt (left-padded with PAD), response, PAD
    attention_mask: torch.Tensor  # [B, L] long: 0 on the prompt's left padding, else 1
    response_mask: torch.Tensor  # [B, L] long: 1 on response tokens up to and including EOS

    def take(self, rows: slice) -> Tokens:
        """The rows ``rows`` of the three tensors."""
        return Tokens(self.sequences[rows], self.attention_mask[rows], self.response_mask[rows])


@dataclass
class Speculation:
    """A sample's speculative decoding: draft positions scored, drafts that stood, and model
    forwards (the hf sampler counts per step of the whole batch, whose rows draw in
    lockstep; the vLLM engine counts its own steps, from its stats)."""

    proposed: int = 0
    accepted: int = 0
    forwards: int = 0


@dataclass
class Rollout(Tokens):
    """A sampler's rows (rl_harness.rollout.sample, rl_harness.engines.vllm)."""

    rollout_logp: torch.Tensor  # [B, L] fp32: the sampler's log-prob of each response token
    prompt_width: int  # the column of the first response token
    pad_id: int  # the PAD id of the padding
    # [B, L, layers, k] long, mixture-of-experts models only: the top-k experts each position
    # was routed to (rl_harness.routing; the last position, never fed back, is UNROUTED)
    routing: torch.Tensor | None = None
    speculation: Speculation | None = None  # rollout.speculative: the sample's counts


@dataclass
class Batch(Tokens):
    """The step's whole batch (every rank's rows, gathered: rl_harness.distributed) with what
    the trainer computed for it; identical on every rank."""

    rollout_logp: torch.Tensor  # [B, L] fp32: the sampler's log-probs (Rollout.rollout_logp)
    train_logp: torch.Tensor  # [B, L] fp32: pi_old, the trainer's before any update, detached
    entropy: torch.Tensor  # [B, L] fp32: the trainer's policy entropy per position, detached
    rollout_routing: torch.Tensor | None = None  # [B, L, layers, k]: Rollout.routing (MoE)
    train_routing: torch.Tensor | None = None  # [B, L, layers, k]: the trainer forward's (MoE)
    kept: torch.Tensor | None = None  # [B] fp32: 1 for the rows train.filter_groups keeps
    ref_logp: torch.Tensor | None = None  # [B, L] fp32: the reference's (train.kl_coef > 0)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors set, by field name, in field order (what the ranks gather)."""
        fields = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return {name: value for name, value in fields if value is not None}
