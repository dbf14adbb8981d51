"""The practitioners' read-back of the edge grid (rl_harness.studies.alarms): when an alarm is
raised, how its lead is scored, and the paired test of the budget."""

import math

import pytest

from rl_harness import collapse
from rl_harness.__main__ import main
from rl_harness.studies import alarms
from rl_harness.studies.alarms import Signal

RISE = Signal("k3", "mismatch/k3_kl", "bulk")
FALL = Signal("reward", "reward/mean", "policy", falls=True)
FLAG = Signal("surge", "collapse/length_surge", "flag")


def _rows(values, key="mismatch/k3_kl", **flags):
    """Metrics rows with ``values`` under ``key``; ``flags``: {flag: first step raised}."""
    return [
        {"step": step, key: value, **{f"collapse/{f}": int(step >= at) for f, at in flags.items()}}
        for step, value in enumerate(values)
    ]


def test_a_rise_alarms_where_the_trailing_mean_reaches_twice_the_baseline():
    # baseline 1.0 (steps 0-2); trailing means 1.67 at step 3, 2.33 at step 4
    assert alarms.alarm_step(_rows([1, 1, 1, 3, 3, 3]), RISE) == 4


def test_a_flat_metric_a_lone_spike_and_a_zero_baseline_raise_no_alarm():
    assert alarms.alarm_step(_rows([1.0] * 20), RISE) is None
    assert alarms.alarm_step(_rows([1, 1, 1, 1, 3.5, 1, 1]), RISE) is None  # trailing mean 1.83
    assert alarms.alarm_step(_rows([0.0] * 10 + [5.0] * 10), RISE) is None  # the zero dose


def test_a_falling_signal_alarms_at_half_its_baseline_and_a_flag_at_its_first_step():
    assert alarms.alarm_step(_rows([0.6, 0.6, 0.6, 0.5, 0.1, 0.1], "reward/mean"), FALL) == 5
    assert alarms.alarm_step(_rows([1.0] * 12, length_surge=7), FLAG) == 7
    assert alarms.alarm_step(_rows([1.0] * 12), FLAG) is None


def test_the_plotted_signal_is_relative_to_the_runs_own_first_steps():
    assert alarms.relative(_rows([2, 2, 2, 4, 1]), "mismatch/k3_kl") == [1, 1, 1, 2, 0.5]
    zero_dose = alarms.relative(_rows([0.0] * 5), "mismatch/k3_kl")
    assert len(zero_dose) == 5 and all(math.isnan(v) for v in zero_dose)


def _run(values, collapse_at=None):
    """A run of the rising metric whose reward flag makes it collapse persistently at
    ``collapse_at`` (collapse.PERSIST_STEPS flagged steps in a row)."""
    rows = _rows(values)
    for row in rows:
        raised = collapse_at is not None and row["step"] >= collapse_at
        row["collapse/reward_drop"] = int(raised)
    return rows


def test_lead_counts_alarms_before_the_collapse_and_false_alarms_in_survivors():
    warned = _run([1, 1, 1, 3, 3, 3] + [3] * 20, collapse_at=8)  # alarm at step 4
    late = _run([1, 1, 1, 1, 1, 1, 1, 1, 1, 5, 5, 5] + [5] * 20, collapse_at=8)  # alarm at 10
    survivor = _run([1, 1, 1, 3, 3, 3] + [3] * 20)
    quiet = _run([1.0] * 26)
    assert collapse.persistent_collapse_step(warned) == 8
    scored = alarms.score([warned, late, survivor, quiet], RISE)
    assert scored == alarms.Score(collapsed=2, leads=[4], survived=2, false_alarms=1)


def test_mixed_cells_are_the_lr_and_dose_cells_whose_seeds_went_both_ways():
    fell, survived = _run([1.0] * 26, collapse_at=8), _run([1.0] * 26)
    results = {
        alarms.Cell(1e-3, "zero", 0): fell,
        alarms.Cell(1e-3, "zero", 1): survived,
        alarms.Cell(2e-3, "zero", 0): fell,
        alarms.Cell(2e-3, "zero", 1): fell,
        alarms.Cell(1e-3, "fp8w", 0): survived,
    }
    assert set(alarms.mixed_cells(results)) == {alarms.Cell(1e-3, "zero", s) for s in (0, 1)}


@pytest.mark.parametrize(
    ("only_dose", "only_zero", "p"),
    [(0, 0, 1.0), (4, 0, 0.125), (0, 4, 0.125), (5, 1, 2 * 7 / 64), (6, 0, 2 / 64), (2, 2, 1.0)],
)
def test_mcnemar_is_the_exact_two_sided_binomial_on_the_discordant_seeds(only_dose, only_zero, p):
    assert alarms.mcnemar(only_dose, only_zero) == pytest.approx(p)


@pytest.mark.parametrize(
    ("doses", "expected"),
    [("zero", "expected the zero dose and at least one other"), ("zero,bf16", "no complete run")],
)
def test_alarms_names_what_it_lacks(doses, expected, tmp_path, capsys):
    argv = ["alarms", "--lrs", "1e-3", "--doses", doses, "--seeds", "0", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and expected in capsys.readouterr().err
