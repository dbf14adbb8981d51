"""The edge's remedy phase: the arms' configs (the control and the reference are the edge
grid's own runs), the paired statistics, and the phase end to end on the tiny policy."""

import shutil
from pathlib import Path

import pytest
from rl_helpers import TINY

from rl_harness import rundir
from rl_harness.__main__ import main
from rl_harness.errors import HarnessError
from rl_harness.studies import edge, edge_remedies
from rl_harness.studies.edge_remedies import Phase, first_decay, holm, restricted_time, sign_flip_p


@pytest.mark.parametrize("arm", ["zero", "fp8w"])
def test_the_reference_and_the_control_are_the_edge_grids_runs(arm):
    mine = edge_remedies.arm_config("edge", 1e-3, arm, 4)
    assert mine == edge.cell_config("edge", edge.Cell(1e-3, arm, 4))


def test_each_remedy_arm_changes_its_remedy_alone():
    control = edge_remedies.arm_config("edge", 1e-3, "fp8w", 0)
    tis = edge_remedies.arm_config("edge", 1e-3, "fp8w_tis", 0)
    half = edge_remedies.arm_config("edge", 1e-3, "fp8w_half", 0)
    fixed = edge_remedies.arm_config("edge", 1e-3, "fp8w_fixed", 0, decay_period=16)
    assert (tis.remedy.name, tis.rollout.weight_round_bits) == ("token_tis", 3)
    assert tis.train == control.train and tis.rollout == control.rollout
    assert half.train.lr == 5e-4 and half.rollout == control.rollout
    assert (fixed.lr_schedule.name, fixed.lr_schedule.decay_period) == ("length_surge", 16)
    with pytest.raises(HarnessError, match="fp8w_fixed needs --decay-period"):
        edge_remedies.arm_config("edge", 1e-3, "fp8w_fixed", 0)


def test_the_sign_flip_test_is_exact():
    assert sign_flip_p([3.0] * 5) == pytest.approx(2 / 32)  # only all-plus and all-minus
    assert sign_flip_p([0.0, 0.0]) == 1.0
    assert sign_flip_p([5.0, -5.0, 5.0, 5.0]) == pytest.approx(10 / 16)
    with pytest.raises(HarnessError, match="1 to 20 differences"):
        sign_flip_p([])


def test_holm_scales_the_smallest_p_most_and_stays_monotone():
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx(
        {"a": 0.03, "c": 0.06, "b": 0.06}
    )
    assert holm({"a": 0.6, "b": 0.9}) == {"a": 1.0, "b": 1.0}


def _run(steps, collapse_at=None, lr=None):
    rows = []
    for step in range(steps):
        flagged = collapse_at is not None and step >= collapse_at
        rows.append(
            {
                "step": step,
                "collapse/reward_drop": int(flagged),
                "lr": (lr or (lambda s: 1e-3))(step),
            }
        )
    return rows


def test_time_to_collapse_is_censored_at_the_runs_length_and_decay_is_read_from_the_lr():
    assert restricted_time(_run(40, collapse_at=12)) == 12  # ten steps of the reward flag
    assert restricted_time(_run(40)) == 40
    assert edge_remedies.survival([_run(40, 12), _run(40)], 40)[11:13] == [1.0, 0.5]
    assert first_decay(_run(20, lr=lambda s: 1e-3 if s < 16 else 5e-4)) == 16
    assert first_decay(_run(20)) is None


