"""The harness on the real model (recipe smollm2), its chat task, the demo's
table and the plots' readability rules."""

import random

import pytest

from rl_harness import config, demo, report, runner, tasks
from rl_harness.errors import ConfigError


def test_chat_addition_rewards_the_last_number_of_the_answer():
    task = tasks.TASKS["chat_addition"]
    example = task.sample(random.Random(0), 1, 1)
    a, b = (int(t) for t in example.prompt.split("What is ")[1].split("?")[0].split(" + "))
    assert example.answer == str(a + b)
    assert task.reward(example, f"{a} + {b} = {a + b}.", True) == 1.0
    assert task.reward(example, f"{a + b}", False) == 1.0
    assert task.reward(example, f"{a + b} is wrong, it is {a + b + 1}", True) == 0.0
    assert task.reward(example, "I do not know", True) == 0.0


def test_chat_addition_needs_a_tokenizer_and_chat_template_a_model():
    with pytest.raises(ConfigError, match=r"task\.name=chat_addition: .* model\.path"):
        config.build({}, ["task.name=chat_addition"])
    with pytest.raises(ConfigError, match=r"model\.chat_template: expected a model\.path"):
        config.build({}, ["model.chat_template=true"])


def test_the_demo_table_shows_each_run_side_by_side():
    row = {
        "reward/mean": 0.5,
        "mismatch/tokens_unequal_frac": 0.0,
        "ppo/ratio_min": 1.0,
        "ppo/ratio_max": 1.0,
        "ppo/clip_frac": 0.0,
    }
    moved = {**row, "mismatch/tokens_unequal_frac": 0.75, "ppo/ratio_min": 0.87}
    moved["ppo/clip_frac"] = 0.0625
    text = demo.table({"smollm2": [row], "smollm2_native": [moved]})
    assert "| 0 | 0.50 / 0.50 | 0 % / 75 % | exactly 1 / 0.870 to 1.000 | 0.0 % / 6.2 % |" in text


def test_a_flat_panel_gets_a_range_and_ticks_are_plain_numbers(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    tiny = [{"step": s, "k": 1.14659e-12 + s * 1e-16} for s in range(3)]
    flat = [{"step": s, "k": 0.0} for s in range(3)]
    report.plot_panel(ax, {"tiny": [tiny], "flat": [flat]}, "k", "k")
    fig.canvas.draw()
    assert ax.yaxis.get_offset_text().get_text() == ""  # no "1e-12" apart from the ticks
    lines = ax.get_lines()
    assert lines[0].get_linestyle() != lines[1].get_linestyle()
    assert lines[0].get_marker() != lines[1].get_marker()
    _, ax2 = plt.subplots()
    report.plot_panel(ax2, {"flat": [flat]}, "k", "k")
    low, high = ax2.get_ylim()
    assert low < 0 < high and len(ax2.get_yticks()) > 2
    _, ax3 = plt.subplots()  # ticks 0.0005 apart near 1: 3 significant digits would repeat
    near_one = [{"step": s, "k": 1.0 - 0.0025 * (s % 2)} for s in range(3)]
    report.plot_panel(ax3, {"near one": [near_one]}, "k", "k")
    ax3.figure.canvas.draw()
    labels = [t.get_text() for t in ax3.get_yticklabels()]
    assert len(set(labels)) == len(labels) > 2 and "0.9995" in labels
    plt.close("all")


@pytest.mark.slow  # one step of the real model through both sides (bik on both: zero mismatch)
def test_smollm2_recipe_runs_a_step_with_the_ratio_exactly_one(smollm2, tmp_path, cache):
    from rl_harness import recipes

    cfg = config.build(recipes.overrides("smollm2"), ["steps=1", "rollout.max_new_tokens=4"])
    runner.run(cfg, tmp_path / "run", cache_dir=cache, progress=False, name="smollm2")
    (row,) = runner.read_metrics(tmp_path / "run")
    assert row["mismatch/tokens_unequal_count"] == 0
    assert row["ppo/ratio_min"] == row["ppo/ratio_max"] == 1.0 and row["ppo/clip_frac"] == 0
