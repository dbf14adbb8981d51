"""Shared settings and runs of the rl_harness tests: a tiny policy and task that run in seconds."""

import functools

import pytest
import torch

from rl_harness import config, runner
from rl_harness.batch import Batch

TINY = [
    "model.hidden_size=32",
    "model.head_dim=8",
    "warmup.steps=20",
    "rollout.prompts=4",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=6",
    "checkpoint_every=2",
]


def updates_of_each_step(monkeypatch):
    """A list that gains each step's per-update stats (the list Learner.update summarises) as
    the steps run."""
    from rl_harness import trainer

    seen = []
    summarise = trainer._summarise

    def spy(updates):
        seen.append(list(updates))
        return summarise(updates)

    monkeypatch.setattr(trainer, "_summarise", spy)
    return seen


def run_metrics(tmp_path, cache, name, sets):
    """The metrics of a run of the defaults + ``sets`` into ``tmp_path / name``."""
    cfg = config.build({}, list(sets))
    runner.run(cfg, tmp_path / name, cache_dir=cache, progress=False, name=name)
    return runner.read_metrics(tmp_path / name)


def cut_and_resume(start, run_dir, cache, monkeypatch, at):
    """Start a run into ``run_dir`` with ``start()``, cut it by an interrupt at step ``at``,
    resume it; returns its metrics."""
    original = runner.Run.step

    def crash(self, step):
        if step == at:
            raise KeyboardInterrupt
        return original(self, step)

    monkeypatch.setattr(runner.Run, "step", crash)
    with pytest.raises(KeyboardInterrupt):
        start()
    monkeypatch.setattr(runner.Run, "step", original)
    assert [m["step"] for m in runner.read_metrics(run_dir)] == list(range(at))
    runner.resume(run_dir, cache_dir=cache, progress=False)
    return runner.read_metrics(run_dir)


def resumed_equals_uninterrupted(tmp_path, cache, monkeypatch, sets):
    """A run of ``sets`` cut at step 3 and resumed gives the uninterrupted run's metrics;
    returns them."""
    full = run_metrics(tmp_path, cache, "full", sets)
    start = functools.partial(run_metrics, tmp_path, cache, "cut", sets)
    assert cut_and_resume(start, tmp_path / "cut", cache, monkeypatch, at=3) == full
    return full


def tiny_model_dir(path, seed=0):
    """A random-init tiny Qwen3 (vocabulary 48, 2 layers) saved to ``path``; returns it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def loss_batch(response_mask, train_logp, rollout_logp=None, **optional):
    """A :class:`~rl_harness.batch.Batch` for losses.policy_loss, which reads only the
    response mask and the log-probs (and the ``optional`` fields given): zero tokens, full
    attention and zero entropy stand in for the rest. ``rollout_logp`` defaults to
    ``train_logp`` (zero mismatch)."""
    zeros = torch.zeros(response_mask.shape, dtype=torch.long)
    return Batch(
        sequences=zeros,
        attention_mask=torch.ones_like(zeros),
        response_mask=response_mask,
        rollout_logp=train_logp if rollout_logp is None else rollout_logp,
        train_logp=train_logp,
        entropy=torch.zeros_like(train_logp),
        **optional,
    )
