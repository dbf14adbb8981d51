"""``python -m rl_harness demo``: the RL part of ``make demo``, on the real model.

Two one-step runs (``--steps`` for more) of one setup on SmolLM2-135M-Instruct (recipe
``smollm2``: chat addition through its chat template, bf16 on both sides, PPO with pi_old :=
the rollout's log-probs, as verl's bypass mode; clip 0.1), one as the recipe is, with bik on
both sides, one with ``rollout.kernels=native train.kernels=native``. The difference to look at
is the PPO ratio of the first update of every step: the policy has not moved yet, so it should
be exactly 1. With native kernels the trainer's forward gives the sampled tokens other
log-probs than the sampler did, the ratio spreads around 1, and PPO clips tokens (drops their
gradient) although nothing changed; with bik it is exactly 1 and nothing is clipped.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bik.testing.machine import device_name

from . import config, recipes, report, rundir, runner

RECIPE = "smollm2"
# run directory name: (what runs on both sides, --set overrides on top of the recipe)
RUNS = {
    "smollm2": ("bik", []),
    "smollm2_native": ("native torch", ["rollout.kernels=native", "train.kernels=native"]),
}


def _run(name: str, out: Path, steps: int, cache_dir: str, index: int, keep: bool) -> list[dict]:
    kernels, sets = RUNS[name]
    cfg = config.build(recipes.overrides(RECIPE), [*sets, f"steps={steps}"])
    shown = "".join(f" --set {s}" for s in sets)
    print(
        f"\n[{index}/{len(RUNS)}] rl_harness run --recipe {RECIPE}{shown} --steps {steps} "
        f"({kernels} on both sides) ...",
        flush=True,
    )
    start = time.perf_counter()
    runner.run(cfg, out / name, cache_dir=cache_dir, name=name)
    print(f"\n[{index}/{len(RUNS)}] done in {time.perf_counter() - start:.0f} s", flush=True)
    if not keep:  # the real model's weights and AdamW state: 1.6 GB a run
        (out / name / rundir.CHECKPOINT).unlink(missing_ok=True)
    return runner.read_metrics(out / name)


def _ratio(row: dict) -> str:
    low, high = row["ppo/ratio_min"], row["ppo/ratio_max"]
    return "exactly 1" if low == high == 1.0 else f"{low:.3f} to {high:.3f}"


def table(histories: dict[str, list[dict]]) -> str:
    """Per step, bik | native: reward, the share of sampled tokens whose log-prob the trainer
    computed differently from the sampler, the PPO ratio's range at the first update, the
    share of tokens outside PPO's clip range."""
    lines = [
        "| step | reward: bik / native | tokens unequal: bik / native | PPO ratio at the "
        "first update: bik / native | outside the clip range: bik / native |",
        "|---:|---|---|---|---|",
    ]
    for step, (ours, theirs) in enumerate(zip(*histories.values())):
        unequal = [f"{100 * r['mismatch/tokens_unequal_frac']:.0f} %" for r in (ours, theirs)]
        lines.append(
            f"| {step} | {ours['reward/mean']:.2f} / {theirs['reward/mean']:.2f} "
            f"| {unequal[0]} / {unequal[1]} | {_ratio(ours)} / {_ratio(theirs)} "
            f"| {100 * ours['ppo/clip_frac']:.1f} % / {100 * theirs['ppo/clip_frac']:.1f} % |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="a new or empty directory")
    parser.add_argument(
        "--steps",
        type=int,
        default=1,
        help="steps per run (1: the first update, whose PPO ratio should be exactly 1; a "
        "native bf16 step takes about 90 s on 2 CPU cores)",
    )
    parser.add_argument("--cache-dir", default=".cache/rl_harness")
    parser.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each run's checkpoint.pt (the model and AdamW state, 1.6 GB a run; deleted "
        "by default: the demo reads the metrics)",
    )


def no_update_lines(histories: dict[str, list[dict]]) -> list[str]:
    """A plain line for every step of a run that changed no weight because all its
    advantages were 0 (each prompt's samples got equal rewards): its ratio is still the
    check, but its loss and grad norm say nothing about training."""
    lines = []
    for name, history in histories.items():
        for row in history:
            if row["grad_norm"] == 0.0:
                lines.append(
                    f"note: {RUNS[name][0]}'s step {row['step']} made no update: every prompt's "
                    "samples got the same reward, so every advantage was 0 (its loss and grad "
                    "norm are 0); the PPO ratio at its first update is still the comparison."
                )
    return lines


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    histories = {
        name: _run(name, out, args.steps, args.cache_dir, index, args.keep_checkpoints)
        for index, name in enumerate(RUNS, 1)
    }
    runs = {RUNS[name][0]: report.load(out / name) for name in RUNS}
    report.write_compare(runs, out / "compare")
    print(
        f"\nPPO on SmolLM2-135M-Instruct, bf16 ({args.steps} step(s) each; plots and the full "
        f"table in {out / 'compare'}); this machine's figures ({device_name(torch.device('cpu'))}"
        "): plain torch's counts depend on the CPU's kernels, bik's zeros do not:"
    )
    print(table(histories))
    for line in no_update_lines(histories):
        print(line)
    print(
        "\nWhat to look at: the PPO ratio at the first update of a step compares the trainer's "
        "log-probs with the sampler's for the same weights, so it should be exactly 1. With "
        "native kernels it is not: tokens whose ratio leaves PPO's clip range [0.9, 1.1] are "
        "clipped (PPO drops the gradient of those whose advantage pushes the ratio further) "
        "although the policy has not moved, and a token-level remedy would reweight or mask "
        "them. With bik on both sides the ratio is exactly 1 at every step and nothing is "
        "clipped on-policy."
    )
    return 0
