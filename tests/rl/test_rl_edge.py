"""The stability-edge experiment's parts: persistent collapse, endpoint, signature, the
logistic fit and its power, coupled sampling and response digests, compacted run directories,
and the grid end to end."""

import re

import pytest
import torch
from PIL import Image
from rl_helpers import TINY

from rl_harness import collapse, config, engines, metrics_pack, policy, rollout, rundir, runner
from rl_harness.__main__ import main
from rl_harness.rollout import response_digests
from rl_harness.studies import bias, edge


def _history(accuracies=None, rewards=None, steps=30, **extra):
    """Metrics rows: held-out accuracy at the steps of ``accuracies`` ({step: value}) with the
    recorded eval_drop flag, and the reward_drop flag raised where ``rewards`` ({step: True})."""
    rows, peak = [], 0.0
    for step in range(steps):
        row = {"step": step, **{k: v(step) for k, v in extra.items()}}
        row["collapse/reward_drop"] = int(bool((rewards or {}).get(step)))
        if accuracies and step in accuracies:
            peak = max(peak, accuracies[step])
            drop = peak > collapse.PEAK_FLOOR and accuracies[step] < 0.5 * peak
            row.update({collapse.EVAL_METRIC: accuracies[step], "collapse/eval_drop": int(drop)})
        rows.append(row)
    return rows


def test_a_dip_the_policy_climbs_out_of_is_not_a_persistent_collapse():
    dip = _history({0: 0.6, 10: 0.2, 20: 0.7, 29: 0.8})
    assert collapse.collapse_step(dip) == 10  # the single-evaluation rule counts the dip
    assert collapse.persistent_collapse_step(dip) is None


def test_two_evaluations_in_a_row_below_half_the_peak_collapse_at_the_first():
    fall = _history({0: 0.6, 10: 0.2, 20: 0.1, 29: 0.0})
    assert collapse.persistent_collapse_step(fall) == 10


def test_ten_steps_of_the_reward_flag_collapse_at_the_streaks_first_step():
    nine = _history(rewards=dict.fromkeys(range(5, 14), True))
    ten = _history(rewards=dict.fromkeys([3, *range(15, 25)], True))
    assert collapse.persistent_collapse_step(nine) is None
    assert collapse.persistent_collapse_step(ten) == 15


def test_the_endpoint_is_the_mean_of_the_last_three_evaluations():
    assert collapse.endpoint(_history({0: 0.5, 9: 0.1, 19: 0.4, 29: 0.7})) == pytest.approx(0.4)
    assert collapse.endpoint(_history({0: 0.5, 29: 0.7})) is None


def test_the_signature_flags_a_rise_before_the_collapse_and_not_a_flat_run():
    rising = _history(
        steps=40,
        **{
            "mismatch/k3_kl": lambda s: 1e-3 if s < 25 else 1e-2,
            "mismatch/log_ppl_abs_diff": lambda s: 0.01,
            "grad_norm": lambda s: 0.2,
        },
    )
    flags = collapse.signature(rising, 34)
    assert flags == {
        "log_ppl_spike": False,
        "k3_spike": True,
        "grad_norm_rise": False,
        "length_surge": False,
    }
    zero = _history(steps=40, **{"mismatch/k3_kl": lambda s: 0.0})
    assert not collapse.signature(zero, 34)["k3_spike"]  # 0 >= 2 x 0 is no spike


def test_the_logistic_fit_recovers_known_coefficients():
    rng = torch.Generator().manual_seed(0)
    x = torch.cat([torch.ones(20000, 1), torch.randn(20000, 2, generator=rng)], 1).double()
    truth = torch.tensor([0.3, 2.0, -1.0], dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(x @ truth), generator=rng)
    beta = edge.fit(x, y, ridge=0.0)
    assert beta is not None and torch.allclose(beta, truth, atol=0.08)


