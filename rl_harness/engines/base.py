"""What the runner asks of a rollout engine (rl_harness.engines: the registry)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from ..batch import Rollout

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import Config
    from ..distributed import World


class Engine(Protocol):
    """A rollout engine: it samples each step's responses from the policy and keeps its own
    copy of the policy's weights."""

    @staticmethod
    def check(cfg: Config, world: World, master: PreTrainedModel | None = None) -> None:
        """Refuse, before any work, what the engine cannot run: called once before the policy
        is built (``master`` None) and once after (``master``: the warmed-up or restored
        policy, for refusals that need its shape)."""
        ...

    def __init__(
        self,
        master: PreTrainedModel,
        cfg: Config,
        drift: torch.Tensor,
        model_dir: str | Path | None = None,
    ) -> None:
        """An engine serving ``master``'s weights; ``drift``: the rollout's fixed logit
        direction (rollout.logit_noise_bias), ``model_dir``: where an engine that loads the
        policy from files writes it (None: a temporary directory)."""
        ...

    def sample(self, prompts: list[list[int]], seed: int, rows: slice) -> Rollout:
        """The rows ``rows`` of the step's batch of ``prompts``, drawn from ``seed``."""
        ...

    def update(self, master: torch.nn.Module) -> None:
        """Take the master's new weights (after every optimiser step)."""
        ...

    def close(self) -> None:
        """Release what the engine holds."""
        ...
