"""Held-out greedy evaluation of the trained policy (config section ``eval``).

Every ``eval.every`` steps (0: never) and at the run's last step (the config's ``steps``),
after that step's update (and, with ``eval.at_start``, at step 0 before its update: the
warm-up's policy, in step 0's row unless step 0 evaluates after its update too), the
trainer's working copy (refreshed from the master) decodes a
fixed held-out prompt set greedily (rollout.sample with ``greedy=True``: the argmax of the
policy's own logits, in the copy's dtype; train.autocast and the rollout's synthetic
perturbations do not apply). That step's metrics row, and no other, gains:

- ``eval/accuracy``: the mean task reward of the greedy responses (the runner's task and
  reward; for the exact-match tasks, the share answered exactly);
- ``eval/response_length``: their mean length in tokens (EOS included);
- ``collapse/eval_drop``: the collapse flag on the accuracy (rl_harness.collapse).

The held-out set is ``eval.prompts`` prompts drawn once by the runner's own prompt function
(tasks.prompt_batch) from a stream of their own, ``random.Random("heldout")``: independent of
the run seed (every seed of a sweep evaluates the same set) and never the training prompts'
stream. They are not excluded from training, though: a small task space (few digits) can hold
some of them among the training prompts by chance.

Evaluation leaves training as it was, bit for bit: it draws no random number, and it changes
only the trainer copy's weights, to the master's, which every step refreshes first anyway.
Its flag's state (the accuracy's peak) is checkpointed with the collapse detector, so a
resumed run evaluates as an uninterrupted one; a run resumed with a larger ``steps`` keeps the
evaluation of its old last step, which the longer run alone would not have made.
Under data parallelism rank 0 alone evaluates (rank 0 alone writes the metrics; the other
ranks wait for it in the next step's first collective).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import torch

from . import policy, rollout, tasks, vocab

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .collapse import Detector
    from .config import Config

STREAM = "heldout"  # the held-out prompts' random stream, the same for every run seed


def due(cfg: Config, step: int) -> bool:
    """Whether ``step`` evaluates: every eval.every steps and the last one (eval.every > 0)."""
    every = cfg.eval.every
    return bool(every) and ((step + 1) % every == 0 or step + 1 == cfg.steps)


class Heldout:
    """The held-out prompt set of ``cfg``: each prompt once (token ids of the run's vocabulary)
    and its task example; the task and vocabulary that score the responses."""

    def __init__(self, cfg: Config) -> None:
        self.task, self.vocab = tasks.of(cfg.task), vocab.of(cfg.model)
        self.rollout = cfg.rollout
        self.where = tasks.source(cfg.task)
        # Batches of the runner's rollout.prompts prompts, drawn one after the other from one
        # stream, until eval.prompts: the set does not depend on the rollout's batch shape.
        rng, repeats = random.Random(STREAM), cfg.rollout.samples_per_prompt
        self.prompts: list[list[int]] = []
        self.examples: list[tasks.Example] = []
        while len(self.prompts) < cfg.eval.prompts:
            rows, examples = tasks.prompt_batch(cfg, rng)
            self.prompts += rows[::repeats]  # the runner repeats each prompt this often
            self.examples += examples[::repeats]
        del self.prompts[cfg.eval.prompts :], self.examples[cfg.eval.prompts :]

    def evaluate(
        self,
        model: PreTrainedModel,
        master: torch.nn.Module,
        drift: torch.Tensor,
        detector: Detector,
    ) -> dict[str, Any]:
        """The evaluation metrics of the policy ``master`` now, decoded by its working copy
        ``model`` (refreshed from it; ``drift``: the rollout's, unused by greedy decoding),
        with the collapse flag from ``detector``."""
        policy.refresh(model, master)
        batch = rollout.sample(
            model,
            self.prompts,
            self.rollout,
            drift,
            torch.Generator(),  # never drawn from: greedy
            greedy=True,
        )
        responses = batch.sequences[:, batch.prompt_width :].tolist()
        rewards = [
            tasks.score(self.task, e, r, self.vocab, self.where)
            for e, r in zip(self.examples, responses)
        ]
        accuracy = sum(rewards) / len(rewards)
        metrics: dict[str, Any] = {
            "eval/accuracy": accuracy,
            "eval/response_length": float(batch.response_mask.sum(-1).float().mean()),
        }
        for flag, raised in detector.update_eval(accuracy).items():
            metrics[f"collapse/{flag}"] = int(raised)
        return metrics
