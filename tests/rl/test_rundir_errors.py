"""Run directories that must not be overwritten or trusted by accident (issue 25, items 1, 2
and 17): ``--out`` and ``compare --out`` through a missing folder, ``--resume`` of a run whose
task is a plug-in module, pickled code in checkpoints and warm-up caches, the number of
processes a run records, atomic writes and torn metrics lines, and checkpoints that do not
fit their run."""

import json
import pathlib
import sys

import pytest
import torch
from rl_helpers import TINY as RL_TINY

from rl_harness import config, policy, recipes, rundir, runner
from rl_harness.__main__ import main
from rl_harness.errors import RunDirError

TINY = [*RL_TINY, "steps=1", "warmup.steps=0"]  # the runs here test files, not learning
PLUGIN = "rl_plugin_task"  # tests/support/rl_plugin_task.py


def _sets(sets):
    return [arg for s in sets for arg in ("--set", s)]


def _error(capsys, argv):
    """Runs ``argv``; asserts exit status 2 with one line on stderr; returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def _main(argv):
    return main([str(a) for a in argv])


def _files(run_dir):
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.is_file()}


def test_out_through_a_missing_folder_keeps_the_old_run(tmp_path, cache, capsys, monkeypatch):
    """Item 1: ``--out nosuch/../OLD_RUN`` exited 0 and overwrote OLD_RUN's files; the same
    trick made ``compare --out`` overwrite an earlier compare.md and compare.png."""
    monkeypatch.chdir(tmp_path)
    assert _main(["run", "--out", "old", "--cache-dir", cache, *_sets(TINY)]) == 0
    before = _files(tmp_path / "old")
    assert {"config.json", "metrics.jsonl", "checkpoint.pt"} <= set(before)
    err = _error(capsys, ["run", "--out", "nosuch/../old", "--cache-dir", cache, *_sets(TINY)])
    assert f"{tmp_path / 'old'} already holds a run" in err
    assert _files(tmp_path / "old") == before and not (tmp_path / "nosuch").exists()

    assert _main(["compare", "old", "--out", "cmp"]) == 0
    compared = _files(tmp_path / "cmp")
    assert set(compared) == {"compare.md", "compare.png"}
    for out in ("cmp", "nosuch/../cmp"):
        err = _error(capsys, ["compare", "old", "--out", out])
        assert f"{tmp_path / 'cmp'} already holds compare.md and compare.png" in err
    assert _files(tmp_path / "cmp") == compared


def test_resume_of_a_plugin_task_needs_its_module_named(tmp_path, cache, capsys):
    """Item 2: ``--resume DIR`` imported whatever module DIR/config.json named in task.module,
    without a word. Now the module must be named again with --trust-task-module."""
    out = tmp_path / "plugin"
    sets = [*TINY, f"task.module={PLUGIN}"]
    assert _main(["run", "--out", out, "--cache-dir", cache, *_sets(sets)]) == 0
    sys.modules.pop(PLUGIN)  # so the test can see whether resuming imports it
    resume = ["run", "--resume", out, "--steps", "2", "--cache-dir", cache]
    err = _error(capsys, resume)
    assert f"names the plug-in task task.module='{PLUGIN}'" in err
    assert f"pass --trust-task-module {PLUGIN}" in err
    err = _error(capsys, [*resume, "--trust-task-module", "other_module"])
    assert "(--trust-task-module other_module)" in err
    assert PLUGIN not in sys.modules  # refused before any import
    assert len(runner.read_metrics(out)) == 1
    assert _main([*resume, "--trust-task-module", PLUGIN]) == 0
    assert len(runner.read_metrics(out)) == 2
    err = _error(capsys, ["run", "--out", tmp_path / "new", "--trust-task-module", PLUGIN])
    assert "--trust-task-module applies to --resume only" in err


class _Payload:
    """Unpickling this runs code: it creates the file ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_checkpoints_and_warmup_caches_never_unpickle_code(tmp_path):
    """Item 2: a checkpoint or warm-up cache from elsewhere is loaded with
    ``weights_only=True``: a pickled object is refused and its code never runs."""
    marker = tmp_path / "code-ran"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torch.save({"step": 0, "master": {}, "optimizer": _Payload(marker)}, run_dir / "checkpoint.pt")
    with pytest.raises(RunDirError, match="is not a readable checkpoint"):
        rundir.load_checkpoint(run_dir)
    cfg = config.build({}, [*TINY, "warmup.steps=1"])
    path = policy.warmup_cache_path(cfg, tmp_path / "cache")
    path.parent.mkdir()
    torch.save({"weight": _Payload(marker)}, path)
    master = policy.build_master(cfg.model, policy.warmup_seed(cfg))
    with pytest.warns(UserWarning, match="unreadable warm-up cache"):
        policy.warmup(master, cfg, tmp_path / "cache")
    assert not marker.exists()


