"""rl_harness end to end on tiny configs: zero mismatch, every source, determinism, resume."""

import copy
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from rl_helpers import TINY as RL_TINY
from rl_helpers import (
    resumed_equals_uninterrupted,
    run_metrics,
    tiny_model_dir,
    updates_of_each_step,
)

from rl_harness import config, policy, rundir, runner, trainer
from rl_harness.logits import round_mantissa

TINY = [*RL_TINY, "steps=3"]


def _run(tmp_path, cache, name, sets=()):
    return run_metrics(tmp_path, cache, name, [*TINY, *sets])


def test_zero_mismatch_holds_with_top_k_top_p_and_temperature(tmp_path, cache):
    history = _run(
        tmp_path,
        cache,
        "filtered",
        ["rollout.top_k=8", "rollout.top_p=0.9", "rollout.temperature=0.7", "steps=2"],
    )
    assert all(m["mismatch/tokens_unequal_count"] == 0 for m in history)
    # A finished row's PAD tokens can fall outside the top-k set (log-prob -inf); that used
    # to make the masked loss NaN, so no update was ever applied.
    for m in history:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]), m
        assert m["update_applied"] == 1 and math.isfinite(m["mismatch/log_ppl_abs_diff"])


def test_zero_mismatch_is_exactly_zero_every_step(tmp_path, cache):
    history = _run(tmp_path, cache, "zero")
    assert [m["step"] for m in history] == [0, 1, 2]
    for m in history:
        assert m["mismatch/tokens_unequal_frac"] == 0.0 and m["mismatch/k3_kl"] == 0.0
        assert m["mismatch/logprob_abs_diff_max"] == 0.0 and m["mismatch/chi2_seq"] == 0.0
    for key in (
        "reward/mean",
        "response_length/mean",
        "grad_norm",
        "entropy",
        "lr",
        "mismatch/is_ess",
        "remedy/masked_frac",
        "ppo/clip_frac",
        "collapse/reward_drop",
    ):
        assert key in history[0]
    assert (tmp_path / "zero" / "summary.md").exists() and (
        tmp_path / "zero" / "metrics.png"
    ).exists()
    assert json.loads((tmp_path / "zero" / "config.json").read_text())["steps"] == 3


@pytest.mark.parametrize(
    "source",
    [
        ["rollout.kernels=native"],
        ["rollout.dtype=bfloat16"],
        [
            "task.name=sorting",
            "task.max_digits=4",
            "rollout.max_new_tokens=24",
            "rollout.split_size=32",
        ],
        [
            "rollout.kernels=native",
            "train.kernels=native",
            "train.micro_batch_size=3",
            "rollout.prompts=8",
        ],
        ["rollout.logit_noise_std=0.1"],
        ["rollout.logit_noise_bias=0.5"],
        ["rollout.logit_round_bits=7"],
        ["rollout.weight_round_bits=3"],
    ],
)
def test_each_mismatch_source_gives_nonzero_mismatch(tmp_path, cache, source):
    history = _run(tmp_path, cache, "source", source + ["steps=1"])
    assert history[0]["mismatch/tokens_unequal_frac"] > 0
    assert history[0]["mismatch/logprob_abs_diff_max"] > 0


def test_same_seed_gives_identical_metrics(tmp_path, cache):
    assert _run(tmp_path, cache, "a", ["rollout.logit_noise_std=0.1"]) == _run(
        tmp_path, cache, "b", ["rollout.logit_noise_std=0.1"]
    )


def test_resume_equals_an_uninterrupted_run(tmp_path, cache, monkeypatch):
    sets = ["steps=5", "rollout.logit_noise_bias=0.3", "lr_schedule.name=length_surge"]
    resumed_equals_uninterrupted(tmp_path, cache, monkeypatch, [*TINY, *sets])


def test_resume_with_steps_extends_the_run_to_the_new_total(tmp_path, cache):
    """Issue 11, item 10: ``--resume DIR --steps N`` used to be silently ignored."""
    sets = ["rollout.logit_noise_bias=0.3"]
    full = _run(tmp_path, cache, "full", sets + ["steps=4"])
    _run(tmp_path, cache, "short", sets + ["steps=2"])
    runner.resume(tmp_path / "short", steps=4, cache_dir=cache, progress=False)
    assert runner.read_metrics(tmp_path / "short") == full
    assert config.load(tmp_path / "short" / "config.json").steps == 4


