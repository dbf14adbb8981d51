"""Plug-in tasks that return what the harness cannot train on (issue 25, items 5 and 12): a
reward that is not a finite number, a text outside the character vocabulary; and a gradient
that is not finite, which is never applied."""

import math
import random
import sys
import types

import numpy
import pytest
import torch
from rl_helpers import TINY as RL_TINY

from rl_harness import config, policy, runner, tasks, trainer
from rl_harness.errors import ConfigError
from rl_harness.tasks import Example
from rl_harness.vocab import CHAR

TINY = [*RL_TINY, "steps=1", "warmup.steps=0"]  # no warm-up: the first step shows the fault


class _Faulty:
    """A task whose prompts are ``prompt`` and whose every reward is ``reward``."""

    def __init__(self, reward=1.0, prompt="e:ab=", target="ab"):
        self.reward_value, self.prompt, self.answer = reward, prompt, target

    def sample(self, rng, min_size, max_size):
        return Example(self.prompt, self.answer)

    def reward(self, example, response, finished):
        return self.reward_value

    def target(self, example, long_form):
        return example.answer

    def max_lengths(self, max_size):
        return len(self.prompt), len(self.answer)


@pytest.fixture
def plugin(monkeypatch):
    """``plugin(task)``: the name of a module, importable from now on, whose TASK is ``task``."""

    def install(task):
        module = types.ModuleType("faulty_task")
        module.TASK = task
        monkeypatch.setitem(sys.modules, module.__name__, module)
        return module.__name__

    return install


def test_a_nan_reward_stops_the_run_at_its_first_step(tmp_path, cache, plugin):
    """Item 5: a NaN reward gave NaN advantages, loss and gradient norm, and the run went on
    and exited 0. Now a ConfigError naming task.module stops it before any step is recorded."""
    cfg = config.build({}, [*TINY, f"task.module={plugin(_Faulty(math.nan))}"])
    with pytest.raises(ConfigError, match=r"^task.module='faulty_task': reward\(\) returned nan"):
        runner.run(cfg, tmp_path / "run", cache_dir=cache, progress=False)
    assert runner.read_metrics(tmp_path / "run") == []


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf, "1", None, torch.tensor(1.0)])
def test_a_reward_must_be_a_finite_real_number(reward):
    """Item 5: inf, a string or None as well (a string died inside torch.tensor)."""
    example = Example("e:ab=", "ab")
    with pytest.raises(ConfigError) as error:
        tasks.score(_Faulty(reward), example, [5, 2], CHAR, "task.module='m'")
    assert str(error.value) == (
        f"task.module='m': reward() returned {reward!r} (prompt 'e:ab=', response '2'); "
        "expected a finite real number"
    )
    for number in (True, 0, 0.5, numpy.float32(1.0)):
        assert tasks.score(_Faulty(number), example, [5, 2], CHAR) == float(number)


@pytest.mark.parametrize(("prompt", "target"), [("E:ab=", "ab"), ("e:ab=", "ab!")])
def test_a_character_outside_the_vocabulary_is_a_config_error(plugin, prompt, target):
    """Item 12: a prompt (or warm-up target) with a character outside the harness vocabulary
    died with a raw KeyError."""
    cfg = config.build({}, [*TINY, f"task.module={plugin(_Faulty(1.0, prompt, target))}"])
    bad = "E" if prompt.startswith("E") else "!"
    with pytest.raises(ConfigError, match=f"task.module='faulty_task': the character '{bad}' of"):
        policy.sft_batch(cfg, random.Random(0), 2)  # the warm-up: prompts and targets
    if bad == "E":  # the rollout's prompts
        with pytest.raises(ConfigError, match=r"task.module='faulty_task': the character 'E'"):
            tasks.prompt_batch(cfg, random.Random(0))


def test_a_non_finite_gradient_is_skipped_counted_and_reported(cache, monkeypatch):
    """Item 5: a non-finite gradient is never applied: the update is skipped (weights and
    optimiser state unchanged), counted in ``update_skipped`` and reported by a warning."""
    job = runner.Run(config.build({}, TINY), cache)
    before = {k: v.clone() for k, v in job.master.state_dict().items()}
    policy_loss = trainer.policy_loss

    def poisoned(*args, **kwargs):
        loss, stats = policy_loss(*args, **kwargs)
        return loss * math.nan, stats

    monkeypatch.setattr(trainer, "policy_loss", poisoned)
    with pytest.warns(RuntimeWarning, match="step 0: 1 update.s. skipped, weights unchanged"):
        metrics = job.step(0).metrics
    assert metrics["update_skipped"] == 1 and metrics["update_applied"] == 0
    assert math.isnan(metrics["grad_norm"])
    after = job.master.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not job.learner.optimizer.state  # AdamW never stepped
    monkeypatch.setattr(trainer, "policy_loss", policy_loss)
    metrics = job.step(1).metrics
    assert metrics["update_skipped"] == 0 and metrics["update_applied"] == 1
