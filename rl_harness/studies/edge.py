"""The stability-edge experiment: by how much does a realistic training-inference mismatch
move the learning rate at which a run collapses? (registered in results/rl/RESULTS.md)

``python -m rl_harness edge --lrs 5e-4,1e-3 --doses zero,bf16 --seeds 0-9 --out DIR --jobs 2``
runs the grid learning rate x dose x seed of the recipe ``edge`` (``--recipe`` names another)
into ``DIR/lr<LR>/<dose>/seed<k>``, seed after seed, so that a grid cut short holds whole
seeds. Each run takes one torch thread and ``--jobs`` run at once; a complete run is kept, a
cut one resumed (rerunning the command finishes the grid), a finished one compacted
(rundir.compact). ``--report`` writes the report of the runs already complete, running none.

The doses (:data:`DOSES`) differ only on the rollout side; the trainer is bik in bf16 in
all of them, so the rollouts of every dose sample at bf16 precision, and a dose and the zero
dose of the same seed draw the same sampling noise (rl_harness.rollout, coupled sampling).

``DIR/edge.md`` (and ``edge.png``) gives, from the complete runs:

- per cell, the runs that collapsed *persistently* (rl_harness.collapse) and the evaluation
  endpoint (the mean of the last 3 held-out evaluations), mean with its 95 % interval;
- per dose beside the zero dose on the same learning rate and seed: the paired difference of
  the endpoint and the share of responses sampled alike (equal digests) at step 0 and over the
  run;
- P(collapse) fitted against log2 LR and dose (:func:`fit`: logistic, one slope, a small ridge
  that keeps the fit finite when the cells separate), the 50 %-collapse LR of each dose and the
  factor by which a dose moves it from the zero dose's, with a 95 % bootstrap interval over
  seeds (whole seeds resampled, so the pairing holds);
- the smallest shift that the grid detects with 80 % power (:func:`detectable_shift`);
- the collapse signature (rl_harness.collapse.signature) of every collapsed run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import multiprocessing
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bik.testing.arguments import positive_int

from .. import collapse, policy, recipes, report, rundir, sweep
from .. import config as config_lib
from ..config import Config
from ..errors import HarnessError
from ..rollout import DIGEST_HEX
from ..rundir import write_atomic

History = list[dict[str, Any]]

# dose -> (what it is, its rollout overrides on the recipe); "zero" is the recipe's twin
DOSES: dict[str, tuple[str, dict[str, Any]]] = {
    "zero": ("bik bf16 on both sides: no mismatch (the twin)", {}),
    "bf16": ("native torch kernels in the bf16 rollout, bik bf16 trainer", {}),
    "fp8w": (
        "native bf16 rollout with fp8-like linear weights (3 mantissa bits), bik bf16 trainer",
        {"rollout.weight_round_bits": 3},
    ),
}
# The dose ladder of the registered dose-response (RESULTS.md section 18,
# rl_harness.studies.dose_response): the native bf16 rollout with its linear weights rounded to
# 5, 4, 3 (= fp8w) and 2 mantissa bits.
for _bits in (5, 4, 3, 2):
    DOSES[f"w{_bits}"] = (
        f"native bf16 rollout with linear weights rounded to {_bits} mantissa bits, "
        "bik bf16 trainer",
        {"rollout.weight_round_bits": _bits},
    )
RIDGE = 0.01  # on the slope and the dose terms: finite estimates when the cells separate
BOOTSTRAP = 1000  # resamples of the seeds
POWER = 0.8
SIMULATIONS = 400  # per candidate shift in detectable_shift


@dataclasses.dataclass(frozen=True)
class Cell:
    lr: float
    dose: str
    seed: int

    def path(self, out: Path) -> Path:
        return out / f"lr{self.lr:g}" / self.dose / f"seed{self.seed}"


def cell_config(recipe: str, cell: Cell, sets: Sequence[str] = ()) -> Config:
    """The config of one run of the grid."""
    overrides = {**recipes.overrides(recipe), **DOSES[cell.dose][1]}
    cfg = config_lib.build(overrides, [*sets, f"train.lr={cell.lr!r}", f"seed={cell.seed}"])
    return sweep.twin(cfg) if cell.dose == "zero" else cfg


def _run_cell(job: tuple[Config, str, str]) -> tuple[str, float]:
    """Worker: one run on one torch thread, then compacted; returns its directory and time."""
    cfg, run_dir, cache_dir = job
    torch.set_num_threads(1)
    started = time.time()
    sweep.run_one(cfg, Path(run_dir), cache_dir, False, Path(run_dir).name, say=lambda _: None)
    rundir.compact(run_dir)
    return run_dir, time.time() - started


def run_grid(
    runs: Sequence[tuple[Config, Path]],
    out: Path,
    *,
    jobs: int = 1,
    cache_dir: str | Path = ".cache/rl_harness",
) -> None:
    """Run every (config, directory) of ``runs`` not complete yet, ``jobs`` at a time,
    printing one line per run (its directory relative to ``out``)."""
    todo = [(cfg, str(path), str(cache_dir)) for cfg, path in runs if not sweep.complete(cfg, path)]
    print(f"edge: {len(runs) - len(todo)} of {len(runs)} runs complete; {len(todo)} to run")
    if not todo:
        return
    # the warm-up is shared by every run: train it once, here, on one thread (its cache key)
    torch.set_num_threads(1)
    first = todo[0][0]
    policy.warmup(policy.build_master(first.model, policy.warmup_seed(first)), first, cache_dir)
    started = time.time()
    context = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch state
    with context.Pool(jobs) as pool:
        for done, (run_dir, seconds) in enumerate(pool.imap(_run_cell, todo), 1):
            history = rundir.read_metrics(run_dir)
            step = collapse.persistent_collapse_step(history)
            end = collapse.endpoint(history)
            eta = (time.time() - started) / done * (len(todo) - done)
            print(
                f"[{done}/{len(todo)}] {Path(run_dir).relative_to(out)}: "
                f"{'survived' if step is None else f'collapsed at step {step}'}, endpoint "
                f"{'n/a' if end is None else f'{end:.3f}'} ({seconds / 60:.1f} min; "
                f"eta {eta / 60:.0f} min)",
                flush=True,
            )


def grid(lrs: Sequence[float], doses: Sequence[str], seeds: Sequence[int]) -> list[Cell]:
    """The cells, seed after seed (a grid cut short holds whole seeds)."""
    return [Cell(lr, dose, seed) for seed in seeds for lr in lrs for dose in doses]


def load(out: Path, cells: Sequence[Cell], recipe: str, sets: Sequence[str]) -> dict[Cell, History]:
    """The metrics of the complete cells."""
    return {
        cell: rundir.read_metrics(cell.path(out))
        for cell in cells
        if sweep.complete(cell_config(recipe, cell, sets), cell.path(out))
    }


# --- the logistic fit ------------------------------------------------------------------------


def fit(x: torch.Tensor, y: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor | None:
    """Coefficients of the logistic regression of ``y`` (0/1) on the columns of ``x`` (the
    first a column of ones, not penalised), by Newton's method with an L2 penalty ``ridge``
    on the others; None when it does not converge (every run collapsed, or none: the
    unpenalised intercept runs off and its Hessian becomes singular)."""
    beta = torch.zeros(x.shape[1], dtype=torch.float64)
    penalty = torch.full_like(beta, ridge)
    penalty[0] = 0.0
    for _ in range(100):
        p = torch.sigmoid(x @ beta)
        gradient = x.T @ (y - p) - penalty * beta
        hessian = (x.T * (p * (1 - p))) @ x + torch.diag(penalty)
        try:
            step = torch.linalg.solve(hessian, gradient)
        except torch.linalg.LinAlgError:
            return None
        beta = beta + step
        if float(step.abs().max()) < 1e-10:
            return beta
    return None


def design(cells: Sequence[Cell], doses: Sequence[str], center: float) -> torch.Tensor:
    """Columns: 1, log2 LR - ``center``, then an indicator per dose after the first."""
    rows = [
        [1.0, math.log2(c.lr) - center, *(float(c.dose == d) for d in doses[1:])] for c in cells
    ]
    return torch.tensor(rows, dtype=torch.float64)


@dataclasses.dataclass(frozen=True)
class Edge:
    """The fitted edge: the 50 %-collapse LR of each dose (None where the fit has no rising
    slope) and each dose's shift factor against the first dose's, with bootstrap intervals."""

    slope: float | None  # per doubling of the LR
    lr50: dict[str, float | None]
    shift: dict[str, float | None]
    shift_interval: dict[str, tuple[float, float] | None]


def _edge_of(beta: torch.Tensor | None, doses: Sequence[str], center: float) -> tuple:
    if beta is None or float(beta[1]) <= 0:
        return None, dict.fromkeys(doses), dict.fromkeys(doses[1:])
    slope, base = float(beta[1]), float(beta[0])
    terms = {d: (0.0 if i == 0 else float(beta[1 + i])) for i, d in enumerate(doses)}
    lr50 = {d: 2 ** (center - (base + terms[d]) / slope) for d in doses}
    shift = {d: 2 ** (-terms[d] / slope) for d in doses[1:]}
    return slope, lr50, shift


def edge(results: dict[Cell, History], doses: Sequence[str], seed: int = 0) -> Edge:
    """The fit over ``results`` (persistent collapse against log2 LR and dose), and the
    percentile interval of each shift over :data:`BOOTSTRAP` resamples of whole seeds."""
    cells = list(results)
    center = statistics.fmean(math.log2(c.lr) for c in cells)
    y = torch.tensor(
        [float(collapse.persistent_collapse_step(results[c]) is not None) for c in cells],
        dtype=torch.float64,
    )
    slope, lr50, shift = _edge_of(fit(design(cells, doses, center), y), doses, center)
    seeds = sorted({c.seed for c in cells})
    by_seed = {s: [i for i, c in enumerate(cells) if c.seed == s] for s in seeds}
    rng = torch.Generator().manual_seed(seed)
    draws: dict[str, list[float]] = {d: [] for d in doses[1:]}
    for _ in range(BOOTSTRAP if len(seeds) > 1 else 0):
        picks = torch.randint(len(seeds), (len(seeds),), generator=rng).tolist()
        index = [i for k in picks for i in by_seed[seeds[k]]]
        beta = fit(design([cells[i] for i in index], doses, center), y[index])
        _, _, resampled = _edge_of(beta, doses, center)
        for d in doses[1:]:
            draws[d].append(math.inf if resampled[d] is None else resampled[d])
    intervals = {d: percentiles(draws[d]) for d in doses[1:]}
    return Edge(slope, lr50, shift, intervals)


def percentiles(values: list[float]) -> tuple[float, float] | None:
    """The 2.5 and 97.5 percentiles (a resample without a rising slope counts as infinite:
    no edge to move, which widens the interval rather than dropping the resample)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[int(0.025 * len(ordered))], ordered[
        min(int(0.975 * len(ordered)), len(ordered) - 1)
    ]


