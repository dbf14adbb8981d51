"""rl_harness sweep: seeds beside zero-mismatch twins, 95 % intervals, resumable."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from rl_helpers import TINY, run_metrics

from rl_harness import config, recipes, rundir, runner, sweep
from rl_harness.__main__ import main


def test_interval_is_students_t_over_the_seeds():
    mean, half = sweep.interval([1.0, 2.0, 3.0])  # sd 1, 2 degrees of freedom: t = 4.303
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    assert math.isnan(sweep.interval([5.0])[1])
    assert sweep.interval([2.0] * 40)[1] == 0.0  # beyond the table: the normal quantile


@pytest.mark.parametrize("recipe", ["kernel_swap", "dtype_swap", "fp8_weights", "noise_biased"])
def test_a_twin_turns_every_mismatch_source_off_and_keeps_the_rest(recipe):
    cfg = config.build(recipes.overrides(recipe), ["train.lr=1e-3", "remedy.name=token_tis"])
    twin = sweep.twin(cfg)
    assert not cfg.zero_mismatch and twin.zero_mismatch
    assert (twin.train.lr, twin.seed) == (1e-3, cfg.seed)
    # token TIS weights every token by exactly 1 without a mismatch: the twin runs no remedy
    assert twin.remedy == dataclasses.replace(cfg.remedy, name="none")


def test_a_twin_keeps_a_remedy_that_drops_tokens_even_without_a_mismatch():
    cfg = config.build(
        recipes.overrides("kernel_swap"), ["remedy.name=token_mis", "remedy.high=0.9"]
    )
    assert sweep.twin(cfg).remedy == cfg.remedy


def test_a_remedy_changes_no_bit_of_a_zero_mismatch_run(tmp_path):
    """Why a twin may drop its remedy: arms that differ by it alone share one twin's runs."""
    cache = tmp_path / "cache"
    plain = run_metrics(tmp_path, cache, "plain", [*TINY, "steps=2"])
    tis = run_metrics(tmp_path, cache, "tis", [*TINY, "steps=2", "remedy.name=token_tis"])
    assert tis == plain


def test_a_zero_mismatch_arm_has_no_twin():
    cfg = config.build({}, [])
    assert list(
        sweep.arms({"zero": cfg, "swap": config.build({}, ["rollout.kernels=native"])})
    ) == [
        "zero",
        "swap",
        "swap__twin",
    ]


def _configs(steps):
    sets = [*TINY, f"steps={steps}"]
    return {"kernel_swap": config.build(recipes.overrides("kernel_swap"), sets)}


def test_a_sweep_runs_arm_and_twin_on_each_seed_and_resumes_a_cut_run(tmp_path, monkeypatch):
    cache, said = tmp_path / "cache", []
    full = sweep.sweep(_configs(2), 2, tmp_path / "full", cache_dir=cache, progress=False)
    assert "| kernel_swap | " in full and "| kernel_swap__twin | " in full
    assert "Paired difference" in full and (tmp_path / "full" / "sweep.png").exists()
    per_seed = {
        tuple(cells[:2]): cells[2:]  # (arm, seed): reward last 5, k3 first 10, k3 last 10, step
        for line in full.split("Per seed")[1].splitlines()
        if len(cells := [c.strip() for c in line.strip("|").split("|")]) == 6
    }
    assert set(per_seed) == {("arm", "seed"), ("---", "---:")} | {
        (arm, str(seed)) for arm in ("kernel_swap", "kernel_swap__twin") for seed in (0, 1)
    }
    assert per_seed["kernel_swap__twin", "1"][1:] == ["0", "0", "none"]
    assert float(per_seed["kernel_swap", "1"][1]) > 0
    twin = runner.read_metrics(tmp_path / "full" / "kernel_swap__twin" / "seed1")
    assert all(m["mismatch/tokens_unequal_count"] == 0 for m in twin)

    original = runner.Run.step

    def crash(self, step):
        if step == 1 and self.cfg.seed == 1:
            raise KeyboardInterrupt
        return original(self, step)

    monkeypatch.setattr(runner.Run, "step", crash)
    with pytest.raises(KeyboardInterrupt):
        sweep.sweep(_configs(2), 2, tmp_path / "cut", cache_dir=cache, progress=False)
    monkeypatch.setattr(runner.Run, "step", original)
    again = sweep.sweep(
        _configs(2), 2, tmp_path / "cut", cache_dir=cache, progress=False, say=said.append
    )
    assert said[:2] == [
        "kernel_swap seed 0: complete, kept",
        "kernel_swap seed 1: resuming at step 1",
    ]
    assert again == full
    for arm in ("kernel_swap", "kernel_swap__twin"):
        for seed in (0, 1):
            run = f"{arm}/seed{seed}"
            assert runner.read_metrics(tmp_path / "cut" / run) == runner.read_metrics(
                tmp_path / "full" / run
            )