def _grid_results(edge_of_dose):
    """Runs whose collapse is decided by the LR against each dose's edge, but for two seeds
    a dose (other seeds for each dose) that go the other way at 1e-3 (so that the cells do
    not separate)."""
    results = {}
    for seed in range(10):
        for lr in (2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3):
            for index, (dose, lr50) in enumerate(edge_of_dose.items()):
                flipped = seed in (2 * index, 2 * index + 1) and lr == 1e-3
                collapsed = (lr >= lr50) != flipped
                rewards = dict.fromkeys(range(10, 20), True) if collapsed else {}
                results[edge.Cell(lr, dose, seed)] = _history(rewards=rewards)
    return results


def test_a_dose_that_moves_the_edge_down_two_grid_steps_has_a_shift_factor_near_a_quarter():
    fitted = edge.edge(_grid_results({"zero": 1.5e-3, "fp8w": 4.5e-4}), ["zero", "fp8w"])
    assert fitted.slope is not None and fitted.slope > 0
    assert 0.15 < fitted.shift["fp8w"] < 0.5
    low, high = fitted.shift_interval["fp8w"]
    assert low <= fitted.shift["fp8w"] <= high < 1  # the interval excludes "no shift"


def test_a_dose_without_effect_has_an_interval_around_one():
    fitted = edge.edge(_grid_results({"zero": 1.5e-3, "bf16": 1.5e-3}), ["zero", "bf16"])
    low, high = fitted.shift_interval["bf16"]
    assert low < 1 < high


def test_more_seeds_detect_a_smaller_shift(monkeypatch):
    monkeypatch.setattr(edge, "SIMULATIONS", 100)  # the registered 400 take 4 x as long
    few, many = (edge.detectable_shift(3.0, [5e-4, 7e-4, 1e-3, 1.4e-3, 2e-3], n) for n in (4, 16))
    assert 1 < many < few