def detectable_shift(slope: float, lrs: Sequence[float], seeds: int, seed: int = 0) -> float:
    """The smallest factor by which a dose must move the 50 %-collapse LR for a grid of
    ``lrs`` x (zero, one dose) x ``seeds`` to find it with :data:`POWER` power (two-sided
    Wald test of the dose term at 5 %, on :data:`SIMULATIONS` simulated grids per candidate),
    when P(collapse) rises with ``slope`` per doubling of the LR and the zero dose's edge sits
    at the grid's centre. A factor below 1 would be symmetric; this returns the LR-lowering
    one (the papers' prediction: mismatch destabilises). Returns inf past a factor of 8."""
    cells = [Cell(lr, dose, s) for s in range(seeds) for lr in lrs for dose in ("zero", "dose")]
    center = statistics.fmean(math.log2(lr) for lr in lrs)
    x = design(cells, ("zero", "dose"), center)
    rng = torch.Generator().manual_seed(seed)
    for tenth in range(1, 31):  # shifts of 0.1 .. 3 doublings
        shift = tenth / 10
        truth = torch.tensor([0.0, slope, slope * shift], dtype=torch.float64)
        p = torch.sigmoid(x @ truth)
        found = 0
        for _ in range(SIMULATIONS):
            y = torch.bernoulli(p, generator=rng)
            beta = fit(x, y)
            if beta is None:
                continue
            q = torch.sigmoid(x @ beta)
            hessian = (x.T * (q * (1 - q))) @ x + torch.diag(torch.tensor([0.0, RIDGE, RIDGE]))
            se = float(torch.linalg.inv(hessian)[2, 2]) ** 0.5
            found += abs(float(beta[2])) / se > 1.96
        if found / SIMULATIONS >= POWER:
            return 2.0**shift
    return math.inf


