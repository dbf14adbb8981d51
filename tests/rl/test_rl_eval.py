"""rl_harness held-out evaluation: greedy decoding, evaluation rows that leave training bit for
bit as it was (resume included), the eval_drop collapse flag, reports that tolerate rows
without evaluation, and compare on sweep arms (mean ± 95 % CI over seeds)."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rl_helpers import TINY, resumed_equals_uninterrupted, run_metrics

from bik.hf import generation_position_ids
from rl_harness import collapse, config, evaluate, policy, report, rollout, runner, sweep
from rl_harness.__main__ import main
from rl_harness.collapse import Detector
from rl_harness.config import CollapseConfig

EVAL = "eval/accuracy"
EVAL_FLAG = "collapse/eval_drop"


def _row(step, reward=0.5, accuracy=None, **extra):
    """A metrics row; ``accuracy``: an evaluation step's held-out accuracy."""
    row = {
        "step": step,
        "reward/mean": reward,
        "response_length/mean": 4.0,
        "mismatch/k3_kl": 1e-3 * step,
        "mismatch/tokens_unequal_frac": 0.1,
        "mismatch/logprob_abs_diff_max": 0.01,
        "grad_norm": 1.0,
        "lr": 1e-4,
        **{f"collapse/{flag}": 0 for flag in collapse.FLAGS},
        **extra,
    }
    if accuracy is not None:
        row.update({EVAL: accuracy, "eval/response_length": 3.0})
    return row


def _eval_flags(accuracies, **cfg):
    detector = Detector(CollapseConfig(**cfg))
    return [detector.update_eval(a)["eval_drop"] for a in accuracies]


def test_eval_drop_is_raised_below_half_the_peak():
    assert _eval_flags([0.2, 0.6, 0.4, 0.31, 0.29, 0.6]) == [False] * 4 + [True, False]
    assert _eval_flags([0.6, 0.4], reward_drop=0.25) == [False, True]


def test_eval_drop_needs_a_peak_above_the_floor():
    assert not any(_eval_flags([0.0, 0.05, 0.0, 0.1, 0.0]))  # peak 0.1: not above the floor
    assert _eval_flags([0.0, 0.125, 0.0]) == [False, False, True]


def test_eval_drop_resumes_through_state_dict():
    accuracies = [0.2, 0.8, 0.5, 0.3, 0.9, 0.2]
    expected = _eval_flags(accuracies)
    for cut in range(len(accuracies) + 1):
        first = Detector(CollapseConfig())
        got = [first.update_eval(a)["eval_drop"] for a in accuracies[:cut]]
        resumed = Detector(CollapseConfig())
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        got += [resumed.update_eval(a)["eval_drop"] for a in accuracies[cut:]]
        assert got == expected, cut
    old = Detector(CollapseConfig()).state_dict()
    del old["best_eval"]  # a checkpoint written before evaluation existed
    Detector(CollapseConfig()).load_state_dict(old)


def test_collapse_step_is_eval_drop_when_the_run_evaluated():
    # a grad-norm blow-up at step 1, held-out accuracy collapsing at step 5
    history = [_row(s, **{"collapse/grad_norm_blowup": int(s == 1)}) for s in range(6)]
    assert collapse.collapse_step(history) == 1  # no evaluation: the training-signal flags
    for step, accuracy, dropped in ((2, 0.5, 0), (5, 0.2, 1)):
        history[step].update({EVAL: accuracy, "collapse/eval_drop": dropped})
    assert collapse.collapse_step(history) == 5
    assert collapse.first_steps(history) == {"grad_norm_blowup": 1, "eval_drop": 5}
    history[5]["collapse/eval_drop"] = 0
    assert collapse.collapse_step(history) is None


def _history(seed, steps=6, every=3):
    """A synthetic run: reward and held-out accuracy rising with the seed, evaluating at
    steps every-1, 2 every-1, ..."""
    return [
        _row(
            s,
            reward=0.1 * s + 0.01 * seed,
            accuracy=0.2 + 0.1 * seed + 0.01 * s if (s + 1) % every == 0 else None,
        )
        for s in range(steps)
    ]