def test_a_seed_cut_before_its_last_checkpoint_is_resumed(tmp_path, monkeypatch):
    """Issue 42, item 7: a seed cut between its last metrics line and its last checkpoint was
    kept as complete, with no checkpoint, summary or plot ever written."""
    cache = tmp_path / "cache"
    configs = {"kernel_swap": config.build(recipes.overrides("kernel_swap"), [*TINY, "steps=2"])}
    write = rundir.write_atomic

    def cut_at_the_last_checkpoint(path, data):
        path = Path(path)
        if path.name == rundir.CHECKPOINT and len(rundir.read_metrics(path.parent)) == 2:
            raise KeyboardInterrupt
        write(path, data)

    monkeypatch.setattr(rundir, "write_atomic", cut_at_the_last_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        sweep.sweep(configs, 1, tmp_path / "cut", cache_dir=cache, progress=False)
    monkeypatch.setattr(rundir, "write_atomic", write)
    run_dir = tmp_path / "cut" / "kernel_swap" / "seed0"
    assert len(rundir.read_metrics(run_dir)) == 2 and not (run_dir / rundir.SUMMARY).exists()
    said: list[str] = []
    sweep.sweep(configs, 1, tmp_path / "cut", cache_dir=cache, progress=False, say=said.append)
    assert said[0].startswith("kernel_swap seed 0: resuming at step ")
    assert torch.load(run_dir / rundir.CHECKPOINT, weights_only=True)["step"] == 1
    assert (run_dir / rundir.SUMMARY).exists()
    full = tmp_path / "full"
    sweep.sweep(configs, 1, full, cache_dir=cache, progress=False)
    assert rundir.read_metrics(run_dir) == rundir.read_metrics(full / "kernel_swap" / "seed0")


def test_a_sweep_refuses_a_directory_of_another_config(tmp_path):
    cache = tmp_path / "cache"
    sweep.sweep(_configs(1), 1, tmp_path / "s", cache_dir=cache, progress=False)
    with pytest.raises(sweep.HarnessError, match="holds a run of another config"):
        sweep.sweep(_configs(2), 1, tmp_path / "s", cache_dir=cache, progress=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seeds", "0"], "sweep --seeds: expected an integer >= 1"),
        (["--recipe", "kernel_swap"], "sweep --recipe: each recipe once"),
    ],
)
def test_bad_sweep_arguments_stop_with_one_line(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        main(["sweep", "--recipe", "kernel_swap", *argv, "--out", str(tmp_path / "s")])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def _shadow_run(shadow_k3, entropy, reward):
    """A 30-step run's rows with the shadow meter's k3, the entropy and a training reward."""
    return [
        {
            "step": step,
            "reward/mean": reward(step),
            "mismatch/k3_kl": 0.0,
            "mismatch/tokens_unequal_frac": 0.0,
            "entropy": entropy(step),
            sweep.SHADOW_K3: shadow_k3(step),
            "collapse/reward_drop": int(reward(step) < 0.25),
        }
        for step in range(30)
    ]


def test_the_sweep_report_reads_the_shadow_meter_before_a_collapse_and_at_a_survivors_end(
    tmp_path,
):
    # collapses persistently at step 20 (the reward flag from there on), shadow k3 x4 before
    fell = _shadow_run(
        lambda s: 1e-4 if s < 11 else 4e-4, lambda s: 1.0, lambda s: 0.0 if s >= 20 else 0.5
    )
    survived = _shadow_run(
        lambda s: 2e-4 if s < 10 else 1e-4, lambda s: 2.0 if s < 10 else 0.5, lambda s: 0.5
    )
    text = sweep.sweep_markdown({"shadow": [fell, survived]})
    assert "| shadow | 0 | 20 | 0.0001 | 0.0004 | 4 | 1 | 1 | apart |" in text
    assert "| shadow | 1 | none | 0.0002 | 0.0001 | 0.5 | 2 | 0.5 | apart |" in text
    early = _shadow_run(lambda s: 1e-4, lambda s: 1.0, lambda s: 0.0 if s >= 5 else 0.5)
    assert "| shadow | 0 | 5 |" in sweep.sweep_markdown({"shadow": [early]})
    assert "| 1 | 1 | overlap |" in sweep.sweep_markdown({"shadow": [early]})
    sweep.plot_sweep({"shadow": [fell, survived]}, tmp_path / "sweep.png")  # with its panel
    assert (tmp_path / "sweep.png").stat().st_size > 0
    plain = [{k: v for k, v in row.items() if k != sweep.SHADOW_K3} for row in fell]
    assert "Shadow meter" not in sweep.sweep_markdown({"plain": [plain]})