# --- the report ------------------------------------------------------------------------------


def agreement(a: History, b: History, steps: slice = slice(None)) -> float | None:
    """The share of responses two runs sampled alike (equal digests) over their ``steps``
    rows (None: the runs did not log digests)."""
    key = "rollout/response_digests"
    pairs = [(m[key], n[key]) for m, n in zip(a[steps], b[steps]) if key in m and key in n]
    if not pairs:
        return None
    width = DIGEST_HEX
    same = total = 0
    for x, y in pairs:
        rows = len(x) // width
        same += sum(
            x[i * width : (i + 1) * width] == y[i * width : (i + 1) * width] for i in range(rows)
        )
        total += rows
    return same / total


def _cell(values: Sequence[float | None]) -> str:
    return report.cell(values, ".3f", ".2f")


def _factor(value: float | None) -> str:
    return "n/a" if value is None else ("inf" if math.isinf(value) else f"{value:.2f}")


def report_markdown(
    results: dict[Cell, History], lrs: Sequence[float], doses: Sequence[str], fitted: Edge
) -> str:
    seeds = sorted({c.seed for c in results})
    lines = [
        f"Complete runs: {len(results)} ({len(seeds)} seeds: {', '.join(map(str, seeds))}).",
        "",
        "Per cell: persistently collapsed runs, and the endpoint (mean of the last 3 held-out",
        "evaluations), mean ± half-width of its 95 % interval over seeds:",
        "",
        "| LR | " + " | ".join(f"{d} collapsed | {d} endpoint" for d in doses) + " |",
        "|---:|" + "---:|---:|" * len(doses),
    ]
    for lr in lrs:
        cells = []
        for dose in doses:
            runs = [h for c, h in results.items() if c.lr == lr and c.dose == dose]
            fell = sum(collapse.persistent_collapse_step(h) is not None for h in runs)
            cells += [f"{fell} of {len(runs)}", _cell([collapse.endpoint(h) for h in runs])]
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    zero = doses[0]
    if len(doses) > 1:
        lines += [
            "",
            f"Paired against {zero} (same LR and seed): endpoint difference (dose minus {zero}),",
            "and the share of responses sampled alike at step 0 and over the run:",
            "",
            "| LR | dose | endpoint difference | alike at step 0 | alike over the run |",
            "|---:|---|---:|---:|---:|",
        ]
        for lr in lrs:
            for dose in doses[1:]:
                pairs = [
                    (h, results[Cell(lr, zero, c.seed)])
                    for c, h in results.items()
                    if c.lr == lr and c.dose == dose and Cell(lr, zero, c.seed) in results
                ]
                diff = [sweep.minus(collapse.endpoint(a), collapse.endpoint(b)) for a, b in pairs]
                first = [agreement(a, b, slice(0, 1)) for a, b in pairs]
                whole = [agreement(a, b) for a, b in pairs]
                lines.append(
                    f"| {lr:g} | {dose} | {_cell(diff)} | {_cell(first)} | {_cell(whole)} |"
                )
    lines += [
        "",
        f"P(collapse) against log2 LR and dose (logistic, one slope, ridge {RIDGE}): slope "
        f"{'n/a (no rising slope)' if fitted.slope is None else f'{fitted.slope:.2f}'} per "
        "doubling of the LR.",
        "",
        "| dose | 50 %-collapse LR | shift factor vs " + zero + " | 95 % bootstrap interval |",
        "|---|---:|---:|---|",
    ]
    for dose in doses:
        lr50 = fitted.lr50[dose]
        interval = fitted.shift_interval.get(dose)
        span = "" if interval is None else f"{_factor(interval[0])} to {_factor(interval[1])}"
        shift = "1 (reference)" if dose == zero else _factor(fitted.shift[dose])
        lines.append(f"| {dose} | {'n/a' if lr50 is None else f'{lr50:.3g}'} | {shift} | {span} |")
    if fitted.slope is not None:
        smallest = detectable_shift(fitted.slope, lrs, len(seeds))
        lines += [
            "",
            f"At this slope, {len(lrs)} LRs and {len(seeds)} seeds detect (80 % power, 5 %) a dose "
            f"that divides the 50 %-collapse LR by {_factor(smallest)} or more.",
        ]
    lines += _signature_lines(results)
    return "\n".join(lines) + "\n\n![edge](edge.png)\n"