def test_reports_tolerate_rows_without_evaluation(tmp_path):
    history = _history(0)
    assert report.eval_peak(history) == pytest.approx(0.25)
    assert report.eval_last(history) == pytest.approx(0.25)
    assert report.band([history], EVAL)[0] == [2, 5]
    summary = report.summary_markdown(
        {**report.summarize(history, config.build({}, []), "x"), "machine": "m"}
    )
    assert "held-out greedy accuracy: peak 0.250 (step 5), last 0.250" in summary
    table = report.compare_markdown({"x": history, "plain": _history(0, every=100)})
    assert "eval accuracy peak | eval accuracy last |" in table
    assert "| plain | 6 | " in table and "| - | - | none |" in table
    report.plot_runs({"x": history}, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0


def _write_run(path, history):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in history))


def test_compare_shows_a_sweep_arm_as_mean_and_interval(tmp_path, capsys):
    for seed in range(3):
        _write_run(tmp_path / "arm" / f"seed{seed}", _history(seed))
    _write_run(tmp_path / "single", _history(0))
    out = tmp_path / "cmp"
    assert (
        main(["compare", str(tmp_path / "arm"), str(tmp_path / "single"), "--out", str(out)]) == 0
    )
    table = (out / "compare.md").read_text()
    arm = next(line for line in table.splitlines() if line.startswith("| arm |"))
    single = next(line for line in table.splitlines() if line.startswith("| single |"))
    assert arm.count("±") == 6 and "0 of 3 seeds" in arm  # every statistic; 3 seeds
    _, half = sweep.interval([0.3 + 0.01 * s for s in range(3)])  # reward last 5 (steps 1-5)
    assert f"| 0.310 ± {half:.3f} |" in arm
    assert "±" not in single and single.endswith("| none |")
    assert "95 % confidence interval" in table and (out / "compare.png").exists()


