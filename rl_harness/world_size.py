"""What data parallelism changes in a run: the same config at world size 1 and on W gloo
processes, compared step by step.

    python -m rl_harness world-size [--recipe NAME] [--steps N] [--world W] [--set KEY=VALUE]
                                   [--cache-dir DIR] [--out FILE]

Runs the config's steps with the harness's own step (runner.Run) in this process, then on W
spawned processes (one thread each, as torchrun sets), and prints a markdown report: whether
step 0's rollout (tokens, rollout log-probs) and trainer log-probs are bit-identical, how much
the gradient AdamW receives at step 0 and the weights after k steps differ, the first step
whose sampled tokens differ, and both reward curves. No run directory is written.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import config as config_lib
from . import recipes, rundir, runner
from .config import Config
from .distributed import World
from .errors import HarnessError, RunDirError
from .report import machine

WEIGHT_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _grad(parameter: torch.Tensor) -> torch.Tensor:
    if parameter.grad is None:
        raise RuntimeError("a master parameter has no gradient after step 0")
    return parameter.grad


def trace(cfg: Config, cache_dir: str | Path, world: World | None = None) -> dict[str, Any]:
    """Run ``cfg`` for ``cfg.steps`` steps without a run directory and return per step the
    metrics and the sampled sequences; step 0's whole batch and the gradient AdamW received
    (clipped, fp32, flattened); the flattened master weights after each of WEIGHT_STEPS."""
    job = runner.Run(cfg, cache_dir, None, world)
    out: dict[str, Any] = {"metrics": [], "sequences": [], "weights": {}}
    with contextlib.closing(job):
        for step in range(cfg.steps):
            record = job.step(step)
            out["metrics"].append(record.metrics)
            out["sequences"].append(record.batch.sequences.clone())
            if step == 0:
                out["batch0"] = {k: v.detach().clone() for k, v in record.batch.tensors().items()}
                out["grad0"] = _flat([_grad(p) for p in job.master.parameters()])
            if step + 1 in WEIGHT_STEPS or step + 1 == cfg.steps:
                out["weights"][step + 1] = _flat(list(job.master.parameters()))
    return out


def _rank(rank: int, world: int, store: str, cfg: Config, cache_dir: str, path: str) -> None:
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1; bik's bits ignore it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = trace(cfg, cache_dir)
        if rank == 0:
            torch.save(result, path)
    finally:
        dist.destroy_process_group()


def spawn_trace(cfg: Config, cache_dir: str | Path, world: int) -> dict[str, Any]:
    """:func:`trace` on ``world`` gloo processes; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.pt")
        args = (world, os.path.join(tmp, "store"), cfg, str(cache_dir), path)
        mp.spawn(_rank, args=args, nprocs=world)
        return torch.load(path)


def _first(flags: Sequence[object]) -> int | None:
    """The index of the first true item of ``flags``; None if none is."""
    return next((i for i, flag in enumerate(flags) if flag), None)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / max(len(values), 1)


def report(one: dict[str, Any], many: dict[str, Any], world: int, label: str) -> str:
    """The markdown comparison of a world-size-1 trace with a world-size-``world`` one."""
    steps = len(one["metrics"])
    same0 = {k: torch.equal(one["batch0"][k], many["batch0"][k]) for k in one["batch0"]}
    g1, dg = one["grad0"], (one["grad0"] - many["grad0"]).abs()
    differing = [
        sorted(k for k in a if a[k] != b[k]) for a, b in zip(one["metrics"], many["metrics"])
    ]
    first_metrics = _first(differing)
    tokens_differ = [not torch.equal(a, b) for a, b in zip(one["sequences"], many["sequences"])]
    first_tokens = _first(tokens_differ)
    reward1 = [m["reward/mean"] for m in one["metrics"]]
    reward_w = [m["reward/mean"] for m in many["metrics"]]
    moved = int((one["weights"][1] - many["weights"][1]).abs().argmax())
    lines = [
        f"# {label}, {steps} steps: world size 1 vs {world}",
        "",
        f"- machine: {machine()}; {world} gloo processes of one thread, and one process",
        "- step 0, bit-identical: "
        + ", ".join(f"{k} {'yes' if same else 'NO'}" for k, same in same0.items()),
        f"- step 0 gradient (summed over the ranks, clipped): {int((dg > 0).sum())} of "
        f"{dg.numel()} elements differ, max |Δ| {float(dg.max()):.3g} "
        f"(max |g| {float(g1.abs().max()):.3g})",
        f"- the weight that differs most after step 0's update had the step-0 gradient "
        f"{float(g1[moved]):.3g} at world size 1, {float(many['grad0'][moved]):.3g} at {world}",
        "- first step whose logged metrics differ: "
        + (
            "none"
            if first_metrics is None
            else f"{first_metrics} ({', '.join(differing[first_metrics])})"
        ),
        "- first step whose sampled tokens differ: "
        f"{'none' if first_tokens is None else first_tokens}"
        f" ({sum(tokens_differ)} of {steps} steps differ)",
        f"- reward, first 5 → last 5 steps: world size 1 {_mean(reward1[:5]):.3f} → "
        f"{_mean(reward1[-5:]):.3f}, world size {world} {_mean(reward_w[:5]):.3f} → "
        f"{_mean(reward_w[-5:]):.3f}; largest difference at one step "
        f"{max(abs(a - b) for a, b in zip(reward1, reward_w)):.3f}",
        "",
        "| after step | weights differing | mean abs diff | max abs diff | max abs weight |",
        "|---:|---:|---:|---:|---:|",
    ]
    for k, w1 in one["weights"].items():
        dw = (w1 - many["weights"][k]).abs()
        lines.append(
            f"| {k} | {float((dw > 0).float().mean()):.1%} | {float(dw.mean()):.2g} | "
            f"{float(dw.max()):.3g} | {float(w1.abs().max()):.3g} |"
        )
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``python -m rl_harness world-size``."""
    parser.add_argument("--recipe", default=recipes.DEFAULT)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", default=[])
    parser.add_argument("--cache-dir", default=".cache/rl_harness")
    parser.add_argument("--out", help="also write the report to this file")


def _check_arguments(args: argparse.Namespace, cfg: Config) -> None:
    if args.world < 2:
        raise HarnessError(f"world-size --world: expected an integer >= 2, got {args.world}")
    runner.check_world(cfg, World(0, args.world))
    if args.out:
        out = rundir.resolved(args.out)
        if out.is_dir():
            raise RunDirError(f"world-size --out: {out} is a directory; pass a file name")
        if not out.parent.is_dir():
            raise RunDirError(f"world-size --out: no directory {out.parent} to write {out.name}")


def main(args: argparse.Namespace) -> int:
    """Trace the config at world size 1 and W, print (and with --out write) the report."""
    sets = args.set + ([f"steps={args.steps}"] if args.steps is not None else [])
    cfg = config_lib.build(recipes.overrides(args.recipe), sets)
    _check_arguments(args, cfg)  # before the traces, which take minutes
    one = trace(cfg, args.cache_dir, World())
    many = spawn_trace(cfg, args.cache_dir, args.world)
    text = report(one, many, args.world, args.recipe)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0