def test_keep_policies_keeps_the_policy_of_every_checkpoint_and_changes_no_metric(tmp_path, cache):
    """--keep-policies (checkpoint_every=2, 3 steps): the policy after step 1 (a 2-step run's
    last checkpoint) and after step 2 (this run's); the metrics are those of a run without."""
    cfg = config.build({}, [*TINY])
    runner.run(cfg, tmp_path / "kept", cache_dir=cache, progress=False, keep_policies=True)
    kept = runner.read_metrics(tmp_path / "kept")
    assert kept == _run(tmp_path, cache, "plain")
    files = sorted((tmp_path / "kept" / rundir.POLICIES).iterdir())
    assert [f.name for f in files] == ["step1.pt", "step2.pt"]
    last = torch.load(rundir.policy_path(tmp_path / "kept", 2), weights_only=True)
    checkpoint = torch.load(tmp_path / "kept" / rundir.CHECKPOINT, weights_only=True)
    assert last["step"] == 2 and last["master"].keys() == checkpoint["master"].keys()
    assert all(torch.equal(v, checkpoint["master"][k]) for k, v in last["master"].items())
    first = torch.load(rundir.policy_path(tmp_path / "kept", 1), weights_only=True)["master"]
    _run(tmp_path, cache, "two", ["steps=2"])  # its checkpoint: the policy after step 1
    after_one = torch.load(tmp_path / "two" / rundir.CHECKPOINT, weights_only=True)["master"]
    assert all(torch.equal(v, after_one[k]) for k, v in first.items())


def test_resume_drops_a_torn_last_line(tmp_path, cache):
    """Issue 11, item 13: a crash in the middle of a metrics line must not break resume."""
    full = _run(tmp_path, cache, "full", ["steps=3"])
    _run(tmp_path, cache, "torn", ["steps=2"])
    with (tmp_path / "torn" / "metrics.jsonl").open("a") as log:
        log.write(json.dumps(full[2])[:40])  # step 2's line, cut off by a crash
    with pytest.warns(UserWarning, match="torn last line"):
        runner.resume(tmp_path / "torn", steps=3, cache_dir=cache, progress=False)
    assert runner.read_metrics(tmp_path / "torn") == full


def test_warmup_cache_is_keyed_by_the_model_files_not_the_path(tmp_path):
    """Issue 11, item 10: new weights written to the same directory reused a stale warm-up."""
    tiny_model_dir(tmp_path / "model", seed=1)
    cfg = config.build({}, TINY + ["warmup.steps=1", f"model.path={tmp_path / 'model'}"])
    first = policy.warmup_cache_path(cfg, tmp_path / "cache")
    assert policy.warmup_cache_path(cfg, tmp_path / "cache") == first
    tiny_model_dir(tmp_path / "model", seed=2)  # new weights, same directory
    assert policy.warmup_cache_path(cfg, tmp_path / "cache") != first
    default = config.build({}, TINY)
    assert policy.warmup_cache_path(default, "c") == policy.warmup_cache_path(default, "c")


