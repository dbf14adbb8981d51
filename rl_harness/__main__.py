"""python -m rl_harness run | sweep | recipes | remedies | compare | world-size | same | edge |
edge-remedies | dose-response | alarms | bias | compact | demo  (see rl_harness/README.md;
TOOLS: the table).
``run`` under ``torchrun --nproc-per-node N`` runs data-parallel (rl_harness.distributed)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from . import config as config_lib
from . import demo, distributed, recipes, remedies, report, rundir, runner, same, sweep, world_size
from .errors import HarnessError, RunDirError
from .studies import alarms, bias, dose_response, edge, edge_remedies

DESCRIPTION = (
    "The RL harness: runs, sweeps and studies of training-inference mismatch (manual: "
    "rl_harness/README.md). `run` under `torchrun --nproc-per-node N` runs data-parallel."
)
EXIT_ERROR = 2


def _run(args: argparse.Namespace) -> int:
    if args.resume:
        refused = [
            flag
            for flag, given in (("--set", args.set), ("--recipe", args.recipe), ("--out", args.out))
            if given
        ]
        if refused:
            raise RunDirError(
                f"{', '.join(refused)} cannot be combined with --resume: a resumed run keeps "
                f"{Path(args.resume) / rundir.CONFIG} (only --steps may give it a new total); "
                "start a new run with --out to change the config"
            )
    elif args.trust_task_module:
        raise RunDirError(
            "--trust-task-module applies to --resume only (a new run names its module with "
            "--set task.module=...)"
        )
    with distributed.from_environment() as world:  # torchrun: one rank per process
        if args.resume:
            summary = runner.resume(
                args.resume,
                steps=args.steps,
                cache_dir=args.cache_dir,
                trust_task_module=args.trust_task_module,
                keep_policies=args.keep_policies,
            )
        else:
            recipe = args.recipe or recipes.DEFAULT
            sets = list(args.set or [])
            if args.steps is not None:
                sets.append(f"steps={args.steps}")
            cfg = config_lib.build(recipes.overrides(recipe), sets)
            out = args.out or f"runs/{recipe}"
            summary = runner.run(
                cfg, out, cache_dir=args.cache_dir, name=recipe, keep_policies=args.keep_policies
            )
    if world.main:
        print(report.summary_markdown(summary))
    return 0


def _configs(recipe_names: Sequence[str], sets: Sequence[str], steps: int | None) -> dict:
    sets = [*sets, *([f"steps={steps}"] if steps is not None else [])]
    return {name: config_lib.build(recipes.overrides(name), sets) for name in recipe_names}


def _sweep(args: argparse.Namespace) -> int:
    if args.seeds < 1:
        raise HarnessError(f"sweep --seeds: expected an integer >= 1, got {args.seeds}")
    if len(set(args.recipe)) != len(args.recipe):
        raise HarnessError(f"sweep --recipe: each recipe once, got {args.recipe}")
    configs = _configs(args.recipe, args.set or [], args.steps)
    print(sweep.sweep(configs, args.seeds, args.out, cache_dir=args.cache_dir))
    return 0


DEFAULT_COMPARE_OUT = "runs/compare"


def _compare(args: argparse.Namespace) -> int:
    """The inputs first, then where the table goes: an explicit --out that holds a table is
    refused, the default (runs/compare) is replaced; the last line says where it went."""
    for d in args.dirs:
        if not Path(d).is_dir():
            raise RunDirError(f"compare: no run directory at {d}")
    labels = report.unique_labels(args.dirs)
    runs = {label: report.load(d) for label, d in zip(labels, args.dirs)}
    out = rundir.resolved(args.out or DEFAULT_COMPARE_OUT)  # nosuch/../old is old
    if out.exists() and not out.is_dir():
        raise RunDirError(f"compare --out: {out} is a file; pass a directory for the table")
    written = [name for name in report.COMPARE_FILES if (out / name).exists()]
    if written and args.out is not None:
        raise RunDirError(
            f"compare --out: {out} already holds {' and '.join(written)}; pass another --out "
            "or remove them"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RunDirError(f"compare --out: cannot create {out} ({error})") from None
    print(report.write_compare(runs, out))
    print(f"compare: wrote {out / report.COMPARE_FILES[0]}")
    return 0


def _recipes(args: argparse.Namespace) -> int:
    for name, (description, overrides) in recipes.RECIPES.items():
        print(f"{name:22s} {description}\n{'':22s} {json.dumps(overrides) if overrides else '{}'}")
    return 0


def _remedies(args: argparse.Namespace) -> int:
    print(f"{remedies.LEGEND}:\n\n{remedies.markdown()}")
    return 0


def _run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--recipe", help=f"a recipe name (default {recipes.DEFAULT})")
    run.add_argument("--steps", type=int, help="number of RL steps (with --resume: the new total)")
    run.add_argument("--out", help="run directory, new or empty (default runs/<recipe>)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    run.add_argument("--resume", metavar="DIR", help="continue the run in DIR")
    run.add_argument(
        "--trust-task-module",
        metavar="MODULE",
        help="with --resume: DIR's config names the plug-in task MODULE (task.module), and you "
        "trust it to be imported (run); without it such a directory is refused",
    )
    run.add_argument("--cache-dir", default=".cache/rl_harness", help="warm-up checkpoints")
    run.add_argument(
        "--keep-policies",
        action="store_true",
        help="keep the policy's weights at every checkpoint (DIR/policies/step<k>.pt), for "
        "benchmarks/mismatch_anatomy.py --policy; the run's bits do not depend on it",
    )


def _sweep_arguments(arms: argparse.ArgumentParser) -> None:
    arms.add_argument("--recipe", action="append", required=True, help="an arm (repeatable)")
    arms.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    arms.add_argument("--steps", type=int, help="number of RL steps of every run")
    arms.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, every arm")
    arms.add_argument("--out", default="runs/sweep", help="sweep directory (default runs/sweep)")
    arms.add_argument("--cache-dir", default=".cache/rl_harness", help="warm-up checkpoints")


def _compare_arguments(compare: argparse.ArgumentParser) -> None:
    compare.add_argument("dirs", nargs="+", help="run directories or sweep arm directories")
    compare.add_argument(
        "--out",
        help=f"directory for compare.md and compare.png, refused if it holds them (default "
        f"{DEFAULT_COMPARE_OUT}, replaced on each call)",
    )


def _compact_arguments(compact: argparse.ArgumentParser) -> None:
    compact.add_argument("dirs", nargs="+", help="directories holding finished runs")


def _compact(args: argparse.Namespace) -> int:
    """Every finished run below ``args.dirs`` compacted (rundir.compact), every other PNG
    shrunk; prints the bytes before and after."""
    before = after = runs = 0
    for top in map(Path, args.dirs):
        if not top.is_dir():
            raise RunDirError(f"compact: no directory at {top}")
        files = [f for f in top.rglob("*") if f.is_file()]
        before += sum(f.stat().st_size for f in files)
        for summary in sorted(top.rglob(rundir.SUMMARY)):
            if (summary.parent / rundir.CONFIG).is_file():
                runs += rundir.compact(summary.parent)
        for png in top.rglob("*.png"):
            rundir.shrink_png(png)
        after += sum(f.stat().st_size for f in top.rglob("*") if f.is_file())
    print(f"compacted {runs} run(s): {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")
    return 0


# name -> (help, add its arguments, run it)
Tool = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
TOOLS: dict[str, Tool] = {
    "run": (f"run a recipe (default: {recipes.DEFAULT})", _run_arguments, _run),
    "sweep": (
        "recipes on N seeds, each beside its zero-mismatch twin, with 95%% CIs",
        _sweep_arguments,
        _sweep,
    ),
    "recipes": ("list the recipes", lambda _: None, _recipes),
    "remedies": ("list the mismatch remedies and their formulas", lambda _: None, _remedies),
    "compare": (
        "plots and a markdown table of several runs; a sweep arm's directory (seed0/ seed1/ "
        "...) shows the mean over its seeds with a 95%% CI",
        _compare_arguments,
        _compare,
    ),
    "world-size": (
        "a config at world size 1 and on W processes, compared step by step",
        world_size.add_arguments,
        world_size.main,
    ),
    "same": (
        "whether two runs are the same bit for bit (metrics and last checkpoint); exit 0 if "
        "so, 1 if not",
        same.add_arguments,
        same.main,
    ),
    "edge": (
        "the stability-edge grid: learning rates x mismatch doses x seeds, and its report",
        edge.add_arguments,
        edge.main,
    ),
    "edge-remedies": (
        "the edge's remedy phase: remedy arms x seeds at one LR, time to collapse vs the control",
        edge_remedies.add_arguments,
        edge_remedies.main,
    ),
    "dose-response": (
        "the registered dose-response at LR*: the pilot's LR*, the trend test on step-0 k3",
        dose_response.add_arguments,
        dose_response.main,
    ),
    "alarms": (
        "early-warning signals, the metric to alarm on and the mismatch budget, from an edge grid",
        alarms.add_arguments,
        alarms.main,
    ),
    "bias": (
        "the gradient bias of mismatched rollouts at fixed weights, paired with on-policy",
        bias.add_arguments,
        bias.main,
    ),
    "compact": (
        "store finished runs small: metrics gzipped, plots as palette PNGs",
        _compact_arguments,
        _compact,
    ),
    "demo": (
        "the RL part of make demo: one PPO step on SmolLM2, bik vs native kernels",
        demo.add_arguments,
        demo.main,
    ),
}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rl_harness", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (summary, add_arguments, _) in TOOLS.items():
        add_arguments(commands.add_parser(name, help=summary))
    return parser


def _warning_line(message: Warning | str, *args: object, **kwargs: object) -> str:
    return f"warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; a HarnessError ends it with a one-line message and status 2."""
    args = parser().parse_args(argv)
    command = TOOLS[args.command][2]
    formatwarning, warnings.formatwarning = warnings.formatwarning, _warning_line
    try:
        return command(args)
    except HarnessError as error:
        if os.environ.get("RANK", "0") == "0":  # every torchrun rank stops with this error
            print(f"error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_ERROR) from None
    finally:
        warnings.formatwarning = formatwarning


if __name__ == "__main__":
    sys.exit(main())
