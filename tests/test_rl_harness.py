"""rl_harness end to end on tiny configs: zero mismatch, every source, determinism, resume, CLI."""

import json

import pytest

from rl_harness import config, runner
from rl_harness.__main__ import main

TINY = [
    "model.hidden_size=32",
    "model.head_dim=8",
    "warmup.steps=20",
    "rollout.prompts=4",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=6",
    "steps=3",
    "checkpoint_every=2",
]


def _run(tmp_path, name, sets=(), **kwargs):
    cfg = config.build({}, TINY + list(sets))
    runner.run(
        cfg, tmp_path / name, cache_dir=tmp_path / "cache", progress=False, name=name, **kwargs
    )
    return runner.read_metrics(tmp_path / name)


def test_zero_mismatch_holds_with_top_k_top_p_and_temperature(tmp_path):
    history = _run(
        tmp_path,
        "filtered",
        ["rollout.top_k=8", "rollout.top_p=0.9", "rollout.temperature=0.7", "steps=2"],
    )
    assert all(m["mismatch/tokens_unequal_count"] == 0 for m in history)


def test_zero_mismatch_is_exactly_zero_every_step(tmp_path):
    history = _run(tmp_path, "zero")
    assert [m["step"] for m in history] == [0, 1, 2]
    for m in history:
        assert m["mismatch/tokens_unequal_frac"] == 0.0 and m["mismatch/k3_kl"] == 0.0
        assert m["mismatch/logprob_abs_diff_max"] == 0.0 and m["mismatch/chi2_seq"] == 0.0
    for key in (
        "reward/mean",
        "response_length/mean",
        "grad_norm",
        "entropy",
        "lr",
        "mismatch/is_ess",
        "remedy/masked_frac",
        "ppo/clip_frac",
        "collapse/reward_drop",
    ):
        assert key in history[0]
    assert (tmp_path / "zero" / "summary.md").exists() and (
        tmp_path / "zero" / "metrics.png"
    ).exists()
    assert json.loads((tmp_path / "zero" / "config.json").read_text())["steps"] == 3


@pytest.mark.parametrize(
    "source",
    [
        ["rollout.kernels=native"],
        ["rollout.dtype=bfloat16"],
        [
            "task.name=sorting",
            "task.max_digits=4",
            "rollout.max_new_tokens=24",
            "rollout.split_size=32",
        ],
        [
            "rollout.kernels=native",
            "train.kernels=native",
            "train.micro_batch_size=3",
            "rollout.prompts=8",
        ],
        ["rollout.logit_noise_std=0.1"],
        ["rollout.logit_noise_bias=0.5"],
        ["rollout.logit_round_bits=7"],
    ],
)
def test_each_mismatch_source_gives_nonzero_mismatch(tmp_path, source):
    history = _run(tmp_path, "source", source + ["steps=1"])
    assert history[0]["mismatch/tokens_unequal_frac"] > 0
    assert history[0]["mismatch/logprob_abs_diff_max"] > 0


def test_same_seed_gives_identical_metrics(tmp_path):
    assert _run(tmp_path, "a", ["rollout.logit_noise_std=0.1"]) == _run(
        tmp_path, "b", ["rollout.logit_noise_std=0.1"]
    )


def test_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    sets = ["steps=5", "rollout.logit_noise_bias=0.3", "lr_schedule.name=length_surge"]
    full = _run(tmp_path, "full", sets)
    original = runner.Run.step

    def crash_at_3(self, step):
        if step == 3:
            raise KeyboardInterrupt
        return original(self, step)

    monkeypatch.setattr(runner.Run, "step", crash_at_3)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "cut", sets)
    monkeypatch.setattr(runner.Run, "step", original)
    assert [m["step"] for m in runner.read_metrics(tmp_path / "cut")] == [0, 1, 2]
    runner.run(None, tmp_path / "cut", resume=True, cache_dir=tmp_path / "cache", progress=False)
    assert runner.read_metrics(tmp_path / "cut") == full


def test_existing_run_directory_needs_resume(tmp_path):
    _run(tmp_path, "once", ["steps=1"])
    with pytest.raises(FileExistsError, match="--resume"):
        _run(tmp_path, "once", ["steps=1"])


def test_cli_recipes_run_and_compare(tmp_path, capsys):
    assert main(["recipes"]) == 0
    assert "zero_mismatch" in capsys.readouterr().out
    cache = str(tmp_path / "cache")
    for recipe in ("zero_mismatch", "kernel_swap"):
        args = ["run", "--recipe", recipe, "--out", str(tmp_path / recipe), "--cache-dir", cache]
        assert main(args + [arg for s in TINY for arg in ("--set", s)]) == 0
    assert (
        main(
            [
                "compare",
                str(tmp_path / "zero_mismatch"),
                str(tmp_path / "kernel_swap"),
                "--out",
                str(tmp_path / "cmp"),
            ]
        )
        == 0
    )
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| zero_mismatch | 3 |" in table and (tmp_path / "cmp" / "compare.png").exists()
    with pytest.raises(SystemExit, match="unknown config key"):
        main(["run", "--set", "nope=1", "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit, match="unknown recipe"):
        main(["run", "--recipe", "nope", "--out", str(tmp_path / "bad")])