def test_warmup_cache_is_written_atomically(tmp_path, monkeypatch):
    """Issue 11, item 13: a crash while saving the warm-up left a truncated cache file."""
    cfg = config.build({}, TINY + ["warmup.steps=1"])
    master = policy.build_master(cfg.model, cfg.seed)
    save = torch.save

    def crash_half_way(obj, path):
        save({"half": torch.zeros(1)}, path)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash_half_way)
    with pytest.raises(KeyboardInterrupt):
        policy.warmup(master, cfg, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.setattr(torch, "save", save)
    path = policy.warmup(master, cfg, tmp_path / "cache")
    assert set(torch.load(path)) == set(master.state_dict())


def test_weight_rounding_rounds_the_rollout_copys_linear_weights_only():
    torch.manual_seed(0)
    master = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    work = copy.deepcopy(master)
    policy.refresh(work, master, weight_round_bits=3)
    linear, norm = master[0], master[1]
    assert torch.equal(work[0].weight, round_mantissa(linear.weight, 3))
    assert not torch.equal(work[0].weight, linear.weight)
    assert torch.equal(work[0].bias, linear.bias) and torch.equal(work[1].weight, norm.weight)
    mantissa, _ = torch.frexp(work[0].weight)
    assert torch.equal(mantissa * 8, torch.round(mantissa * 8))  # 3 bits: multiples of 1/8
    policy.refresh(work, master)  # 0 bits: an exact copy again
    assert all(torch.equal(w, m) for w, m in zip(work.parameters(), master.parameters()))


# Enough warm-up that some groups' rewards differ, so the PPO updates move the policy.
PPO = ["warmup.steps=150", "rollout.samples_per_prompt=4", "train.lr=1e-2"]


def test_ppo_epochs_and_mini_batches(tmp_path, cache, monkeypatch):
    """2 epochs x 2 mini-batches: the first update's forward of its rows equals the batch
    forward bit for bit (batch invariance), so its ratio is exactly 1; later ones move."""
    forward, original = trainer.token_logprobs_and_entropy, trainer.Learner.update
    seen = []

    def spy_forward(model, batch, *args):
        logp, entropy = forward(model, batch, *args)
        seen.append(logp.detach().clone())
        return logp, entropy

    def spy_update(self, *args):
        seen.clear()
        out = original(self, *args)
        size = out.batch.sequences.shape[0] // 2
        assert torch.equal(seen[0], out.batch.train_logp[:size])  # mini-batch 0, epoch 0
        return out

    updates = updates_of_each_step(monkeypatch)
    monkeypatch.setattr(trainer, "token_logprobs_and_entropy", spy_forward)
    monkeypatch.setattr(trainer.Learner, "update", spy_update)
    sets = PPO + ["steps=2", "train.ppo_epochs=2", "train.mini_batches=2"]
    history = _run(tmp_path, cache, "ppo", sets)
    assert [len(u) for u in updates] == [4, 4]
    for step, m in zip(updates, history):
        first = step[0]
        assert first["ppo/ratio_max"] == first["ppo/ratio_min"] == 1.0
        assert first["ppo/clip_frac"] == 0.0
        assert m["update_applied"] == 4 and m["grad_norm_max"] == max(u["grad_norm"] for u in step)
        assert m["grad_norm"] == pytest.approx(sum(u["grad_norm"] for u in step) / 4)
        assert m["ppo/clip_frac"] == pytest.approx(sum(u["ppo/clip_frac"] for u in step) / 4)
        assert m["loss"] == pytest.approx(sum(u["loss"] for u in step) / 4)
        assert m["ppo/ratio_max"] == max(u["ppo/ratio_max"] for u in step)
        assert m["mismatch/logprob_abs_diff_max"] == 0.0  # pi_old: the batch forward, as before
    later = [u for step in updates for u in step[1:]]
    assert any(u["ppo/clip_frac"] > 0 or u["ppo/ratio_max"] != 1.0 for u in later)


def test_ppo_resume_equals_an_uninterrupted_run(tmp_path, cache, monkeypatch):
    sets = PPO + [
        "steps=4",
        "train.ppo_epochs=2",
        "train.mini_batches=2",
        "train.loss_agg=seq_mean_token_sum_norm",
    ]
    full = resumed_equals_uninterrupted(tmp_path, cache, monkeypatch, [*TINY, *sets])
    assert any(m["grad_norm"] > 0 for m in full) and all(m["update_applied"] == 4 for m in full)


WARMUP_BITS = """
import hashlib, sys, tempfile
import torch
from rl_harness import config, policy
cfg = config.build({}, sys.argv[1:])
master = policy.build_master(cfg.model, policy.warmup_seed(cfg))
policy.warmup(master, cfg, tempfile.mkdtemp())
digest = hashlib.sha256()
for name, tensor in sorted(master.state_dict().items()):
    digest.update(name.encode() + tensor.numpy().tobytes())
print(torch.get_num_threads(), digest.hexdigest())
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_warmup_has_the_same_bits_on_one_thread_and_on_two():
    """Issue 72, item 11: the warm-up trains through bik (warmup.kernels=bik, the default),
    whose backward recomputes on one thread, so a config names one warm-up, and one run,
    on any thread count. Long sequences (iterate, 10-20 digits): torch would split their
    reductions by thread."""
    sets = [
        "model.hidden_size=64",
        "model.head_dim=16",
        "task.name=iterate",
        "task.min_digits=10",
        "task.max_digits=20",
        "warmup.long_form_share=0.3",
        "warmup.steps=3",
    ]
    digests = set()
    for threads in ("1", "2"):
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        done = subprocess.run(
            [sys.executable, "-c", WARMUP_BITS, *sets],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        count, digest = done.stdout.split()
        assert count == threads
        digests.add(digest)
    assert len(digests) == 1