def test_response_digests_see_only_the_response_tokens():
    sequences = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 9], [5, 6, 8, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
    digests = response_digests(sequences, mask)
    assert len(digests) == 12
    assert digests[0:4] == digests[4:8] != digests[8:12]  # padding past the mask is ignored


def test_agreement_is_the_share_of_equal_digests():
    a = [{"step": 0, "rollout/response_digests": "aaaabbbbcccc"}]
    b = [{"step": 0, "rollout/response_digests": "aaaabbbbdddd"}]
    assert edge.agreement(a, b) == pytest.approx(2 / 3)
    assert edge.agreement([{"step": 0}], b) is None


def _tiny_sample(kernels: str, seed: int):
    cfg = config.build(
        {}, [*TINY, "rollout.dtype=bfloat16", "train.dtype=bfloat16", f"rollout.kernels={kernels}"]
    )
    master = policy.build_master(cfg.model, 0)
    torch.manual_seed(1)
    for p in master.parameters():  # a policy with a spread-out distribution: a real race
        p.data.normal_(0, 0.3)
    engine = engines.ENGINES["hf"](master, cfg, torch.zeros(master.config.vocab_size), None)
    prompts = [[1, 4, 5, 6]] * 16
    return engine.sample(prompts, seed, slice(0, 16))


def test_coupled_sampling_draws_the_same_tokens_where_the_distributions_agree():
    """A native bf16 rollout and a bik bf16 one of the same seed differ in their log-probs,
    yet sample nearly the same responses: they share the race's noise. The negative control:
    another seed, with the same kernels, samples other responses."""
    samples = [_tiny_sample("bik", 7), _tiny_sample("native", 7), _tiny_sample("bik", 8)]
    bik, native, other = (s.sequences[:, 4:] for s in samples)
    width = min(t.shape[1] for t in (bik, native, other))
    first = (samples[0].rollout_logp[:, 4], samples[1].rollout_logp[:, 4])
    assert not torch.equal(*first)  # the two kernels' log-probs of the same first tokens differ
    alike = (bik[:, :width] == native[:, :width]).double().mean()
    chance = (bik[:, :width] == other[:, :width]).double().mean()
    assert alike > 0.9 and chance < 0.5


def test_a_compacted_run_reads_back_the_same_and_resumes_plain(tmp_path):
    cfg = config.build({}, [*TINY, "steps=2"])
    runner.run(cfg, tmp_path / "run", cache_dir=tmp_path / "cache", progress=False)
    before = rundir.read_metrics(tmp_path / "run")
    png = (tmp_path / "run" / rundir.PLOT).stat().st_size
    assert rundir.compact(tmp_path / "run") and not rundir.compact(tmp_path / "run")
    assert not (tmp_path / "run" / rundir.METRICS).exists()
    packed = (tmp_path / "run" / rundir.METRICS_PACKED).read_bytes()
    assert rundir.metrics_text(metrics_pack.unpack(packed)) == rundir.metrics_text(before)
    assert (tmp_path / "run" / rundir.PLOT).stat().st_size < png
    with Image.open(tmp_path / "run" / rundir.PLOT) as plot:  # a run's plot: 16 colours
        assert plot.mode == "P" and plot.getcolors(rundir.RUN_PLOT_COLOURS) is not None
    assert rundir.read_metrics(tmp_path / "run") == before
    runner.resume(tmp_path / "run", steps=3, cache_dir=tmp_path / "cache", progress=False)
    assert not (tmp_path / "run" / rundir.METRICS_PACKED).exists()
    assert rundir.read_metrics(tmp_path / "run")[:2] == before


def test_a_plot_stored_with_more_colours_is_shrunk_again_and_one_with_fewer_is_kept(tmp_path):
    path = tmp_path / "plot.png"
    gradient = Image.linear_gradient("L").convert("RGB")  # 256 shades
    gradient.quantize(colors=256).save(path)
    rundir.shrink_png(path, 16)
    with Image.open(path) as shrunk:
        assert shrunk.mode == "P" and shrunk.getcolors(16) is not None
    written = path.stat().st_mtime_ns
    rundir.shrink_png(path, 16)
    assert path.stat().st_mtime_ns == written  # already small enough: not rewritten


def test_compact_refuses_a_run_that_has_not_finished(tmp_path):
    (tmp_path / rundir.METRICS).write_text('{"step": 0}\n')
    with pytest.raises(rundir.RunDirError, match="not a finished run"):
        rundir.compact(tmp_path)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--doses", "bf16,zero"], "zero first"),
        (["--doses", "zero,fp4"], "expected distinct doses"),
        (["--seeds", "a-b"], "expected distinct seeds >= 0"),
        # issue 72, item 10: these ran nothing and reported "no complete run"
        (["--seeds", "5-2"], "argument --seeds: expected distinct seeds >= 0 as 0-9 (ascending)"),
        (["--seeds", "1,1"], "argument --seeds: expected distinct seeds"),
        (["--lrs", "0,1e-3"], "learning rates > 0"),
    ],
)
def test_edge_names_a_bad_argument(argv, expected, capsys, tmp_path):
    base = {"--lrs": "1e-3", "--seeds": "0", "--out": str(tmp_path)}
    base.update(dict(zip(argv[::2], argv[1::2])))
    with pytest.raises(SystemExit) as stop:
        main(["edge", *(x for kv in base.items() for x in kv)])
    assert stop.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--lr", "-1"], "argument --lr: expected learning rates > 0, got '-1'"),
        (["--lr", "1e-3,2e-3"], "argument --lr: expected one learning rate > 0"),
        (["--doses", "zero,nope"], "argument --doses: expected distinct doses"),
    ],
)
def test_dose_response_names_a_bad_argument(argv, expected, capsys, tmp_path):
    """Issue 72, item 10: a bad --lr surfaced as a config error, bad --doses after parsing."""
    base = {"--lr": "1e-3", "--seeds": "0", "--out": str(tmp_path), **dict([argv])}
    with pytest.raises(SystemExit) as stop:
        main(["dose-response", *(x for kv in base.items() for x in kv)])
    assert stop.value.code == 2 and expected in capsys.readouterr().err