def test_config_and_summary_record_the_number_of_processes(tmp_path, cache, capsys):
    """Item 17: a run's config.json and summary did not say how many processes made it
    (tests/rl/test_rl_distributed.py checks a 2-process run). A resume with another number
    is refused (the gradients differ): emulated by recording 2 in a one-process run."""
    out = tmp_path / "run"
    assert _main(["run", "--out", out, "--cache-dir", cache, *_sets(TINY)]) == 0
    assert "- processes: 1 (data-parallel world size" in capsys.readouterr().out
    values = json.loads((out / "config.json").read_text())
    assert values["world_size"] == 1
    assert config.load(out / "config.json") == config.build(
        recipes.overrides("zero_mismatch"), TINY
    )
    summary = (out / "summary.md").read_text()
    assert "- processes: 1 (data-parallel world size" in summary
    (out / "config.json").write_text(json.dumps({**values, "world_size": 2}))
    err = _error(capsys, ["run", "--resume", out, "--steps", "2", "--cache-dir", cache])
    assert "was run by 2 process(es), this is 1; resume it with 2" in err


def _edited_run(tmp_path, cache, edit_state=None, edit_config=None):
    """A finished one-step run whose checkpoint or config.json ``edit_*`` changed."""
    run_dir = tmp_path / "run"
    assert _main(["run", "--out", run_dir, "--cache-dir", cache, *_sets(TINY)]) == 0
    if edit_state is not None:
        state = torch.load(run_dir / rundir.CHECKPOINT, weights_only=True)
        edit_state(state)
        torch.save(state, run_dir / rundir.CHECKPOINT)
    if edit_config is not None:
        values = json.loads((run_dir / rundir.CONFIG).read_text())
        edit_config(values)
        (run_dir / rundir.CONFIG).write_text(json.dumps(values))
    return run_dir


def _first_weight(state):
    return next(iter(state["master"]))


@pytest.mark.parametrize(
    ("edit_state", "message"),
    [
        (lambda s: s.update(step=-3), "its step is -3, expected an integer >= 0"),
        (lambda s: s.update(step="0"), "its step is '0', expected an integer >= 0"),
        (
            lambda s: s["master"][_first_weight(s)].fill_(float("nan")),
            "holds NaN or infinite values",
        ),
        (
            lambda s: s["master"].update({_first_weight(s): torch.zeros(3)}),
            "its master state does not fit",
        ),
        (lambda s: s.pop("schedule"), "it has no schedule state"),
    ],
    ids=["negative step", "string step", "NaN weights", "wrong shape", "no schedule"],
)
def test_resume_refuses_a_checkpoint_that_does_not_fit(
    tmp_path, cache, capsys, edit_state, message
):
    """Issue 42, item 9: a step of -3 was accepted; the others ended in raw tracebacks."""
    run_dir = _edited_run(tmp_path, cache, edit_state=edit_state)
    err = _error(capsys, ["run", "--resume", run_dir, "--cache-dir", cache, "--steps", "2"])
    assert str(run_dir / rundir.CHECKPOINT) in err and message in err, err


def test_resume_refuses_a_config_its_checkpoint_does_not_fit(tmp_path, cache, capsys):
    def wider(values):
        values["model"]["hidden_size"] *= 2

    run_dir = _edited_run(tmp_path, cache, edit_config=wider)
    err = _error(capsys, ["run", "--resume", run_dir, "--cache-dir", cache, "--steps", "2"])
    assert f"{run_dir / rundir.CHECKPOINT} does not fit {run_dir / rundir.CONFIG}" in err, err
    assert "its master state does not fit (" in err


def test_write_atomic_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "state.txt"
    rundir.write_atomic(path, "old\n")

    def half_then_crash(tmp):
        tmp.write_text("ha")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        rundir.write_atomic(path, half_then_crash)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["state.txt"]


def _write_metrics(tmp_path, text):
    (tmp_path / "metrics.jsonl").write_text(text)
    return tmp_path


def test_read_metrics_drops_a_torn_last_line_with_a_warning(tmp_path):
    rows = [{"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}]
    text = rundir.metrics_text(rows)
    assert rundir.read_metrics(_write_metrics(tmp_path, text)) == rows
    with pytest.warns(UserWarning, match="dropped a torn last line"):
        got = rundir.read_metrics(_write_metrics(tmp_path, text + '{"step": 2, "x"'))
    assert got == rows
    with pytest.raises(RunDirError, match="line 2 is not a metrics record"):
        rundir.read_metrics(_write_metrics(tmp_path, text.replace('{"step": 1', '{"step: 1')))
