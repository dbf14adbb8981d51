"""``python -m rl_harness same``: two runs of one config are the same bit for bit, and a run
that differs in anything (its seed, its rollout kernels, its length) is reported as different."""

import os
import shutil

import pytest
import torch
from rl_helpers import TINY

from rl_harness import same
from rl_harness.__main__ import main
from rl_harness.same import checkpoint_differences, metric_differences

RUN = [*TINY, "steps=2"]


def _run(cache, out, sets=RUN):
    args = [arg for s in sets for arg in ("--set", s)]
    assert main(["run", "--out", str(out), "--cache-dir", str(cache), *args]) == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache):
    """Four tiny runs: one config twice, the same with another seed, native rollout kernels."""
    root = tmp_path_factory.mktemp("same")
    for name, sets in {
        "a": RUN,
        "b": RUN,
        "seed": [*RUN, "seed=1"],
        "native": [*RUN, "rollout.kernels=native"],
    }.items():
        _run(cache, root / name, sets)
    return root


def test_one_config_run_twice_is_the_same(runs, capsys):
    capsys.readouterr()
    assert main(["same", str(runs / "a"), str(runs / "b")]) == 0
    report = capsys.readouterr().out
    assert ": the same" in report and "every value equal" in report
    assert "every bit equal" in report


def _different(runs, capsys, other):
    capsys.readouterr()
    assert main(["same", str(runs / "a"), str(runs / other)]) == 1
    report = capsys.readouterr().out
    assert ": different" in report and "step 0: " in report  # the first step already differs
    return report


def test_another_seed_differs_in_metrics_and_weights(runs, capsys):
    report = _different(runs, capsys, "seed")
    assert "master: " in report and "entries differ" in report


def test_native_rollout_kernels_differ_in_the_mismatch_metrics(runs, capsys):
    """The rollout's log-probs differ from the trainer's; whether the weights do depends on
    whether the update reads them (remedies, the rollout's pi_old), so only metrics are checked."""
    assert "mismatch/k3_kl" in _different(runs, capsys, "native")


def test_metric_differences_name_the_step_and_keys():
    a = [{"step": 0, "x": 1.0, "y": 2.0}, {"step": 1, "x": 1.0}]
    b = [{"step": 0, "x": 1.0, "y": 2.0000001}]
    assert metric_differences(a, b) == ["steps logged: 2 and 1", "step 0: y"]
    assert metric_differences(a, a) == []
    assert metric_differences(a[:1], b, ignore=("y",)) == []
    assert metric_differences([{"step": 0, "shadow/k3": 1.0}], [{"step": 0}], ("shadow/",)) == []
    nan = [{"step": 0, "x": float("nan")}]
    assert metric_differences(nan, nan) == []  # the same bits, though NaN != NaN
    assert metric_differences([{"step": 0, "x": 0.0}], [{"step": 0, "x": -0.0}]) == ["step 0: x"]


def test_checkpoint_differences_compare_dtype_and_bits():
    def state(weight):
        return {"step": 3, "master": {"w": weight}, "optimizer": {"state": {}}}

    w = torch.tensor([1.0, float("nan"), -0.0])
    assert checkpoint_differences(state(w), state(w.clone())) == ([], 3)
    for other in (w.double(), torch.tensor([1.0, float("nan"), 0.0])):
        lines, _ = checkpoint_differences(state(w), state(other))
        assert lines == ["master: 1 of 1 entries differ (w, ...)"]


def test_every_part_a_resume_reads_is_compared(runs):
    """Issue 42, item 6: the KL reference, the LR schedule, the optimizer's param_groups and
    the collapse detector were not compared, so two runs called the same could diverge after
    resuming."""
    base = torch.load(runs / "a" / "checkpoint.pt", weights_only=True)
    assert {"schedule", "detector"} <= set(base) and "param_groups" in base["optimizer"]
    assert checkpoint_differences(base, base)[0] == []

    def edited(edit):
        state = torch.load(runs / "a" / "checkpoint.pt", weights_only=True)
        edit(state)
        return checkpoint_differences(base, state)[0]

    assert edited(lambda s: s["optimizer"]["param_groups"][0].update(lr=0.5)) == [
        "optimizer: 1 of "
        + str(len(dict(same._leaves(base["optimizer"]))))
        + " entries differ (param_groups/0/lr, ...)"
    ]
    for part, key in (("schedule", "lr"), ("detector", "best_reward")):
        lines = edited(lambda s, p=part, k=key: s[p].update({k: 0.5}))
        assert len(lines) == 1 and lines[0].startswith(f"{part}: 1 of "), lines
        assert lines[0].endswith(f" entries differ ({key}, ...)")
    reference = {"w": torch.zeros(2)}
    assert edited(lambda s: s.update(reference=reference)) == [
        "reference: only in the second checkpoint"
    ]
    one, other = dict(base, reference=reference), dict(base, reference={"w": torch.ones(2)})
    assert checkpoint_differences(one, other)[0] == ["reference: 1 of 1 entries differ (w, ...)"]
    assert checkpoint_differences({"step": 0, "x": 0}, {"step": 0, "x": 0.0})[0] == [
        "x: 1 of 1 entries differ (, ...)"
    ]


def test_a_metrics_file_that_is_a_fifo_is_refused_not_waited_on(runs, tmp_path, capsys):
    shutil.copytree(runs / "a", tmp_path / "fifo", ignore=shutil.ignore_patterns("metrics.jsonl"))
    os.mkfifo(tmp_path / "fifo" / "metrics.jsonl")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["same", str(runs / "a"), str(tmp_path / "fifo")])
    assert exit_info.value.code == 2
    assert "metrics.jsonl: not a regular file" in capsys.readouterr().err


def test_missing_directory_or_checkpoint_is_a_one_line_error(runs, tmp_path, capsys):
    shutil.copytree(runs / "a", tmp_path / "cut", ignore=shutil.ignore_patterns("checkpoint.pt"))
    for argv, match in [
        ([runs / "a", tmp_path / "nope"], "same: no run directory at"),
        ([runs / "a", tmp_path], "no metrics.jsonl"),
        ([runs / "a", tmp_path / "cut"], "has no checkpoint.pt"),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main(["same", *map(str, argv)])
        assert exit_info.value.code == 2
        assert match in capsys.readouterr().err
