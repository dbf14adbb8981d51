"""Synthetic, verifiable tasks, shipped or plugged in, and the character vocabulary.

A task is any object with the four methods of :class:`Task` (a protocol: no base class
needed):

- ``sample(rng, min_size, max_size) -> Example``: a problem whose size lies in the range
  (task.min_digits / task.max_digits), drawn from ``rng`` alone. An :class:`Example` holds
  the prompt text, the answer text and the long-form target (a scratchpad, ``':'``, the
  answer) or None.
- ``reward(example, response, finished) -> float``: the reward of a decoded response (the
  text up to EOS); ``finished``: the response ended with EOS.
- ``target(example, long_form) -> str``: the warm-up target (EOS is appended), the long form
  when asked and the task has one (warmup.long_form_share sets how often it is asked).
- ``max_lengths(max_size) -> (prompt, target)``: bounds, in characters, on a prompt and a
  warm-up target, so a config whose sequences cannot fit the policy is refused up front.

Shipped tasks (``task.name``): addition, sorting, counting (answered directly, exact-match
reward; rl_harness.tasks.direct) and scratch_addition, iterate (a short and a long form;
rl_harness.tasks.growable). A plug-in: ``task.module=pkg.mod`` imports ``pkg.mod`` and uses
its ``TASK`` object in place of ``task.name`` (the warm-up cache keys on the module's name,
not its code). :func:`of` gives a run's task.

Texts use the character vocabulary :data:`CHARS` (ids from 3; 0, 1, 2 are PAD, BOS, EOS).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .base import Example, Task, final_answer
from .direct import ADDITION, COUNTING, SORTING
from .growable import ITERATE, SCRATCH_ADDITION

if TYPE_CHECKING:
    from ..config import TaskConfig

__all__ = ["CHARS", "TASKS", "Example", "Task", "decode", "encode", "final_answer", "load", "of"]

PAD, BOS, EOS = 0, 1, 2
CHARS = "0123456789+=,:abcdefghijklmnopqrstuvwxyz"
VOCAB_SIZE = 3 + len(CHARS)
_IDS = {c: i + 3 for i, c in enumerate(CHARS)}

TASKS: dict[str, Task] = {
    "addition": ADDITION,
    "sorting": SORTING,
    "counting": COUNTING,
    "scratch_addition": SCRATCH_ADDITION,
    "iterate": ITERATE,
}


def encode(text: str) -> list[int]:
    return [_IDS[c] for c in text]


def decode(ids: list[int]) -> str:
    """Text of ``ids`` up to the first EOS (special tokens dropped; an id beyond the
    vocabulary, which a loaded model.path may sample, becomes U+FFFD, no task's character)."""
    out = []
    for i in ids:
        if i == EOS:
            break
        if i >= 3:
            out.append(CHARS[i - 3] if i < VOCAB_SIZE else "\ufffd")
    return "".join(out)


def load(module: str) -> Task:
    """The ``TASK`` of the plug-in module ``module``; ConfigError naming task.module when it
    cannot be imported or its TASK is not a :class:`Task`."""
    try:
        loaded = importlib.import_module(module)
    except Exception as error:  # any failure of the user's module is a config error
        raise ConfigError(f"task.module: cannot import {module!r} ({error})") from None
    task = getattr(loaded, "TASK", None)
    if not isinstance(task, Task):
        raise ConfigError(
            f"task.module: expected {module!r} to define TASK, an object with the methods of "
            f"rl_harness.tasks.Task (sample, reward, target, max_lengths), got {task!r}"
        )
    return task


def of(task_cfg: TaskConfig) -> Task:
    """The run's task: the plug-in ``task.module``, else the shipped ``task.name``."""
    return load(task_cfg.module) if task_cfg.module else TASKS[task_cfg.name]


def score(task: Task, example: Example, response_ids: list[int]) -> float:
    """``task``'s reward of a sampled response (token ids, PAD after EOS)."""
    return task.reward(example, decode(response_ids), EOS in response_ids)
