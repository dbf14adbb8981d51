"""Shared settings and runs of the rl_harness tests: a tiny policy and task that run in seconds."""

import pytest

from rl_harness import config, runner

TINY = [
    "model.hidden_size=32",
    "model.head_dim=8",
    "warmup.steps=20",
    "rollout.prompts=4",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=6",
    "checkpoint_every=2",
]


def run_metrics(tmp_path, cache, name, sets):
    """The metrics of a run of the defaults + ``sets`` into ``tmp_path / name``."""
    cfg = config.build({}, list(sets))
    runner.run(cfg, tmp_path / name, cache_dir=cache, progress=False, name=name)
    return runner.read_metrics(tmp_path / name)


def resumed_equals_uninterrupted(tmp_path, cache, monkeypatch, sets):
    """A run of ``sets`` cut at step 3 and resumed gives the uninterrupted run's metrics;
    returns them."""
    full = run_metrics(tmp_path, cache, "full", sets)
    original = runner.Run.step

    def crash_at_3(self, step):
        if step == 3:
            raise KeyboardInterrupt
        return original(self, step)

    monkeypatch.setattr(runner.Run, "step", crash_at_3)
    with pytest.raises(KeyboardInterrupt):
        run_metrics(tmp_path, cache, "cut", sets)
    monkeypatch.setattr(runner.Run, "step", original)
    assert [m["step"] for m in runner.read_metrics(tmp_path / "cut")] == [0, 1, 2]
    runner.resume(tmp_path / "cut", cache_dir=cache, progress=False)
    assert runner.read_metrics(tmp_path / "cut") == full
    return full
