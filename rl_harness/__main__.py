"""python -m rl_harness run | recipes | compare  (see README)."""

import argparse
import json
import sys
from pathlib import Path

from . import config as config_lib
from . import plots, recipes, runner


def _run(args):
    if args.resume:
        summary = runner.run(
            None, args.resume, resume=True, cache_dir=args.cache_dir, name=Path(args.resume).name
        )
    else:
        sets = list(args.set or []) + ([f"steps={args.steps}"] if args.steps else [])
        try:
            cfg = config_lib.build(recipes.overrides(args.recipe), sets)
        except (config_lib.ConfigError, KeyError) as error:
            raise SystemExit(f"config error: {error}") from None
        out = args.out or f"runs/{args.recipe}"
        summary = runner.run(cfg, out, cache_dir=args.cache_dir, name=args.recipe)
    print(runner.summary_markdown(summary))
    return 0


def _compare(args):
    runs = {Path(d).name: runner.read_metrics(d) for d in args.dirs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plots.plot_runs(runs, out / "compare.png")
    rows = [
        "| run | steps | reward first 5 | reward last 5 | k3 max | unequal tokens (mean) | "
        "first collapse step |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for d in args.dirs:
        history = runner.read_metrics(d)
        collapse = next(
            (
                m["step"]
                for m in history
                if any(
                    m.get(f"collapse/{f}")
                    for f in ("reward_drop", "grad_norm_blowup", "grad_norm_drop")
                )
            ),
            None,
        )
        first5 = sum(m["reward/mean"] for m in history[:5]) / max(len(history[:5]), 1)
        last5 = sum(m["reward/mean"] for m in history[-5:]) / max(len(history[-5:]), 1)
        rows.append(
            f"| {Path(d).name} | {len(history)} | {first5:.3f} | {last5:.3f} | "
            f"{max(m['mismatch/k3_kl'] for m in history):.2e} | "
            f"{sum(m['mismatch/tokens_unequal_frac'] for m in history) / len(history):.3f} | "
            f"{collapse if collapse is not None else 'none'} |"
        )
    table = "\n".join(rows) + "\n\n![compare](compare.png)\n"
    (out / "compare.md").write_text(table)
    print(table)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m rl_harness", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a recipe (default: zero_mismatch)")
    run.add_argument("--recipe", default=recipes.DEFAULT)
    run.add_argument("--steps", type=int)
    run.add_argument("--out", help="run directory (default runs/<recipe>)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    run.add_argument("--resume", metavar="DIR", help="continue the run in DIR")
    run.add_argument("--cache-dir", default=".cache/rl_harness", help="warm-up checkpoints")
    commands.add_parser("recipes", help="list the recipes")
    compare = commands.add_parser("compare", help="plots and a markdown table of several runs")
    compare.add_argument("dirs", nargs="+")
    compare.add_argument("--out", default="runs/compare")
    args = parser.parse_args(argv)
    if args.command == "recipes":
        for name, (description, overrides) in recipes.RECIPES.items():
            print(
                f"{name:22s} {description}\n{'':22s} {json.dumps(overrides) if overrides else '{}'}"
            )
        return 0
    return _run(args) if args.command == "run" else _compare(args)


if __name__ == "__main__":
    sys.exit(main())
