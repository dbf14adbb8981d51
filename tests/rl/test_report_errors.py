"""Reports without matplotlib (issue 25, item 18): a finished run, a comparison or a sweep
never fails on its plot; its metrics and tables are written first and a missing plotting
library is a warning. The package declares matplotlib in its ``rl`` extra. Also: unique
comparison labels, and collapse flags read from the metrics."""

import ast
import contextlib
import json
import re
import sys
from pathlib import Path

import pytest
from rl_helpers import TINY as RL_TINY

from rl_harness import config, report, runner
from rl_harness.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
TINY = [*RL_TINY, "steps=1", "warmup.steps=0"]  # no warm-up: the reports are the subject
NO_PLOTS = r"not written \(ModuleNotFoundError: .*matplotlib.*pip install 'bik\[rl\]'"


def _sets(sets):
    return [arg for s in sets for arg in ("--set", s)]


@pytest.fixture
def without_matplotlib(monkeypatch):
    """``import matplotlib`` fails from now on, as where it is not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_run_compare_and_sweep_finish_without_matplotlib(tmp_path, cache, without_matplotlib):
    """After ``pip install -e .`` without the dev extra, ``run`` computed the whole run and
    then died writing metrics.png (exit 1); compare and sweep likewise."""
    out = tmp_path / "run"
    argv = ["run", "--out", str(out), "--cache-dir", str(cache), *_sets(TINY)]
    with pytest.warns(RuntimeWarning, match=f"metrics.png {NO_PLOTS}"):
        assert main(argv) == 0
    assert {p.name for p in out.iterdir()} == {
        "config.json",
        "metrics.jsonl",
        "checkpoint.pt",
        "summary.md",
    }
    assert len(runner.read_metrics(out)) == 1
    with pytest.warns(RuntimeWarning, match=f"compare.png {NO_PLOTS}"):
        assert main(["compare", str(out), "--out", str(tmp_path / "cmp")]) == 0
    assert {p.name for p in (tmp_path / "cmp").iterdir()} == {"compare.md"}
    sweep = ["sweep", "--recipe", "zero_mismatch", "--seeds", "1", "--out", str(tmp_path / "sw")]
    with pytest.warns(RuntimeWarning) as caught:  # the seed's metrics.png, then sweep.png
        assert main([*sweep, "--cache-dir", str(cache), *_sets(TINY)]) == 0
    assert [re.search(f"(metrics|sweep).png {NO_PLOTS}", str(w.message))[1] for w in caught] == [
        "metrics",
        "sweep",
    ]
    assert (tmp_path / "sw" / "sweep.md").exists() and not (tmp_path / "sw" / "sweep.png").exists()


def _setup_keywords() -> dict:
    """The literal keywords of setup.py's ``setup(...)`` call (install_requires,
    extras_require...), read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"
    )
    keywords: dict = {}
    for keyword in call.keywords:
        if isinstance(keyword.value, ast.Dict):  # extras_require: its literal entries
            keywords[keyword.arg] = {}
            for key, value in zip(keyword.value.keys, keyword.value.values):
                with contextlib.suppress(ValueError):  # computed ones (the trl extra's pin)
                    keywords[keyword.arg][ast.literal_eval(key)] = ast.literal_eval(value)
            continue
        with contextlib.suppress(ValueError):  # computed ones (version, ext_modules...)
            keywords[keyword.arg] = ast.literal_eval(keyword.value)
    return keywords


def test_matplotlib_is_declared_in_the_rl_extra():
    """The harness's plots need matplotlib, which only the dev extra listed."""
    keywords = _setup_keywords()
    assert "matplotlib" in keywords["extras_require"]["rl"]
    assert "matplotlib" not in keywords["install_requires"]  # the kernels do not need it


def test_compare_labels_are_unique(tmp_path):
    dirs = [tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "c" / "other"]
    assert report.unique_labels(dirs) == ["a/run", "b/run", "other"]
    assert report.unique_labels([dirs[0], dirs[0]]) == ["run", "run#2"]


def test_summary_and_compare_read_collapse_flags_from_the_metrics():
    row = {
        "reward/mean": 0.5,
        "mismatch/k3_kl": 0.0,
        "mismatch/tokens_unequal_frac": 0.0,
        "mismatch/logprob_abs_diff_max": 0.0,
    }
    history = [dict(row, step=s, **{"collapse/k3_growth": int(s >= 1)}) for s in range(3)]
    history[2]["collapse/reward_drop"] = 1
    summary = report.summarize(history, config.build(), "x")
    assert summary["first_flags"] == {"k3_growth": 1, "reward_drop": 2}
    assert summary["collapse_step"] == 2
    table = report.compare_markdown({"x": history, "empty": []})
    assert "| x | 3 | 0.500 | 0.500 | 0.00e+00 | 0.000 | 2 |" in table
    assert "| empty | 0 |" in table
    assert json.dumps(summary["first_flags"], sort_keys=True) in report.summary_markdown(summary)
    # issue 71, item 5: a 3-step run's reward means cover 3 steps, not "5"
    assert "- reward: first 3 steps 0.500, last 3 steps 0.500" in report.summary_markdown(summary)


def test_compare_shows_ppo_ratio_and_clipping_where_runs_logged_them():
    """Issue 71, item 5: compare.md dropped the PPO-ratio and clip columns the demo is about."""
    row = {
        "reward/mean": 0.5,
        "mismatch/k3_kl": 0.0,
        "mismatch/tokens_unequal_frac": 0.0,
        "mismatch/logprob_abs_diff_max": 0.0,
    }
    ppo = [
        dict(row, step=s, **{"ppo/ratio_min": 0.82, "ppo/ratio_max": 1.18, "ppo/clip_frac": c})
        for s, c in enumerate((0.1, 0.3))
    ]
    table = report.compare_markdown({"native": ppo, "reinforce": [dict(row, step=0)]})
    assert "| PPO ratio min (step 0) | PPO ratio max (step 0) | clipped tokens (mean) |" in table
    assert (
        "| native | 2 | 0.500 | 0.500 | 0.00e+00 | 0.000 | 0.820 | 1.180 | 0.200 | none |" in table
    )
    assert "| reinforce | 1 | 0.500 | 0.500 | 0.00e+00 | 0.000 | - | - | - | none |" in table


def test_a_short_runs_panels_tick_whole_steps():
    """Issue 71, item 5: a 1-step run's x ticks were fractions (-0.045 ... 0.045), colliding."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for steps in (1, 3):
        fig, ax = plt.subplots()
        history = [{"step": s, "reward/mean": 0.5} for s in range(steps)]
        report.plot_panel(ax, {"run": [history]}, "reward/mean", "reward")
        assert list(ax.get_xticks()) == list(range(steps))
        plt.close(fig)
