"""rl_harness data-parallel on 2 gloo processes against the same runs in one process.

One spawn runs every configuration on 2 ranks through ``runner.run`` (the ranks' results are
read back here); then ``torchrun`` runs the command line, with ``--resume``. Checked:
  step 0      the whole batch (tokens, masks, rollout and trainer log-probs, entropy) and every
              logged metric but grad_norm equal the single process's, bit for bit
  weights     both ranks hold the same weights after every step; they differ from the single
              process's only slightly (the gradient is reduced as two per-rank partial sums)
  files       rank 1 writes nothing; the run directory is the single-process one's
  assertion   a mismatch on one rank stops every rank with the zero-mismatch error
  command     torchrun + ``python -m rl_harness run``, then ``--resume --steps``, gives the
              spawned run's metrics
  report      ``python -m rl_harness world-size``'s trace and markdown report
"""

import json
import os
import pathlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rl_helpers import TINY as RL_TINY

from rl_harness import config, policy, report, rundir, runner, trainer, world_size
from rl_harness.distributed import World

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
TINY = [*RL_TINY, "steps=2"]
CONFIGS = {
    # bik on both sides: every step asserts zero mismatch; filtered sampling leaves zeros in
    # the probabilities the shares draw from.
    "zero": TINY + ["rollout.top_k=8", "rollout.top_p=0.9", "rollout.temperature=0.7"],
    # 3 prompts: shares of 1 and 2 prompts; logit noise drawn for the whole batch; remedy
    # weights normalised over the whole batch; RLOO advantages within each prompt's group.
    "noise": TINY
    + [
        "rollout.prompts=3",
        "rollout.logit_noise_std=0.1",
        "remedy.name=token_tis",
        "remedy.self_normalize=true",
        "train.advantage=rloo",
    ],
    # A Qwen3-MoE policy: each rank records its share's routing on both sides; shares of 1
    # and 2 prompts, padded to the batch's longest response, gather into the whole batch's.
    "moe": TINY + ["model.family=qwen3_moe", "warmup.steps=4", "rollout.prompts=3"],
}
MOE_KEYS = {"rollout_routing", "train_routing"}
RUN_FILES = {"config.json", "metrics.jsonl", "checkpoint.pt", "summary.md", "metrics.png"}


def _run(name, out, cache):
    """``runner.run`` of CONFIGS[name]; returns step 0's whole batch and each step's weights."""
    captured = {"weights": []}
    step = runner.Run.step

    def capture(self, i):
        record = step(self, i)
        if i == 0:
            captured["batch0"] = record.batch.tensors()
        captured["weights"].append({k: v.clone() for k, v in self.master.state_dict().items()})
        return record

    runner.Run.step = capture
    try:
        cfg = config.build({}, CONFIGS[name])
        runner.run(cfg, out, cache_dir=cache, progress=False, name=name)
    finally:
        runner.Run.step = step
    return captured


def _spy_on_writes(writes):
    """Record every path this process writes through the run directory's writers."""
    write_atomic, open_path = rundir.write_atomic, pathlib.Path.open

    def spy_write(path, data):
        writes.append(str(path))
        return write_atomic(path, data)

    def spy_open(self, mode="r", *args, **kwargs):
        if set(mode) & set("wax+"):
            writes.append(str(self))
        return open_path(self, mode, *args, **kwargs)

    for module in (rundir, report, policy):
        module.write_atomic = spy_write
    pathlib.Path.open = spy_open


def _sabotage():
    """Rank 1's trainer log-probs off by 1e-6 on every response token."""
    forward = trainer.token_logprobs_and_entropy

    def off(model, batch, *args):
        logp, entropy = forward(model, batch, *args)
        return logp + 1e-6 * batch.response_mask, entropy

    trainer.token_logprobs_and_entropy = off


