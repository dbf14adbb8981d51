"""The registered dose-response (RESULTS.md section 18): its doses, a fresh warm-up seed, LR*
from the pilot, the exact within-seed trend test, the McNemar tail, the mismatch budget, and
a one-LR grid read back end to end."""

import itertools
import math

import pytest
import torch
from PIL import Image
from rl_helpers import TINY

from rl_harness import policy, report, rundir
from rl_harness.__main__ import main
from rl_harness.studies import dose_response, edge
from rl_harness.studies.edge import Cell


def test_the_weight_rounding_doses_are_native_bf16_rollouts_rounded_to_their_bits():
    for bits in (5, 4, 3, 2):
        cfg = edge.cell_config("edge", Cell(1e-3, f"w{bits}", 0))
        assert cfg.rollout.weight_round_bits == bits
        assert (cfg.rollout.kernels, cfg.rollout.dtype, cfg.train.dtype) == (
            "native",
            "bfloat16",
            "bfloat16",
        )
    # w3 is section 13's fp8-like dose under another name
    assert edge.cell_config("edge", Cell(1e-3, "w3", 0)) == edge.cell_config(
        "edge", Cell(1e-3, "fp8w", 0)
    )
    assert edge.cell_config("edge", Cell(1e-3, "bf16", 0)).rollout.weight_round_bits == 0


def test_a_warmup_seed_set_on_the_grid_gives_every_run_a_fresh_shared_warmup(tmp_path):
    fresh = [
        edge.cell_config("edge", Cell(1e-3, d, s), ["warmup.seed=69"])
        for d, s in (("zero", 200), ("w2", 201))
    ]
    old = edge.cell_config("edge", Cell(1e-3, "zero", 200))
    assert old.warmup.seed == 0 and {c.warmup.seed for c in fresh} == {69}
    paths = {policy.warmup_cache_path(c, tmp_path) for c in fresh}
    assert len(paths) == 1 and policy.warmup_cache_path(old, tmp_path) not in paths


def test_the_edge_fit_gives_up_rather_than_fail_when_every_run_collapsed():
    """The pilot of section 18 collapsed on every run: its report's fit must not raise."""
    cells = [Cell(lr, "zero", s) for lr in (1e-3, 2e-3) for s in (0, 1)]
    x = edge.design(cells, ["zero"], center=-9.5)
    assert edge.fit(x, torch.ones(len(cells), dtype=torch.float64)) is None
    assert edge.fit(x, torch.zeros(len(cells), dtype=torch.float64)) is None


def test_isotonic_pools_the_adjacent_violators():
    assert dose_response.isotonic([0.0, 0.5, 0.0, 1.0]) == [0.0, 0.25, 0.25, 1.0]
    assert dose_response.isotonic([1.0, 0.0]) == [0.5, 0.5]


@pytest.mark.parametrize(
    ("shares", "expected"),
    [
        ({1e-3: 0.0, 1.4e-3: 0.0, 2e-3: 0.5, 2.8e-3: 1.0}, 1.4e-3 * (2e-3 / 1.4e-3) ** 0.6),
        ({1e-3: 0.0, 2e-3: 1.0}, 1e-3 * 2**0.3),
        ({1e-3: 0.5, 2e-3: 1.0}, "lower"),
        ({1e-3: 0.0, 2e-3: 0.0}, "higher"),
        ({1e-3: 0.0, 1.4e-3: 0.5, 2e-3: 0.0, 2.8e-3: 1.0}, 2e-3 * 1.4 ** (0.05 / 0.75)),
    ],
)
def test_lr_star_is_the_log_linear_30_percent_crossing_in_two_digits(shares, expected):
    star = dose_response.lr_star(shares)
    if isinstance(expected, str):
        assert star == expected
    else:
        assert star == float(f"{expected:.2g}")


def _brute_force(strata):
    """The trend test's p-values by enumerating every within-seed permutation."""
    unit = 10**dose_response.SCORE_DECIMALS
    observed = sum(round(x * unit) for runs in strata.values() for x, y in runs if y)
    per_stratum = []
    for runs in strata.values():
        ys = [y for _, y in runs]
        per_stratum.append(
            [
                sum(round(x * unit) for (x, _), y in zip(runs, perm) if y)
                for perm in itertools.permutations(ys)
            ]
        )
    totals = [sum(c) for c in itertools.product(*per_stratum)]
    upper = sum(t >= observed for t in totals) / len(totals)
    lower = sum(t <= observed for t in totals) / len(totals)
    return upper, lower


