"""The rollout engines: one interface, two implementations, chosen by ``rollout.engine``.

An engine samples each step's responses from the policy and keeps its own copy of the
policy's weights:

  check(cfg, world, master=None)   refuse, before any work, what it cannot run (``master``:
                                   the policy once built, for refusals that need its shape)
  Engine(master, cfg, drift, model_dir)
  sample(prompts, seed, rows)      the rows ``rows`` of the step's batch (rollout.Rollout)
  update(master)                   after every optimiser step: take the new weights
  close()                          release what it holds

``hf`` (:class:`HfRollout`) samples with transformers on the rollout working copy;
``vllm`` (:class:`~rl_harness.vllm_rollout.VllmRollout`) with an in-process vLLM engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from . import policy, rollout
from .batch import Rollout
from .config import Config
from .distributed import World
from .vllm_rollout import VllmRollout

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Engine(Protocol):
    """What the runner asks of a rollout engine (module doc)."""

    def sample(self, prompts: list[list[int]], seed: int, rows: slice) -> Rollout: ...

    def update(self, master: torch.nn.Module) -> None: ...

    def close(self) -> None: ...


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


ENGINES: dict[str, type[HfRollout] | type[VllmRollout]] = {"hf": HfRollout, "vllm": VllmRollout}