def test_compare_refuses_a_directory_without_runs(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main(["compare", str(tmp_path / "empty"), "--out", str(tmp_path / "cmp")])
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_sweep_reports_the_held_out_accuracy(tmp_path):
    results = {"arm": [_history(s) for s in range(3)]}
    table = sweep.sweep_markdown(results)
    assert "| eval accuracy peak | eval accuracy last |" in table
    assert "0.35 ± 0.25" in table  # peak: 0.25, 0.35, 0.45
    plain = sweep.sweep_markdown({"arm": [_history(s, every=100) for s in range(3)]})
    assert "eval accuracy" not in plain
    sweep.plot_sweep(results, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


# --- end to end: the runner's evaluation -------------------------------------------------

EVAL_SETS = ["steps=5", "eval.every=2", "eval.prompts=6"]
RUN = [*TINY, *EVAL_SETS]


def _training(row):
    """A row without the evaluation's keys."""
    return {k: v for k, v in row.items() if not k.startswith("eval/") and k != EVAL_FLAG}


def test_evaluation_leaves_training_bit_identical_and_logs_at_its_steps(tmp_path, cache):
    plain = run_metrics(tmp_path, cache, "plain", [*RUN, "eval.every=0"])
    evaluated = run_metrics(tmp_path, cache, "evaluated", RUN)
    assert json.dumps([_training(m) for m in evaluated]) == json.dumps(plain)
    # every 2 steps (1, 3) and the last one (4); the other rows lack the keys
    assert [m["step"] for m in evaluated if EVAL in m] == [1, 3, 4]
    for m in evaluated:
        keys = {EVAL, "eval/response_length", EVAL_FLAG}
        assert keys <= m.keys() if EVAL in m else not keys & m.keys()
        if EVAL in m:
            assert 0.0 <= m[EVAL] <= 1.0 and 1.0 <= m["eval/response_length"] <= 6.0
    summary = (tmp_path / "evaluated" / "summary.md").read_text()
    assert "held-out greedy accuracy: peak" in summary
    assert "held-out" not in (tmp_path / "plain" / "summary.md").read_text()


def test_evaluation_at_start_scores_the_warm_up_policy_in_step_0s_row(tmp_path, cache):
    plain = run_metrics(tmp_path, cache, "plain", [*RUN, "eval.every=0"])
    evaluated = run_metrics(tmp_path, cache, "evaluated", [*RUN, "eval.at_start=true"])
    assert json.dumps([_training(m) for m in evaluated]) == json.dumps(plain)
    assert [m["step"] for m in evaluated if EVAL in m] == [0, 1, 3, 4]
    # before the update: the warm-up's policy, as an evaluation of a run of 0 updates sees it
    cfg = config.build({}, [*RUN, "eval.at_start=true"])
    job = runner.Run(cfg, cache, None)
    assert evaluated[0][EVAL] == job.evaluate(evaluate.Heldout(cfg))[EVAL]


def test_the_held_out_set_is_fixed_and_apart_from_the_seed():
    a = evaluate.Heldout(config.build({}, [*RUN, "seed=0"]))
    shape = ["rollout.samples_per_prompt=3", "rollout.prompts=5"]
    b = evaluate.Heldout(config.build({}, [*RUN, "seed=3", *shape]))
    assert a.prompts == b.prompts and len(a.prompts) == 6
    assert [e.prompt for e in a.examples] == [e.prompt for e in b.examples]
    # eval.prompts need not suit train.mini_batches, which must divide rollout.prompts
    big = config.build({}, [*RUN, "train.mini_batches=2", "eval.prompts=7"])
    assert evaluate.Heldout(big).prompts[:6] == a.prompts
    assert len({tuple(p) for p in a.prompts}) > 1  # distinct prompts, each once


def _policy(sets=()):
    cfg = config.build({}, [*RUN, *sets])
    master = policy.build_master(cfg.model, 0)
    return cfg, policy.working_copy(master, cfg.precision.train_dtype, cfg.train.kernels)


@pytest.mark.parametrize("sets", [[], ["rollout.top_k=4", "rollout.temperature=0.5"]])
def test_greedy_decoding_is_deterministic_argmax_and_draws_nothing(sets):
    cfg, model = _policy([*sets, "rollout.logit_noise_std=1.0"])
    heldout = evaluate.Heldout(cfg)
    drift = torch.randn(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    first = rollout.sample(model, heldout.prompts, cfg.rollout, drift, generator, greedy=True)
    again = rollout.sample(model, heldout.prompts, cfg.rollout, drift, generator, greedy=True)
    assert torch.equal(generator.get_state(), state)  # no random number drawn, noise included
    assert torch.equal(first.sequences, again.sequences)
    # each response token is the argmax of the full forward's logits at the position before
    with torch.no_grad():
        logits = model(
            input_ids=first.sequences,
            attention_mask=first.attention_mask,
            position_ids=generation_position_ids(first.attention_mask),
        ).logits[:, :-1]
    response = first.response_mask[:, 1:].bool()
    assert response.any()
    argmax = logits.argmax(-1)
    assert torch.equal(argmax[response], first.sequences[:, 1:][response])


def test_resume_with_evaluation_equals_an_uninterruptedrun_metrics(tmp_path, cache, monkeypatch):
    full = resumed_equals_uninterrupted(tmp_path, cache, monkeypatch, RUN)
    assert [m["step"] for m in full if EVAL in m] == [1, 3, 4]


def _rank(rank, tmp, cache):
    """One of 2 gloo ranks: a run evaluating every step; saves how often this rank evaluated."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    calls = []
    original = runner.Run.evaluate

    def count(job, heldout):
        calls.append(job.world.rank)
        return original(job, heldout)

    runner.Run.evaluate = count
    try:
        cfg = config.build({}, [*TINY, "steps=2", "eval.every=1", "eval.prompts=3"])
        runner.run(cfg, f"{tmp}/run", cache_dir=cache, progress=False)
        torch.save(calls, f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_data_parallel_runs_evaluate_on_rank_0_alone(tmp_path, cache):
    run_metrics(tmp_path, cache, "warm", [*TINY, "steps=1"])  # the warm-up cache the ranks read
    mp.spawn(_rank, args=(str(tmp_path), str(cache)), nprocs=2)
    assert [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)] == [[0, 0], []]
    history = runner.read_metrics(tmp_path / "run")
    assert [m["step"] for m in history if EVAL in m] == [0, 1]