def test_the_grid_runs_resumes_and_reports(tmp_path, capsys):
    """Two LRs x two doses x one seed on the tiny policy: every run complete, compacted, the
    report written; run again, nothing reruns; ``alarms`` reads the grid back."""
    sets = [*TINY, "steps=3", "eval.every=1", "eval.prompts=4", "rollout.max_new_tokens=6"]
    sets += ["task.min_digits=2", "task.max_digits=3"]
    grid = ["--lrs", "1e-3,4e-3", "--doses", "zero,fp8w", "--seeds", "0"]
    grid += ["--out", str(tmp_path / "grid"), *(x for s in sets for x in ("--set", s))]
    argv = ["edge", *grid, "--jobs", "2", "--cache-dir", str(tmp_path / "c")]
    assert main(argv) == 0
    text = (tmp_path / "grid" / "edge.md").read_text()
    assert "Complete runs: 4 (1 seeds: 0)" in text and "| 0.001 | fp8w |" in text
    run = tmp_path / "grid" / "lr0.004" / "fp8w" / "seed0"
    assert (run / rundir.METRICS_PACKED).exists() and (tmp_path / "grid" / "edge.png").exists()
    cfg = config.load(run / rundir.CONFIG)
    assert (cfg.train.lr, cfg.rollout.weight_round_bits, cfg.train.dtype) == (4e-3, 3, "bfloat16")
    capsys.readouterr()
    assert main(argv) == 0
    assert "4 of 4 runs complete; 0 to run" in capsys.readouterr().out
    assert collapse.endpoint(rundir.read_metrics(run)) is not None  # 3 evaluations or more
    assert main(["alarms", *grid]) == 0  # the practitioners' read-back of the same grid
    alarms_text = (tmp_path / "grid" / "alarms.md").read_text()
    assert "From 4 complete runs (1 seeds)" in alarms_text and "| 0.004 | fp8w |" in alarms_text
    assert (tmp_path / "grid" / "alarms.png").exists()


def test_the_shadow_meter_measures_a_native_engine_and_changes_no_training_bit(tmp_path):
    """rollout.shadow=native: a zero-mismatch run logs what a native bf16 engine's mismatch
    would have been on its own tokens, while every other metric stays as without the meter."""
    sets = [*TINY, "steps=2", "rollout.dtype=bfloat16", "train.dtype=bfloat16"]
    plain = config.build({}, sets)
    metered = config.build({}, [*sets, "rollout.shadow=native"])
    runner.run(plain, tmp_path / "plain", cache_dir=tmp_path / "c", progress=False)
    runner.run(metered, tmp_path / "metered", cache_dir=tmp_path / "c", progress=False)
    a, b = rundir.read_metrics(tmp_path / "plain"), rundir.read_metrics(tmp_path / "metered")
    for without, meter in zip(a, b):
        shadow = {k: meter.pop(k) for k in list(meter) if k.startswith("shadow/")}
        assert meter == without  # the meter reaches no training number
        assert set(shadow) == {f"shadow/{n}" for n in runner.SHADOW_METRICS}
        assert shadow["shadow/tokens_unequal_frac"] > 0 and meter["mismatch/k3_kl"] == 0
    # the same check through `same`: weights and optimizer state too, the meter's keys left out
    argv = ["same", str(tmp_path / "plain"), str(tmp_path / "metered")]
    assert main(argv) == 1 and main([*argv, "--ignore", "shadow/"]) == 0


def test_a_forced_replay_on_the_same_model_gives_the_samplers_own_log_probs():
    cfg = config.build({}, TINY)
    master = policy.build_master(cfg.model, 0)
    model = policy.working_copy(master, "float32", "bik")
    prompts = [[1, 4, 5], [1, 6, 7, 8]] * 2
    drift = torch.zeros(master.config.vocab_size)
    first = rollout.sample(model, prompts, cfg.rollout, drift, torch.Generator().manual_seed(3))
    forced = first.sequences[:, first.prompt_width :]
    again = rollout.sample(model, prompts, cfg.rollout, drift, torch.Generator(), forced=forced)
    assert torch.equal(again.sequences, first.sequences)
    assert torch.equal(again.rollout_logp, first.rollout_logp)