def test_the_phase_runs_reuses_and_reports(tmp_path, capsys):
    """The control and its matched-time decay on one seed of the tiny policy; the report
    pairs them; a rerun runs nothing, and a directory holding another config is refused."""
    sets = [*TINY, "steps=4", "eval.every=1", "eval.prompts=4", "rollout.max_new_tokens=6"]
    sets += ["task.min_digits=2", "task.max_digits=3"]
    args = ["--lr", "1e-3", "--seeds", "0", "--decay-period", "2", "--out", str(tmp_path / "g")]
    args += [x for s in sets for x in ("--set", s)]
    argv = ["edge-remedies", "--arms", "fp8w,fp8w_fixed", *args, "--jobs", "2"]
    argv += ["--cache-dir", str(tmp_path / "c")]
    assert main(argv) == 0
    text = (tmp_path / "g" / "remedies_lr0.001.md").read_text()
    assert "complete runs: 2 (1 seeds: 0)" in text and "| fp8w_fixed |" in text
    assert "LR lowered in 1 of 1 runs, first at step 3" in text
    assert (tmp_path / "g" / "remedies_lr0.001.png").exists()
    phase = Phase("edge", 1e-3, ["fp8w", "fp8w_fixed"], [0], sets, 2)
    assert rundir.read_metrics(phase.runs(tmp_path / "g")["fp8w_fixed", 0][1])[3]["lr"] == 5e-4
    capsys.readouterr()
    assert main(argv) == 0
    assert "2 of 2 runs complete; 0 to run" in capsys.readouterr().out
    other = [
        "edge-remedies",
        "--arms",
        "fp8w",
        *args,
        "--set",
        "train.entropy_coef=0.01",
        "--report",
    ]
    with pytest.raises(SystemExit) as stop:  # the recorded run is not this config's
        main(other)
    assert stop.value.code == 2 and "holds a run of another config" in capsys.readouterr().err
    shutil.copytree(tmp_path / "g", tmp_path / "h")  # the seed made whole elsewhere too
    shutil.rmtree(phase.runs(tmp_path / "g")["fp8w_fixed", 0][1])
    assert main(["edge-remedies", "--arms", "fp8w,fp8w_fixed", *args, "--report"]) == 0
    assert "complete runs: 1 (1 seeds: 0)" in capsys.readouterr().out
    both = ["edge-remedies", "--arms", "fp8w,fp8w_fixed", *args, "--also", str(tmp_path / "h")]
    assert main([*both, "--report"]) == 0
    text = capsys.readouterr().out
    assert "complete runs: 2 (1 seeds: 0)" in text and "seeds 0 from `h/`" in text


def test_each_seed_is_read_from_one_directory_the_first_that_holds_it_whole():
    phase = Phase("edge", 1e-3, ["fp8w", "fp8w_tis"], [0, 1, 2, 3, 4], [], 0)
    first, second = Path("first"), Path("second")
    complete = {
        first: {("fp8w", 0): first, ("fp8w_tis", 0): first, ("fp8w", 1): first, ("fp8w", 4): first},
        second: {("fp8w", 0): second, ("fp8w_tis", 0): second, ("fp8w", 1): second},
    }
    complete[second].update({("fp8w_tis", 1): second, ("fp8w", 2): second, ("fp8w", 4): second})
    sources = edge_remedies.seed_sources(phase, complete)
    assert sources == {0: first, 1: second, 2: second, 4: first}  # 3: in neither


def test_a_remedy_run_that_did_not_start_as_its_control_is_refused(tmp_path):
    """The step-0 rollout precedes every update, so a remedy run shares its control's; one
    that does not started from another warm-up (another CPU capability or library)."""
    digest = edge_remedies.STEP0_DIGEST
    results = {
        ("fp8w", 0): [{digest: "a1"}],
        ("fp8w_tis", 0): [{digest: "a1"}],
        ("zero", 0): [{digest: "b2"}],  # another dose samples other tokens: not compared
    }
    paths = {key: tmp_path / f"{key[0]}-{key[1]}" for key in results}
    edge_remedies.check_pairing(results, paths)
    results["fp8w_mis", 0] = [{digest: "c3"}]
    paths["fp8w_mis", 0] = tmp_path / "fp8w_mis-0"
    with pytest.raises(HarnessError, match="fp8w_mis-0 did not sample the step-0 rollout"):
        edge_remedies.check_pairing(results, paths)


@pytest.mark.parametrize("command", ["edge", "edge-remedies"])
def test_jobs_below_one_is_a_usage_error(command, capsys):
    argv = [command, "--seeds", "0", "--out", "x", "--jobs", "0"]
    argv += ["--lrs", "1e-3"] if command == "edge" else ["--lr", "1e-3", "--arms", "fp8w"]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert (
        stop.value.code == 2
        and "--jobs: expected an integer >= 1, got '0'" in capsys.readouterr().err
    )