def _signature_lines(results: dict[Cell, History]) -> list[str]:
    rows = []
    for cell, history in sorted(results.items(), key=lambda kv: (kv[0].lr, kv[0].dose, kv[0].seed)):
        step = collapse.persistent_collapse_step(history)
        if step is not None:
            flags = collapse.signature(history, step)
            raised = ", ".join(f for f, up in flags.items() if up) or "none"
            rows.append(f"| {cell.lr:g} | {cell.dose} | {cell.seed} | {step} | {raised} |")
    if not rows:
        return ["", "No run collapsed persistently."]
    return [
        "",
        "Collapsed runs and the signature raised before the collapse step:",
        "",
        "| LR | dose | seed | collapse step | signature |",
        "|---:|---|---:|---:|---|",
        *rows,
    ]


MARKERS = "os^dvP"  # one a dose, cycled past six
LINES = ("-", "--", "-.", ":")  # one a dose, so that two equal fitted curves both show


def plot(
    results: dict[Cell, History],
    lrs: Sequence[float],
    doses: Sequence[str],
    fitted: Edge,
    path: Path,
) -> None:
    """Left: the share of runs collapsed per LR, each dose with its fitted curve; right: the
    endpoint per LR with its 95 % interval, cut to [0, 1]. Doses are offset a little along
    the LR axis so that their points and bars do not hide each other, and each dose's curve
    has its own dash and width, so that equal curves (two doses with one fitted edge) both
    show."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    grid_x = torch.logspace(math.log10(min(lrs)) - 0.1, math.log10(max(lrs)) + 0.1, 100).tolist()
    styles = zip(doses, itertools.cycle(MARKERS), itertools.cycle(LINES))
    for i, (dose, marker, dash) in enumerate(styles):
        nudge = 2 ** ((i - (len(doses) - 1) / 2) * 0.06)
        shares, ends, halves, xs = [], [], [], []
        for lr in lrs:
            runs = [h for c, h in results.items() if c.lr == lr and c.dose == dose]
            if not runs:
                continue
            xs.append(lr * nudge)
            shares.append(
                statistics.fmean(collapse.persistent_collapse_step(h) is not None for h in runs)
            )
            points = [e for e in map(collapse.endpoint, runs) if e is not None]
            mean, half = report.interval(points) if points else (math.nan, math.nan)
            ends.append(mean)
            halves.append(0.0 if math.isnan(half) else half)
        (line,) = left.plot(xs, shares, marker, label=dose)
        lr50 = fitted.lr50[dose]
        if fitted.slope is not None and lr50 is not None:
            curve = [1 / (1 + (lr50 / x) ** fitted.slope) for x in grid_x]
            width = 1.0 + 1.2 * (len(doses) - 1 - i)  # the first widest: equal curves show
            left.plot(grid_x, curve, dash, color=line.get_color(), alpha=0.7, linewidth=width)
        errors = report.clipped_errors(ends, halves)
        right.errorbar(xs, ends, yerr=errors, fmt=marker + dash, capsize=3, label=dose)
    span = f"LR {min(lrs):g} to {max(lrs):g}" if len(lrs) > 1 else f"LR {lrs[0]:g}"
    fit = ", with the logistic fit" if fitted.slope is not None else " (one LR: no fit)"
    for ax, title, ylabel in (
        (
            left,
            f"runs collapsed (persistently), {span}{fit}",
            "share of seeds collapsed",
        ),
        (right, "evaluation endpoint (mean of last 3), 95 % CI", "held-out greedy accuracy"),
    ):
        ax.set_xscale("log")
        ax.set_xticks(list(lrs), [f"{lr:g}" for lr in lrs])  # the grid's LRs, plainly
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("learning rate")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(title="dose", fontsize=8)
        ax.set_ylim(-0.05, 1.05)
    rundir.save_figure(fig, path)


def write_report(out: Path, cells: Sequence[Cell], recipe: str, sets: Sequence[str]) -> str:
    results = load(out, cells, recipe, sets)
    if not results:
        raise HarnessError(f"edge: no complete run under {out} yet")
    lrs = sorted({c.lr for c in cells})
    doses = list(dict.fromkeys(c.dose for c in cells))
    fitted = edge(results, doses)  # one fit and bootstrap for the table and the plot
    text = report_markdown(results, lrs, doses, fitted)
    write_atomic(out / "edge.md", text)
    report.plot_or_warn(lambda path: plot(results, lrs, doses, fitted, path), out / "edge.png")
    return text


# --- the command line ------------------------------------------------------------------------


def numbers(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas, got {text!r}"
        ) from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected learning rates > 0, got {text!r}")
    return values


def seeds(text: str) -> list[int]:
    """``0-9`` or ``100,101``: distinct seeds >= 0, a range ascending."""
    problem = argparse.ArgumentTypeError(
        f"expected distinct seeds >= 0 as 0-9 (ascending) or 3,4,5, got {text!r}"
    )
    try:
        if "-" in text:
            first, last = (int(v) for v in text.split("-"))
            values = list(range(first, last + 1))
        else:
            values = [int(v) for v in text.split(",")]
    except ValueError:
        raise problem from None
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise problem
    return values


def learning_rate(text: str) -> float:
    """One learning rate > 0."""
    values = numbers(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one learning rate > 0, got {text!r}")
    return values[0]


def dose_ladder(text: str) -> list[str]:
    doses = text.split(",")
    unknown = [d for d in doses if d not in DOSES]
    if unknown or len(set(doses)) != len(doses) or doses[0] != "zero":
        raise argparse.ArgumentTypeError(
            f"expected distinct doses among {', '.join(DOSES)}, zero first, got {text!r}"
        )
    return doses


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that name a grid (its runs' configs and directory)."""
    parser.add_argument("--recipe", default="edge", help="the base recipe (default edge)")
    parser.add_argument("--lrs", type=numbers, required=True, help="learning rates, 1e-3,2e-3")
    parser.add_argument(
        "--doses", type=dose_ladder, default=["zero"], help=f"of {', '.join(DOSES)}"
    )
    parser.add_argument("--seeds", type=seeds, required=True, help="0-9 or 100,101")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, every run")
    parser.add_argument("--out", required=True, help="the grid's directory")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of running a grid (also edge-remedies'): --jobs, --report, --cache-dir."""
    parser.add_argument(
        "--jobs", type=positive_int, default=1, help="runs at once, one thread each"
    )
    parser.add_argument("--report", action="store_true", help="report the complete runs only")
    parser.add_argument("--cache-dir", default=".cache/rl_harness", help="warm-up checkpoints")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_grid_arguments(parser)
    add_run_arguments(parser)


def main(args: argparse.Namespace) -> int:
    out = rundir.resolved(args.out)
    cells = grid(args.lrs, args.doses, args.seeds)
    sets = args.set or []
    for cell in cells[:1]:
        cell_config(args.recipe, cell, sets)  # a bad --recipe or --set fails before any run
    if not args.report:
        runs = [(cell_config(args.recipe, cell, sets), cell.path(out)) for cell in cells]
        run_grid(runs, out, jobs=args.jobs, cache_dir=args.cache_dir)
    print(write_report(out, cells, args.recipe, sets))
    return 0
