"""``python -m rl_harness``: recipes, run, compare, resume, and one-line errors for bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rl_helpers import TINY as RL_TINY
from rl_helpers import tiny_model_dir

from rl_harness import runner
from rl_harness.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results" / "rl"
TINY = [*RL_TINY, "steps=2"]


def _sets(sets):
    return [arg for s in sets for arg in ("--set", s)]


def _cli_run(cache, out, *args, sets=TINY):
    return main(["run", "--out", str(out), "--cache-dir", str(cache), *_sets(sets), *args])


def _error(capsys, argv):
    """Runs ``argv``; asserts a non-zero exit with one line on stderr; returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    assert exit_info.value.code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_cli_recipes_run_and_compare(tmp_path, cache, capsys):
    assert main(["recipes"]) == 0
    assert "zero_mismatch" in capsys.readouterr().out
    for recipe in ("zero_mismatch", "kernel_swap"):
        assert _cli_run(cache, tmp_path / recipe, "--recipe", recipe) == 0
    cmp = tmp_path / "cmp"
    dirs = [str(tmp_path / "zero_mismatch"), str(tmp_path / "kernel_swap")]
    assert main(["compare", *dirs, "--out", str(cmp)]) == 0
    table = (cmp / "compare.md").read_text()
    assert "| zero_mismatch | 2 |" in table and "| kernel_swap | 2 |" in table
    assert (cmp / "compare.png").exists()
    assert "unknown config key 'nope'" in _error(capsys, ["run", "--set", "nope=1"])
    assert "unknown recipe 'nope'" in _error(capsys, ["run", "--recipe", "nope"])