def test_the_trend_test_is_the_exact_within_seed_permutation_test():
    strata = {
        0: [(-6.0, False), (-4.712, False), (-3.1, True), (-2.55, True)],
        1: [(-6.0, True), (-4.5, False), (-3.3, True), (-2.6, False)],
        2: [(-6.0, False), (-4.9, False), (-3.05, False), (-2.7, True)],
        3: [(-6.0, True), (-4.6, True), (-3.2, True), (-2.5, True)],  # all fell: no information
    }
    trend = dose_response.trend_test(strata)
    upper, lower = _brute_force(strata)
    assert trend.p_upper == pytest.approx(upper) and trend.p_lower == pytest.approx(lower)
    assert trend.p == pytest.approx(min(1.0, 2 * min(upper, lower)))
    assert trend.statistic == pytest.approx(-3.1 - 2.55 - 6.0 - 3.3 - 2.7 - 16.3)
    # every collapse at the largest dose of its seed, over 8 seeds of 6 doses: p = 2 / 6^8
    rising = {s: [(x, x == -2.0) for x in (-6.0, -4.7, -4.2, -3.7, -3.2, -2.0)] for s in range(8)}
    assert dose_response.trend_test(rising).p == pytest.approx(2 / 6**8)


def test_the_one_sided_mcnemar_tail():
    assert dose_response.mcnemar_upper(7, 1) == pytest.approx(9 / 256)
    assert dose_response.mcnemar_upper(0, 0) == 1.0


def test_the_budget_is_where_the_fit_rises_ten_points_over_the_zero_dose():
    # the zero dose collapses in 2 of 10; the dosed runs' share rises with the score
    rows = [("zero", -6.0, i < 2) for i in range(10)]
    for x, share in ((-4.5, 0.2), (-3.5, 0.3), (-2.5, 0.6)):
        rows += [("w", x, i < share * 100) for i in range(100)]
    found = dose_response.budget(rows)
    assert found is not None and -4.5 < math.log10(found) < -3.0
    flat = [("zero", -6.0, i < 2) for i in range(10)]
    flat += [("w", x, i < 20) for x in (-4.5, -2.5) for i in range(100)]
    assert dose_response.budget(flat) == math.inf


@pytest.mark.parametrize("successes", [0, 1, 7, 20])
def test_the_wilson_interval_holds_the_share_and_stays_in_0_1(successes):
    low, high = report.wilson(successes, 20)
    assert 0.0 <= low <= successes / 20 <= high <= 1.0 and high - low > 0.1
    assert report.wilson(10, 20) == pytest.approx((0.2993, 0.7007), abs=1e-4)


def test_error_bars_are_cut_to_their_range():
    below, above = report.clipped_errors([0.95, 0.5, 0.02], [0.2, 0.1, 0.1])
    assert below == pytest.approx([0.2, 0.1, 0.02]) and above == pytest.approx([0.05, 0.1, 0.1])


def test_a_one_lr_grid_of_the_ladder_runs_and_reads_back(tmp_path, monkeypatch):
    """The zero dose and the strongest rung at one LR on two seeds of the tiny policy with a
    fresh warm-up seed: the edge runner makes them, the dose-response report reads them."""
    monkeypatch.setattr(edge, "BOOTSTRAP", 20)  # the reports' resamples: seconds, not half a minute
    monkeypatch.setattr(dose_response, "BOOTSTRAP", 20)
    sets = [*TINY, "steps=2", "eval.every=1", "eval.prompts=4", "rollout.max_new_tokens=6"]
    sets += ["task.min_digits=2", "task.max_digits=3", "warmup.seed=69"]
    flags = [x for s in sets for x in ("--set", s)]
    grid = ["--seeds", "200,201", "--out", str(tmp_path / "g"), *flags]
    argv = ["edge", "--lrs", "1e-3", "--doses", "zero,w2", *grid, "--cache-dir", str(tmp_path)]
    assert main(argv) == 0
    run = tmp_path / "g" / "lr0.001" / "w2" / "seed201"
    assert rundir.read_metrics(run)[0][dose_response.K3] > 0
    assert main(["dose-response", "--lr", "1e-3", "--doses", "zero,w2", *grid]) == 0
    text = (tmp_path / "g" / "dose.md").read_text()
    assert "seeds with every dose: 2 (200, 201)" in text and "two-sided p" in text
    assert "| w2 |" in text and "w3 (fp8-like)" not in text
    assert "1. one warm-up (a single held-out accuracy at step 0" in text and ": yes (" in text
    assert "3. the design point (zero collapsed on 10% to 70% of the seeds): no (0 of 2)" in text
    with Image.open(tmp_path / "g" / "dose.png") as plot:  # drawn beside dose.md
        assert plot.size[0] > 800
    pilot = ["dose-response", "--pilot", "--lrs", "1e-3", *grid]
    assert main(pilot) == 0 and "| 0.001 |" in (tmp_path / "g" / "pilot.md").read_text()
