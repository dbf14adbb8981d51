"""The audit of a bypass-mode run: pi_old recomputed every Nth step and compared bit for bit.

With ``algorithm.rollout_correction.bypass_mode=true`` verl takes the rollout's log-probs as
pi_old and skips the trainer's old-log-prob forward: exact only if the two pipelines agree
bit for bit, which bik makes them do. ``BIK_VERL_AUDIT_EVERY=N`` runs the skipped forward on
every Nth step anyway (verl's own decoupled path, which also logs its
``training/rollout_probs_diff_*`` metrics), keeps its result as pi_old, and raises
:class:`MismatchError` at the first token whose log-prob differs from the rollout's.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import open_dict
from verl.trainer.ppo.v1 import trainer_base

from .settings import audit_every


class MismatchError(RuntimeError):
    """The rollout's log-probs differ from the trainer's recomputation."""


def differing_tokens(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
) -> tuple[int, float]:
    """How many response tokens' log-probs differ (bitwise), and the largest difference."""
    keep = mask.bool()
    differ = (old != rollout) & keep
    largest = (old - rollout).abs()[keep].max() if keep.any() else torch.tensor(0.0)
    return int(differ.sum()), float(largest)


def _audited(compute_old_log_prob: Any) -> Any:
    def compute(self: Any, batch: Any, metrics: dict) -> Any:
        every = audit_every()
        correction = self.config.algorithm.get("rollout_correction", None)
        bypass = bool(correction and correction.get("bypass_mode", False))
        if not (bypass and every and self.global_steps % every == 0):
            return compute_old_log_prob(self, batch, metrics)
        with open_dict(correction):
            correction.bypass_mode = False
            try:
                batch = compute_old_log_prob(self, batch, metrics)
            finally:
                correction.bypass_mode = True
        fields = ["old_log_probs", "rollout_log_probs", "response_mask"]
        data = trainer_base.tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=fields
        )
        data = data.to_padded_tensor()  # each [batch, response], aligned token for token
        count, largest = differing_tokens(
            data["old_log_probs"], data["rollout_log_probs"], data["response_mask"]
        )
        metrics["audit/differing_tokens"] = count
        if count:
            raise MismatchError(
                f"step {self.global_steps}: {count} response tokens' rollout log-probs differ from "
                f"the trainer's (largest {largest:.3g}); bypass mode is not exact here"
            )
        return batch

    return compute


def install() -> None:
    cls = trainer_base.PPOTrainer
    cls._compute_old_log_prob = _audited(cls._compute_old_log_prob)