def test_compare_keeps_runs_that_share_a_basename(tmp_path, cache, capsys):
    """Issue 11, item 10: ``compare a/run b/run`` merged the two runs into one row."""
    _cli_run(cache, tmp_path / "a" / "run", sets=TINY + ["steps=1"])
    _cli_run(cache, tmp_path / "b" / "run", sets=TINY + ["steps=2"])
    capsys.readouterr()
    dirs = [str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run")]
    assert main(["compare", *dirs, "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| a/run | 1 |" in table and "| b/run | 2 |" in table


def test_steps_zero_is_refused_not_the_default(tmp_path, capsys):
    """Issue 11, item 10: ``--steps 0`` ran the default 200 steps."""
    err = _error(capsys, ["run", "--out", tmp_path / "r", *_sets(TINY), "--steps", "0"])
    assert "steps: expected an integer >= 1, got 0" in err
    assert not (tmp_path / "r").exists()


def test_negative_grad_clip_is_refused_before_any_work(tmp_path, capsys):
    """Issue 11, item 10: ``train.grad_clip=-1`` flipped the gradient (gradient ascent)."""
    err = _error(capsys, ["run", "--out", tmp_path / "r", *_sets(TINY + ["train.grad_clip=-1"])])
    assert "train.grad_clip: expected a number > 0, got -1.0" in err
    assert not (tmp_path / "r").exists()


def test_resume_honours_steps_and_refuses_set(tmp_path, cache, capsys):
    """Issue 11, item 10: ``--resume DIR --steps N`` and ``--set`` were silently ignored."""
    run = tmp_path / "run"
    _cli_run(cache, run, sets=TINY + ["steps=1"])
    err = _error(capsys, ["run", "--resume", run, "--set", "train.lr=1"])
    assert "--set cannot be combined with --resume" in err and "config.json" in err
    err = _error(capsys, ["run", "--resume", run, "--recipe", "kernel_swap"])
    assert "--recipe cannot be combined with --resume" in err
    cache_args = ["--cache-dir", str(cache)]
    assert main(["run", "--resume", str(run), "--steps", "2", *cache_args]) == 0
    assert [m["step"] for m in runner.read_metrics(run)] == [0, 1]
    assert json.loads((run / "config.json").read_text())["steps"] == 2
    err = _error(capsys, ["run", "--resume", run, "--steps", "1", *cache_args])
    assert "--steps" in err and "already holds 2 checkpointed steps" in err


def test_warmup_cache_follows_new_weights_in_the_same_directory(tmp_path):
    """Issue 11, item 10: the warm-up cache was keyed by the ``model.path`` string."""
    model, cache = tmp_path / "model", tmp_path / "cache"
    sets = TINY + ["warmup.steps=1", "steps=1", f"model.path={model}"]
    tiny_model_dir(model, seed=1)
    _cli_run(cache, tmp_path / "one", sets=sets)
    tiny_model_dir(model, seed=2)
    _cli_run(cache, tmp_path / "two", sets=sets)
    assert len(list(cache.glob("warmup-*.pt"))) == 2


def _user_dir(path, *names):
    path.mkdir(parents=True)
    for name in names:
        (path / name).write_text(f"the user's own {name}\n")
    return path


@pytest.mark.parametrize(
    "names, match",
    [
        (("notes.txt",), "is not empty and is not an rl_harness run"),
        (("config.json",), "already holds a run; pass --resume"),
        (("checkpoint.pt", "summary.md", "metrics.png"), "is not empty"),
    ],
)
def test_out_refuses_a_directory_that_is_not_a_new_run(tmp_path, capsys, names, match):
    """Issue 11, item 12: ``--out DIR`` overwrote the user's files when DIR had no metrics."""
    out = _user_dir(tmp_path / "mine", *names)
    err = _error(capsys, ["run", "--out", out, *_sets(TINY)])
    assert f"--out: {out}" in err and match in err
    for name in names:
        assert (out / name).read_text() == f"the user's own {name}\n"
    assert sorted(p.name for p in out.iterdir()) == sorted(names)


def test_out_refuses_a_finished_run(tmp_path, cache, capsys):
    _cli_run(cache, tmp_path / "once", sets=TINY + ["steps=1"])
    assert "pass --resume" in _error(capsys, ["run", "--out", tmp_path / "once", *_sets(TINY)])


def _fake_run(path, checkpoint=None):
    path.mkdir()
    (path / "config.json").write_text((RESULTS / "zero_mismatch" / "config.json").read_text())
    if checkpoint is not None:
        (path / "checkpoint.pt").write_bytes(checkpoint)
    return path


@pytest.mark.parametrize(
    "argv, match",
    [
        (["run", "--resume", "{tmp}/nonexistent"], "--resume: no run directory at"),
        (["run", "--resume", "{tmp}/file"], "--resume: {tmp}/file is a file"),
        (["run", "--resume", "{tmp}/empty"], "--resume: {tmp}/empty holds no config.json"),
        (["run", "--resume", "{tmp}/garbage"], "--resume: {tmp}/garbage/checkpoint.pt is not a"),
        (["run", "--resume", "{tmp}/zero"], "--resume: {tmp}/zero/checkpoint.pt is not a"),
        (["run", "--resume", "{tmp}/badcfg"], "--resume: {tmp}/badcfg/config.json: not a"),
        (["run", "--out", "{tmp}/file"], "--out: {tmp}/file is a file"),
        (["run", "--out", "{tmp}/file/below"], "--out: cannot create {tmp}/file/below"),
        (["compare", "{tmp}/nonexistent"], "compare: no run directory at {tmp}/nonexistent"),
        (["compare", "{tmp}/empty"], "{tmp}/empty: no metrics.jsonl"),
        (["compare", "{tmp}/torn_middle"], "{tmp}/torn_middle/metrics.jsonl: line 1 is not"),
        # issue 71, item 5: the inputs are checked before --out (an empty run directory got
        # "already holds compare.md" from a table a user left in runs/compare)
        (["compare", "{tmp}/empty", "--out", "{tmp}/file"], "{tmp}/empty: no metrics.jsonl"),
        (["compare", "{shipped}", "--out", "{tmp}/file"], "compare --out: {tmp}/file is a file"),
    ],
)
def test_bad_arguments_give_one_line_errors(tmp_path, capsys, argv, match):
    """Issue 11, item 15: these used to end in tracebacks."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    _fake_run(tmp_path / "garbage", checkpoint=b"\x00not a checkpoint" * 10)
    _fake_run(tmp_path / "zero", checkpoint=b"")
    (_fake_run(tmp_path / "badcfg") / "config.json").write_text('{"steps": ')
    (tmp_path / "torn_middle").mkdir()
    (tmp_path / "torn_middle" / "metrics.jsonl").write_text('{"step": 0\n{"step": 1}\n')
    shipped = RESULTS / "zero_mismatch"
    argv = [a.format(tmp=tmp_path, shipped=shipped) for a in argv]
    assert match.format(tmp=tmp_path) in _error(capsys, argv)


def test_compare_says_where_it_wrote_and_replaces_only_its_default(tmp_path, capsys, monkeypatch):
    """Issue 71, item 5: without --out, compare wrote runs/compare silently and failed on a
    second call; an explicit --out that holds a table is still refused."""
    monkeypatch.chdir(tmp_path)
    shipped = str(RESULTS / "zero_mismatch")
    for _ in range(2):
        assert main(["compare", shipped]) == 0
        out = capsys.readouterr().out
        assert out.rstrip().endswith(f"compare: wrote {tmp_path / 'runs/compare/compare.md'}")
    assert "already holds compare.md" in _error(
        capsys, ["compare", shipped, "--out", "runs/compare"]
    )


def test_errors_reach_the_shell_without_a_traceback(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "rl_harness", "run", "--resume", str(tmp_path / "nonexistent")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr == f"error: --resume: no run directory at {tmp_path / 'nonexistent'}\n"


def test_compare_survives_a_torn_last_line(tmp_path, cache, capsys):
    """Issue 11, item 13: a torn last line in metrics.jsonl made ``compare`` die."""
    run = tmp_path / "run"
    _cli_run(cache, run, sets=TINY + ["steps=1"])
    with (run / "metrics.jsonl").open("a") as log:
        log.write('{"step": 1, "reward/me')
    capsys.readouterr()
    with pytest.warns(UserWarning, match="torn last line"):
        assert main(["compare", str(run), "--out", str(tmp_path / "cmp")]) == 0
    assert "| run | 1 |" in (tmp_path / "cmp" / "compare.md").read_text()


def test_the_demo_table_says_exactly_1_for_bik_and_the_range_for_native():
    from rl_harness import demo

    def row(low, high, unequal, clipped):
        return {
            "reward/mean": 0.25,
            "mismatch/tokens_unequal_frac": unequal,
            "ppo/ratio_min": low,
            "ppo/ratio_max": high,
            "ppo/clip_frac": clipped,
        }

    text = demo.table({"bik": [row(1.0, 1.0, 0.0, 0.0)], "native": [row(0.8, 1.2, 1.0, 0.1)]})
    assert text.splitlines()[-1] == (
        "| 0 | 0.25 / 0.25 | 0 % / 100 % | exactly 1 / 0.800 to 1.200 | 0.0 % / 10.0 % |"
    )


def test_the_warm_up_shows_its_progress_and_says_when_it_is_cached(tmp_path, capsys):
    """Issue 48, item 6: the first run was silent for minutes while the warm-up trained."""
    from rl_harness import config, runner

    cfg = config.build({}, TINY + ["steps=1"])
    runner.run(cfg, tmp_path / "a", cache_dir=tmp_path / "cache", progress=True)
    err = capsys.readouterr().err
    assert "warm-up [10/20] loss " in err and "warm-up [20/20] loss " in err
    runner.run(cfg, tmp_path / "b", cache_dir=tmp_path / "cache", progress=True)
    assert "warm-up: the cached one" in capsys.readouterr().err


def test_the_demo_says_plainly_when_a_run_made_no_update():
    """Issue 48, item 3: a step whose advantages were all 0 showed loss 0 and grad norm 0
    beside the other run's, read as a contrast."""
    from rl_harness import demo

    histories = {
        "smollm2": [{"step": 0, "grad_norm": 0.0}],
        "smollm2_native": [{"step": 0, "grad_norm": 2.6}],
    }
    (line,) = demo.no_update_lines(histories)
    assert line.startswith("note: bik's step 0 made no update: every prompt's samples got")


def test_a_recipe_without_warm_up_caches_nothing(tmp_path):
    """Issue 48, item 3: make demo left a 514 MB warm-up cache for a recipe with no warm-up."""
    from rl_harness import config, policy

    cfg = config.build({}, TINY + ["warmup.steps=0"])
    master = policy.build_master(cfg.model, 0)
    assert policy.warmup(master, cfg, tmp_path / "cache") is None
    assert not (tmp_path / "cache").exists()