def test_the_shadow_meter_needs_the_hf_sampler():
    with pytest.raises(config.ConfigError, match=r"rollout\.shadow=native: .*rollout\.engine=hf"):
        config.build({}, ["rollout.shadow=native", "rollout.engine=vllm", "model.head_dim=32"])


def test_a_batch_gradient_at_fixed_weights_is_repeatable_and_moves_no_weight(tmp_path):
    sets = [*TINY, "rollout.samples_per_prompt=4", "train.entropy_coef=0.01"]  # a gradient always
    cfg = bias.arm_config("zero_mismatch", "fp8w", sets)
    job = runner.Run(cfg, tmp_path / "c")
    before = {k: v.clone() for k, v in job.master.state_dict().items()}
    first, again = bias.batch_gradient(job, 0), bias.batch_gradient(job, 0)
    assert torch.equal(first, again) and first.abs().sum() > 0
    assert all(torch.equal(v, job.master.state_dict()[k]) for k, v in before.items())


def test_the_stale_arm_samples_one_update_behind_every_other_arm(tmp_path):
    """With the stale control every arm's master is the on-policy job's after one update;
    the stale arm's sampler alone still refreshes from the weights before it."""
    sets = [*TINY, "rollout.samples_per_prompt=4", "train.entropy_coef=0.01"]  # a gradient always
    arms = ["on_policy", "fp8w", "stale"]
    jobs = {a: runner.Run(bias.arm_config("zero_mismatch", a, sets), tmp_path / "c") for a in arms}
    start = {k: v.clone() for k, v in jobs["stale"].master.state_dict().items()}
    bias.advance(jobs)
    after = jobs["on_policy"].master.state_dict()
    assert any(not torch.equal(after[k], v) for k, v in start.items())  # one update moved it
    for arm in ("fp8w", "stale"):
        assert all(torch.equal(v, after[k]) for k, v in jobs[arm].master.state_dict().items())
    sampler = jobs["stale"].rollout.master.state_dict()
    assert all(torch.equal(sampler[k], v) for k, v in start.items())
    assert jobs["fp8w"].rollout.master is jobs["fp8w"].master


def test_the_sign_flip_p_finds_a_shifted_mean_and_not_a_symmetric_one():
    noise = torch.randn(40, 30, generator=torch.Generator().manual_seed(0))
    assert bias.sign_flip_p(noise + 1.0, flips=999) == 1 / 1000
    symmetric = torch.cat([noise[:20], -noise[:20]])  # its mean is exactly 0
    assert bias.sign_flip_p(symmetric, flips=999) == 1.0


def test_the_bias_tool_pairs_arms_resumes_and_writes_its_table(tmp_path, capsys):
    argv = ["bias", "--recipe", "zero_mismatch", "--arms", "on_policy,fp8w", "--out"]
    argv += [str(tmp_path / "b"), "--cache-dir", str(tmp_path / "c")]
    argv += [x for s in [*TINY, "rollout.samples_per_prompt=4"] for x in ("--set", s)]
    argv += ["--threads", str(torch.get_num_threads())]  # leaves this process's count as it is
    assert main([*argv, "--batches", "2"]) == 0
    assert main([*argv, "--batches", "3"]) == 0  # resumes at batch 2
    text = (tmp_path / "b" / "bias.md").read_text()
    assert text.startswith("3 batches an arm, paired against on_policy")
    assert "| fp8w |" in text
    rows = (tmp_path / "b" / bias.BATCHES.format(arm="fp8w")).stat().st_size // 4
    assert rows % 3 == 0 and rows > 0  # 3 batches of the flat gradient's size, none twice
    assert re.search(r"\| fp8w \|.*\| [01]\.\d{4} \|$", text, re.MULTILINE)  # its sign-flip p
    with pytest.raises(SystemExit):
        main([*argv[:4], "fp8w,on_policy", *argv[5:], "--batches", "3"])
    assert "expected on_policy first" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--batches", "3", "--threads", "0"])
    assert "bias --threads: expected an integer >= 1" in capsys.readouterr().err
