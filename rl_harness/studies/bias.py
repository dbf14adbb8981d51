"""The gradient bias of a mismatch at fixed weights: does a mismatched rollout move the
expected policy gradient, and by how much against the sampling noise?

``python -m rl_harness bias --recipe edge --arms on_policy,bf16,fp8w,bf16_tis --batches 200
--out DIR`` holds the policy at the recipe's warm-up weights (no update is applied) and, for
batch b = 0, 1, ..., draws one rollout batch per arm from the same prompts and sampling seed
(coupled: the arms part only where the mismatch changes a token), scores it with the trainer
and takes the gradient of the recipe's policy-gradient loss. Each arm's mean gradient is
compared with the on-policy arm's, paired batch by batch:

- ``bias``: the norm of the mean paired difference, relative to the on-policy mean
  gradient's norm;
- ``z``: that norm over its noise, the square root of the summed per-coordinate variances of
  the mean difference (about 1 with no bias, growing as sqrt(batches) with a real one);
- ``cosine``: between the arm's and the on-policy mean gradients.

The arms (:data:`ARMS`) are the recipe with the stability-edge doses (rl_harness.studies.edge) and
remedies, and a stale-sampler control: with ``stale`` among them every arm is measured after
one on-policy update and ``stale`` samples with the weights before it (:func:`advance`). The
running sums are saved to ``DIR/state.pt`` every :data:`SAVE_EVERY` batches, so a cut run
resumes where it stopped; ``DIR/bias.md`` is the table.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from .. import config as config_lib
from .. import engines, losses, recipes, rundir, runner, sweep, tasks
from ..errors import HarnessError
from . import edge

# arm -> (its dose of rl_harness.studies.edge.DOSES, extra overrides)
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "on_policy": ("zero", {}),
    "bf16": ("bf16", {}),
    "fp8w": ("fp8w", {}),
    "bf16_tis": ("bf16", {"remedy.name": "token_tis"}),
    "fp8w_tis": ("fp8w", {"remedy.name": "token_tis"}),
    "stale": ("zero", {}),  # the on-policy arm's sampler one update behind (:func:`advance`)
}
STALE = "stale"
SAVE_EVERY = 10
STATE = "state.pt"
BATCHES = "batches_{arm}.f32"  # an arm's per-batch paired differences (sign_flip_p)
SIGN_FLIPS = 10_000  # random sign vectors of the sign-flip null


def arm_config(recipe: str, arm: str, sets: list[str]) -> config_lib.Config:
    dose, extra = ARMS[arm]
    overrides = {**recipes.overrides(recipe), **edge.DOSES[dose][1], **extra}
    cfg = config_lib.build(overrides, sets)
    return sweep.twin(cfg) if dose == "zero" else cfg


def batch_gradient(job: runner.Run, batch_index: int) -> torch.Tensor:
    """The flat fp32 gradient of the policy-gradient loss of one rollout batch at the job's
    current (fixed) weights; its prompts and sampling seed depend on ``batch_index`` only."""
    cfg = job.cfg
    prompts, examples = tasks.prompt_batch(cfg, random.Random(f"bias-{batch_index}"))
    rows = slice(0, len(prompts))
    share = job.rollout.sample(prompts, 7_000_003 + batch_index, rows)
    scored = job.learner.score(share, rows)
    rewards = job.rewards(scored.batch, examples, share.prompt_width)
    adv = losses.advantages(rewards, cfg.rollout.samples_per_prompt, cfg.train.advantage)
    prepared = losses.prepare(scored.batch, adv, cfg)
    loss, _ = losses.policy_loss(scored.logp, prepared, cfg, rows, scored.entropy)
    model = job.learner.model
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat(
        [
            torch.zeros(p.numel()) if p.grad is None else p.grad.float().flatten()
            for p in model.parameters()
        ]
    )


def advance(jobs: dict[str, runner.Run]) -> None:
    """One on-policy update for every arm (the on-policy job's step 0 from the warm-up weights
    theta_0, copied into every master: theta_1), the stale arm's sampler left at theta_0: the
    control of a sampler one update behind the trainer, as asynchronous RL runs it."""
    reference = jobs["on_policy"]
    before = copy.deepcopy(reference.master)
    reference.step(0)
    for arm, job in jobs.items():
        if job is not reference:
            job.master.load_state_dict(reference.master.state_dict())
        if arm == STALE:
            if not isinstance(job.rollout, engines.HfRollout):
                raise HarnessError("bias: the stale arm needs rollout.engine=hf")
            job.rollout.master = before  # the sampler refreshes from theta_0


class Sums:
    """Running sums of vectors in float64: their count, sum and sum of squares."""

    def __init__(self, size: int) -> None:
        self.n = 0
        self.total = torch.zeros(size, dtype=torch.float64)
        self.squares = torch.zeros(size, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:
        x = x.double()
        self.n += 1
        self.total += x
        self.squares += x * x

    def mean(self) -> torch.Tensor:
        return self.total / max(self.n, 1)

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "total": self.total, "squares": self.squares}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Sums:
        sums = cls(values["total"].numel())
        sums.n, sums.total, sums.squares = values["n"], values["total"], values["squares"]
        return sums

    def variance_of_mean(self) -> torch.Tensor:
        """Per coordinate: the sample variance over the n vectors, divided by n."""
        mean = self.mean()
        var = (self.squares - self.n * mean * mean) / max(self.n - 1, 1)
        return var.clamp(min=0) / max(self.n, 1)


def _save(path: Path, arms: list[str], done: int, sums: dict, diffs: dict) -> None:
    state = {
        "arms": arms,
        "done": done,
        "sums": {a: s.to_dict() for a, s in sums.items()},
        "diffs": {a: s.to_dict() for a, s in diffs.items()},
    }
    rundir.write_atomic(path, lambda tmp: torch.save(state, tmp))


def run(
    recipe: str,
    arms: list[str],
    batches: int,
    out: Path,
    sets: list[str],
    cache_dir: str | Path,
) -> tuple[int, dict[str, Sums], dict[str, Sums]]:
    """Every arm's gradient on batches 0..batches-1, resuming from ``out/state.pt``; returns
    the batches done, each arm's sums and each arm's paired-difference sums."""
    # progress: a warm-up that is not cached yet trains first, minutes of it on the edge recipe
    jobs = {
        arm: runner.Run(arm_config(recipe, arm, sets), cache_dir, progress=True) for arm in arms
    }
    if STALE in arms:
        advance(jobs)
    size = sum(p.numel() for p in jobs[arms[0]].learner.model.parameters())
    path = out / STATE
    sums = {a: Sums(size) for a in arms}
    diffs = {a: Sums(size) for a in arms[1:]}
    done = 0
    if path.exists():
        state = torch.load(path, weights_only=True)
        if state["arms"] != arms:
            raise HarnessError(f"bias: {path} holds the arms {state['arms']}, not {arms}")
        done = state["done"]
        sums = {a: Sums.from_dict(v) for a, v in state["sums"].items()}
        diffs = {a: Sums.from_dict(v) for a, v in state["diffs"].items()}
    rows = {arm: _batch_rows(out / BATCHES.format(arm=arm), done, size) for arm in arms[1:]}
    first, started = done, time.time()
    for b in range(first, batches):
        grads = {arm: batch_gradient(job, b) for arm, job in jobs.items()}
        for arm, g in grads.items():
            sums[arm].add(g)
            if arm != arms[0]:
                diffs[arm].add(g - grads[arms[0]])
                _append_row(rows[arm], g - grads[arms[0]])
        done = b + 1
        if done % SAVE_EVERY == 0 or done == batches:
            _save(path, arms, done, sums, diffs)
        rate = (time.time() - started) / (done - first)
        print(f"\rbias: batch {done}/{batches} ({rate:.1f} s a batch)", end="", flush=True)
    print(flush=True)
    for job in jobs.values():
        job.close()
    return done, sums, diffs


def _batch_rows(path: Path, done: int, size: int) -> Path | None:
    """The arm's file of per-batch differences, cut back to the ``done`` batches the state
    holds (a cut run may have written rows past its last save); None (with a warning: the
    sign-flip p will be missing) where it holds fewer, as a run begun without it does."""
    have = path.stat().st_size if path.exists() else 0
    if have < done * size * 4:
        print(f"bias: {path.name} holds fewer than {done} batches: no sign-flip p for it")
        path.unlink(missing_ok=True)
        return None
    with path.open("ab") as handle:
        handle.truncate(done * size * 4)
    return path


def _append_row(path: Path | None, difference: torch.Tensor) -> None:
    if path is not None:
        with path.open("ab") as handle:
            handle.write(difference.float().numpy().tobytes())


def sign_flip_p(rows: torch.Tensor, flips: int = SIGN_FLIPS, seed: int = 0) -> float:
    """The sign-flip p of the mean of ``rows`` (n paired differences, one a row) being 0:
    the share of random sign vectors s, the observed one counted, with |sum_b s_b d_b|^2 =
    s' G s (G the rows' Gram matrix) at least the observed |sum_b d_b|^2. Valid when each
    difference is symmetric about 0 under no bias, as coupled pairs of exchangeable arms are."""
    d = rows.double()
    gram = d @ d.T
    observed = float(gram.sum())
    rng = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (flips, d.shape[0]), generator=rng).double() * 2 - 1
    null = ((signs @ gram) * signs).sum(dim=1)
    return (1 + int((null >= observed).sum())) / (1 + flips)


def _sign_flip_cell(out: Path | None, arm: str, done: int, size: int) -> str:
    """The table's sign-flip p from the arm's rows ("-" where they are missing)."""
    path = None if out is None else out / BATCHES.format(arm=arm)
    if path is None or not path.exists() or path.stat().st_size != done * size * 4:
        return "-"
    rows = torch.from_file(str(path), size=done * size, dtype=torch.float32).view(done, size)
    return f"{sign_flip_p(rows):.4f}"


def table(done: int, sums: dict[str, Sums], diffs: dict[str, Sums], out: Path | None = None) -> str:
    arms = list(sums)
    base = sums[arms[0]].mean()
    lines = [
        f"{done} batches an arm, paired against {arms[0]} (same prompts and seeds):",
        *(
            [f"every arm after one on-policy update; {STALE} samples with the weights before it"]
            if STALE in arms
            else []
        ),
        "",
        "| arm | bias (relative to the on-policy gradient) | z (bias / its noise) | cosine | "
        f"sign-flip p ({SIGN_FLIPS} flips) |",
        "|---|---:|---:|---:|---:|",
    ]
    for arm in arms[1:]:
        norm = float(diffs[arm].mean().norm())
        noise = math.sqrt(float(diffs[arm].variance_of_mean().sum()))
        cosine = float(torch.nn.functional.cosine_similarity(sums[arm].mean(), base, dim=0))
        relative = norm / max(float(base.norm()), 1e-30)
        z = norm / noise if noise else (math.inf if norm else 0.0)  # no difference at all: 0
        flip = _sign_flip_cell(out, arm, done, base.numel())
        lines.append(f"| {arm} | {relative:.3g} | {z:.2f} | {cosine:.4f} | {flip} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="edge", help="the base recipe (default edge)")
    parser.add_argument(
        "--arms",
        default="on_policy,bf16,fp8w,bf16_tis",
        help=f"first on_policy; of {', '.join(ARMS)}",
    )
    parser.add_argument("--batches", type=int, default=200, help="rollout batches per arm")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, every arm")
    parser.add_argument("--out", required=True, help="a directory for the state and the table")
    parser.add_argument("--cache-dir", default=".cache/rl_harness", help="warm-up checkpoints")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1, as every edge grid run: the warm-up's bits, and so the "
        "weights measured at, depend on the thread count)",
    )


def main(args: argparse.Namespace) -> int:
    arms = args.arms.split(",")
    if arms[0] != "on_policy" or len(set(arms)) != len(arms) or not set(arms) <= set(ARMS):
        raise HarnessError(
            f"bias --arms: expected on_policy first, then distinct arms of {', '.join(ARMS)}; "
            f"got {args.arms}"
        )
    if args.batches < 2:
        raise HarnessError(f"bias --batches: expected an integer >= 2, got {args.batches}")
    if args.threads < 1:
        raise HarnessError(f"bias --threads: expected an integer >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    out = rundir.resolved(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(*run(args.recipe, arms, args.batches, out, args.set or [], args.cache_dir), out)
    rundir.write_atomic(out / "bias.md", text)
    print(text)
    return 0