def _rank(rank, world, tmp, cache):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        writes = []
        _spy_on_writes(writes)
        results = {name: _run(name, f"{tmp}/{name}", cache) for name in CONFIGS}
        if rank == 1:
            _sabotage()
        try:
            _run("zero", f"{tmp}/sabotaged", cache)
            results["error"] = None
        except RuntimeError as error:
            results["error"] = str(error)
        results["writes"] = writes
        torch.save(results, f"{tmp}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def single(cache, tmp_path_factory):
    """Every config in this process (which also fills the warm-up cache the ranks read)."""
    tmp = tmp_path_factory.mktemp("single")
    return {name: (_run(name, tmp / name, cache), tmp / name) for name in CONFIGS}


@pytest.fixture(scope="module")
def ranks(single, cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranks")
    mp.spawn(_rank, args=(WORLD, str(tmp), str(cache)), nprocs=WORLD)
    return tmp, [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("name", CONFIGS)
def test_step_0_batch_is_the_single_process_batch_bit_for_bit(single, ranks, name):
    expected = single[name][0]["batch0"]
    assert set(expected) == {
        "sequences",
        "attention_mask",
        "response_mask",
        "rollout_logp",
        "train_logp",
        "entropy",
        *(MOE_KEYS if name == "moe" else ()),
    }
    for rank, result in enumerate(ranks[1]):
        for key, tensor in result[name]["batch0"].items():
            assert tensor.dtype == expected[key].dtype, (rank, key)
            assert torch.equal(tensor, expected[key]), f"rank {rank} {name}: {key} differs"


@pytest.mark.parametrize("name", CONFIGS)
def test_step_0_metrics_are_the_single_process_metrics(single, ranks, name):
    one = runner.read_metrics(single[name][1])
    two = runner.read_metrics(ranks[0] / name)
    assert [m["step"] for m in two] == [m["step"] for m in one] == [0, 1]
    if name in ("zero", "moe"):
        assert all(m["mismatch/tokens_unequal_count"] == 0 for m in two)
    if name == "moe":
        assert all(m["mismatch/routing_flip_count"] == 0 for m in two)
    # The gradient sums two per-rank partial sums: its norm may differ in the last bits.
    assert one[0]["grad_norm"] == pytest.approx(two[0]["grad_norm"], rel=1e-5)
    assert {k: v for k, v in one[0].items() if k != "grad_norm"} == {
        k: v for k, v in two[0].items() if k != "grad_norm"
    }


@pytest.mark.parametrize("name", CONFIGS)
def test_ranks_hold_the_same_weights(single, ranks, name):
    first, second = (result[name]["weights"] for result in ranks[1])
    alone = single[name][0]["weights"]
    for step, (a, b, c) in enumerate(zip(first, second, alone)):
        for key in a:
            assert torch.equal(a[key], b[key]), f"step {step} {key}: ranks disagree"
            # not bit-identical to one process: a bound on the drift, not a promise
            assert (a[key] - c[key]).abs().max() < 1e-4, f"step {step} {key}"


def test_only_rank_0_writes(ranks):
    tmp, results = ranks
    assert results[1]["writes"] == []
    for name in CONFIGS:
        assert {p.name for p in (tmp / name).iterdir()} == RUN_FILES
    assert {Path(p).parent.name for p in results[0]["writes"]} == {*CONFIGS, "sabotaged"}


def test_config_and_summary_record_the_world_size(single, ranks):
    """Issue 25, item 17: a torchrun run's config.json and summary did not say how many
    processes made it (its gradients differ from a one-process run's)."""
    tmp, _ = ranks
    for name in CONFIGS:
        for run_dir, size in ((single[name][1], 1), (tmp / name, 2)):
            assert json.loads((run_dir / "config.json").read_text())["world_size"] == size
            assert f"- processes: {size} (data-parallel" in (run_dir / "summary.md").read_text()


def test_zero_mismatch_is_asserted_on_every_rank(ranks):
    for rank, result in enumerate(ranks[1]):
        error = result["error"]
        assert error is not None, f"rank {rank} did not stop"
        assert f"step 0 (rank {rank} of 2): a zero-mismatch run measured a mismatch" in error


def _torchrun(*args):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(WORLD), "-m", "rl_harness", "run", *map(str, args)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # the spawned 2-rank tests check the same data-parallel bits
def test_torchrun_command_line_and_resume(ranks, cache, tmp_path):
    """The command line under torchrun gives the spawned ranks' run; ``--resume`` continues
    it with torchrun too, as an uninterrupted run."""
    sets = [arg for s in CONFIGS["zero"] for arg in ("--set", s)]
    out = tmp_path / "run"
    stdout = _torchrun("--out", out, "--cache-dir", cache, *sets, "--steps", 1)
    assert stdout.count("# zero_mismatch") == 1  # the summary, printed by rank 0 only
    assert [m["step"] for m in runner.read_metrics(out)] == [0]
    _torchrun("--resume", out, "--steps", 2, "--cache-dir", cache)
    assert {p.name for p in out.iterdir()} == RUN_FILES
    assert runner.read_metrics(out) == runner.read_metrics(ranks[0] / "zero")


def test_world_size_report(single, cache):
    """``python -m rl_harness world-size``'s trace and report (in one process; the module
    spawns the ranks as the fixture above does)."""
    one = world_size.trace(config.build({}, CONFIGS["zero"]), cache, World())
    assert torch.equal(one["batch0"]["train_logp"], single["zero"][0]["batch0"]["train_logp"])
    text = world_size.report(one, one, WORLD, "zero")
    assert "step 0, bit-identical: sequences yes" in text and "NO" not in text
    assert "metrics differ: none" in text and "tokens differ: none (0 of 2 steps" in text
    other = {
        **one,
        "grad0": one["grad0"] + 1e-7,
        "sequences": [one["sequences"][0], one["sequences"][1] + 1],
    }
    other["metrics"] = [one["metrics"][0], {**one["metrics"][1], "grad_norm": -1.0}]
    text = world_size.report(one, other, WORLD, "zero")
    assert f"{one['grad0'].numel()} of {one['grad0'].numel()} elements differ" in text
    assert "metrics differ: 1 (grad_norm)" in text and "tokens differ: 1 (1 of 2 steps" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world", "1"], "world-size --world: expected an integer >= 2, got 1"),
        (["--world", "4", "--set", "rollout.prompts=2"], "rollout.prompts: expected at least"),
        (["--out", "{tmp}"], "is a directory; pass a file name"),
        (["--out", "{tmp}/nosuch/report.md"], "world-size --out: no directory"),
    ],
)
def test_world_size_checks_its_arguments_before_tracing(
    argv, message, tmp_path, capsys, monkeypatch
):
    """Issue 42, item 10: --world and --out were checked only after both traces ran."""
    from rl_harness.__main__ import main

    def never(*_, **__):
        raise AssertionError("traced before the arguments were checked")

    monkeypatch.setattr(world_size, "trace", never)
    monkeypatch.setattr(world_size, "spawn_trace", never)
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(["world-size", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
