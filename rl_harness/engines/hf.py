"""The ``hf`` rollout engine: transformers' KV-cache sampling on the rollout working copy."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import policy, rollout
from ..batch import Rollout

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import Config
    from ..distributed import World


class HfRollout:
    """Transformers' KV-cache sampling (rollout.sample) on the rollout working copy of the
    master (policy.working_copy: the rollout's kernels, dtype and split size), refreshed
    from the master (with rollout.weight_round_bits) before each step samples. ``model_dir``
    is unused: it has nothing to save."""

    @staticmethod
    def check(cfg: Config, world: World, master: PreTrainedModel | None = None) -> None:
        """It runs wherever the trainer does, speculating where the policy allows it
        (rollout.check_speculative)."""
        rollout.check_speculative(cfg.rollout, master)

    def __init__(
        self,
        master: PreTrainedModel,
        cfg: Config,
        drift: torch.Tensor,
        model_dir: str | Path | None = None,
    ) -> None:
        self.master, self.cfg, self.drift = master, cfg, drift
        r = cfg.rollout
        self.model = policy.working_copy(
            master, cfg.precision.rollout_dtype, r.kernels, r.split_size
        )

    def sample(self, prompts: list[list[int]], seed: int, rows: slice) -> Rollout:
        policy.refresh(self.model, self.master, self.cfg.rollout.weight_round_bits)
        generator = torch.Generator().manual_seed(seed)
        return rollout.sample(self.model, prompts, self.cfg.rollout, self.drift, generator, rows)

    def update(self, master: torch.nn.Module) -> None:
        """Nothing: :meth:`sample` refreshes the copy from the master it holds."""

    def close(self) -> None:
        """Nothing to release."""
