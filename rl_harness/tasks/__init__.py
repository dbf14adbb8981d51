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
rl_harness.tasks.growable), and chat_addition for a pretrained chat model
(rl_harness.tasks.chat: a question in words, the answer's last number checked). A plug-in:
``task.module=pkg.mod`` imports ``pkg.mod`` and uses its ``TASK`` object in place of
``task.name`` (the warm-up cache keys on the module's name, not its code). :func:`of` gives
a run's task.

Texts are encoded and decoded by the run's vocabulary (rl_harness.vocab): the shipped tasks
but chat_addition use the characters of rl_harness.vocab.CHARS only, which the character
vocabulary covers.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..vocab import CHAR, OutOfVocabulary, Vocab
from ..vocab import of as vocab_of
from .base import Example, Task, final_answer
from .chat import CHAT_ADDITION
from .direct import ADDITION, COUNTING, SORTING
from .growable import ITERATE, SCRATCH_ADDITION

if TYPE_CHECKING:
    from ..config import Config, TaskConfig

__all__ = [
    "TASKS",
    "Example",
    "Task",
    "final_answer",
    "load",
    "of",
    "prompt_batch",
    "score",
    "source",
    "texts_of",
]

TASKS: dict[str, Task] = {
    "addition": ADDITION,
    "sorting": SORTING,
    "counting": COUNTING,
    "scratch_addition": SCRATCH_ADDITION,
    "iterate": ITERATE,
    "chat_addition": CHAT_ADDITION,
}


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


def source(task_cfg: TaskConfig) -> str:
    """The config key that chose the task, for messages: ``task.module='pkg.mod'`` or
    ``task.name='addition'``."""
    if task_cfg.module:
        return f"task.module={task_cfg.module!r}"
    return f"task.name={task_cfg.name!r}"


@contextlib.contextmanager
def texts_of(task_cfg: TaskConfig) -> Iterator[None]:
    """Encoding the task's texts: a character outside the character vocabulary is a
    ConfigError naming the task (``task.module``) and the character."""
    try:
        yield
    except OutOfVocabulary as error:
        raise ConfigError(
            f"{source(task_cfg)}: {error}; a task's prompts and targets use these characters "
            "only (or a model.path whose tokenizer encodes them)"
        ) from None


def prompt_batch(cfg: Config, rng: random.Random) -> tuple[list[list[int]], list[Example]]:
    """A batch of ``cfg``'s prompts drawn from ``rng`` (token ids of the run's vocabulary),
    each repeated rollout.samples_per_prompt times, and the example of each row."""
    task, words = of(cfg.task), vocab_of(cfg.model)
    rows, examples = [], []
    with texts_of(cfg.task):
        for _ in range(cfg.rollout.prompts):
            example = task.sample(rng, cfg.task.min_digits, cfg.task.max_digits)
            for _ in range(cfg.rollout.samples_per_prompt):
                rows.append(words.prompt(example.prompt))
                examples.append(example)
    return rows, examples


def score(
    task: Task,
    example: Example,
    response_ids: list[int],
    vocab: Vocab = CHAR,
    where: str = "the task",
) -> float:
    """``task``'s reward of a sampled response (token ids, PAD after EOS) decoded by the
    run's ``vocab`` (rl_harness.vocab.of). A reward that is not a finite real number would
    turn the advantages and the gradient into NaN: it is a ConfigError naming ``where``
    (:func:`source`)."""
    response = vocab.decode(response_ids)
    reward = task.reward(example, response, vocab.eos in response_ids)
    if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise ConfigError(
            f"{where}: reward() returned {reward!r} (prompt {example.prompt!r}, response "
            f"{response!r}); expected a finite real number"
        )
    return float(reward)
