"""The confirmatory dose-response at the stability edge (registered in results/rl/RESULTS.md
section 18): does a run collapse more often the larger the rollout's mismatch, measured?

The runs are an edge grid (rl_harness.studies.edge) at one learning rate, LR*, with the doses
``zero,bf16,w5,w4,w3,w2`` (the bik bf16 twin, the native bf16 rollout, and the native bf16
rollout with its linear weights rounded to 5, 4, 3 and 2 mantissa bits), all against one bik
bf16 trainer and one warm-up. This module reads them back; it runs nothing.

``python -m rl_harness dose-response --pilot --lrs 1e-3,1.4e-3 --seeds 150,151 --out DIR``
reads a pilot of the zero dose at several LRs and picks LR* (:func:`lr_star`; ``DIR/pilot.md``);
``python -m rl_harness dose-response --lr LR --seeds 200-219 --out DIR`` writes
``DIR/dose.md``, the registered analysis:

- primary: an exact trend test of persistent collapse (rl_harness.collapse) on the score
  log10 k3 at step 0 (:func:`score`), outcomes permuted within each seed (:func:`trend_test`);
- secondary: the ``w3`` (fp8-like) against ``zero`` discordant pairs (exact McNemar, one-sided
  in section 13's direction); the mismatch budget, the step-0 k3 at which the fitted
  P(collapse) rises :data:`BUDGET_RISE` above the zero dose's share (:func:`budget`), with a
  percentile interval over resamples of whole seeds;
- the design's power (:func:`power`), by simulation.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import collapse, report, rundir
from ..errors import HarnessError
from ..rundir import resolved, write_atomic
from . import edge
from .edge import Cell

History = list[dict[str, Any]]

DOSES = ("zero", "bf16", "w5", "w4", "w3", "w2")  # the registered ladder, zero first
K3 = "mismatch/k3_kl"  # the token-mean k3 KL of rollout vs trainer (rl_harness.metrics)
K3_FLOOR = 1e-6  # a step-0 k3 below it (the zero dose's: exactly 0) scores as log10 of it
SCORE_DECIMALS = 3  # scores rounded to 0.001 decades, so the exact null is a finite sum
TARGET = 0.30  # the zero dose's collapse share the pilot aims LR* at
BUDGET_RISE = 0.10  # the budget: P(collapse) this far above the zero dose's share
BOOTSTRAP = 1000  # resamples of whole seeds
ALPHA = 0.05
# The validity band of the zero dose at LR*: collapsed on this many of 20 seeds (10-70 %).
ZERO_BAND = (0.10, 0.70)
# The power scenarios' step-0 k3 per dose: section 16's medians for bf16 and the fp8-like
# rollout (k3 6.7e-4, 3 mantissa bits), 4 x per mantissa bit for the others (the weight
# error halves per bit; k3 goes as its square), plus the native kernels' bf16 floor.
EXPECTED_K3 = {"bf16": 2.1e-5, "w5": 6.3e-5, "w4": 1.9e-4, "w3": 6.7e-4, "w2": 2.7e-3}
K3_SPREAD = 0.28  # SD of a run's log10 step-0 k3 about its dose's (section 16: CV 0.64-0.78)


# --- the pilot: LR* --------------------------------------------------------------------------


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing least-squares fit to ``values`` (equal weights; pool adjacent
    violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([float(value), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (a, n), (b, m) = blocks[-2], blocks.pop()
            blocks[-1] = [(a * n + b * m) / (n + m), n + m]
    return [mean for mean, count in blocks for _ in range(int(count))]


def lr_star(shares: Mapping[float, float], target: float = TARGET) -> float | str:
    """LR* from the pilot's collapse share per LR: the shares made non-decreasing in the LR
    (:func:`isotonic`), then the first pair of neighbouring LRs L1 < L2 with s1 < ``target``
    <= s2, interpolated linearly on log LR: log LR* = log L1 + (target - s1) / (s2 - s1) x
    (log L2 - log L1); two significant digits. Returns ``"lower"`` when the smallest LR's
    share already reaches the target and ``"higher"`` when none does (the pilot goes on)."""
    lrs = sorted(shares)
    fitted = isotonic([shares[lr] for lr in lrs])
    if fitted[0] >= target:
        return "lower"
    for (l1, s1), (l2, s2) in itertools.pairwise(zip(lrs, fitted)):
        if s1 < target <= s2:
            log_lr = math.log(l1) + (target - s1) / (s2 - s1) * (math.log(l2) - math.log(l1))
            return float(f"{math.exp(log_lr):.2g}")
    return "higher"


def pilot_markdown(results: Mapping[Cell, History], lrs: Sequence[float]) -> tuple[str, Any]:
    """The pilot's table (the zero dose's collapses per LR) and LR* (or the way to extend)."""
    shares: dict[float, float] = {}
    lines = ["| LR | collapsed | runs: seed, collapse step, endpoint |", "|---:|---:|---|"]
    for lr in lrs:
        runs = sorted((c.seed, h) for c, h in results.items() if c.lr == lr)
        if not runs:
            continue
        steps = [collapse.persistent_collapse_step(h) for _, h in runs]
        shares[lr] = sum(s is not None for s in steps) / len(runs)
        text = "; ".join(
            f"{seed}: {'survived' if s is None else f'step {s}'}, {_fmt(collapse.endpoint(h))}"
            for (seed, h), s in zip(runs, steps)
        )
        lines.append(f"| {lr:g} | {sum(s is not None for s in steps)} of {len(runs)} | {text} |")
    starts = sorted({_fmt(h[0].get(collapse.EVAL_METRIC)) for h in results.values()})
    lines += ["", f"Held-out accuracy at step 0 (the warm-up's): {', '.join(starts)}."]
    star = lr_star(shares) if shares else "higher"
    if isinstance(star, float):
        verdict = f"LR* = {star:g} (the {TARGET:.0%} crossing of the isotonic shares, log LR)"
    else:
        verdict = f"no crossing: the pilot goes on at a {star} LR (registered extension)"
    return "\n".join(lines) + f"\n\n{verdict}\n", star


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


# --- the primary analysis: an exact trend test -----------------------------------------------


def step0_k3(history: History) -> float:
    """The run's k3 at step 0 (before any update: the dose as delivered, at the warm-up's
    weights)."""
    return float(history[0][K3])


def score(k3: float) -> float:
    """log10 of the step-0 k3, floored at :data:`K3_FLOOR` (the zero dose's k3 is exactly
    0), rounded to :data:`SCORE_DECIMALS` decimals."""
    return round(math.log10(max(k3, K3_FLOOR)), SCORE_DECIMALS)


@dataclasses.dataclass(frozen=True)
class Trend:
    statistic: float  # sum over runs of score x collapsed
    expected: float  # its mean under the within-seed null
    p_upper: float  # P(T >= observed): more collapse at larger k3
    p_lower: float  # P(T <= observed)
    p: float  # two-sided: min(1, 2 min(p_upper, p_lower))


def trend_test(strata: Mapping[Any, Sequence[tuple[float, bool]]]) -> Trend:
    """The exact stratified trend test: T = sum of score x collapsed over every run; under
    the null each stratum's (seed's) collapses fall on a uniformly random subset of its runs
    of the observed size, independently between strata. The null distribution of T is the
    convolution of the strata's, exact on the scores' grid of :data:`SCORE_DECIMALS`
    decimals."""
    unit = 10**SCORE_DECIMALS
    dist = torch.ones(1, dtype=torch.float64)  # P(T = low + i / unit)
    low = 0
    observed, expected = 0, 0.0
    for runs in strata.values():
        scores = [round(x * unit) for x, _ in runs]
        fell = sum(bool(y) for _, y in runs)
        observed += sum(s for s, (_, y) in zip(scores, runs) if y)
        sums = [sum(c) for c in itertools.combinations(scores, fell)]
        expected += statistics.fmean(sums)
        first, last = min(sums), max(sums)
        atoms = torch.zeros(last - first + 1, dtype=torch.float64)
        for value in sums:
            atoms[value - first] += 1.0 / len(sums)
        dist = _convolve(dist, atoms)
        low += first
    index = observed - low
    p_upper = float(dist[index:].sum())
    p_lower = float(dist[: index + 1].sum())
    p = min(1.0, 2 * min(p_upper, p_lower))
    return Trend(observed / unit, expected / unit, p_upper, p_lower, p)


def _convolve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The distribution of the sum of two independent variables on integer offsets."""
    out = torch.zeros(len(a) + len(b) - 1, dtype=torch.float64)
    for shift in torch.nonzero(b).flatten().tolist():
        out[shift : shift + len(a)] += b[shift] * a
    return out


# --- the secondary analyses ------------------------------------------------------------------


def mcnemar_upper(only_dose: int, only_zero: int) -> float:
    """The exact one-sided McNemar p: P(at least ``only_dose`` of the discordant pairs on the
    dose's side) when either side is equally likely (1.0 without a discordant pair)."""
    n = only_dose + only_zero
    return sum(math.comb(n, k) for k in range(only_dose, n + 1)) / 2**n


def budget(rows: Sequence[tuple[str, float, bool]], zero: str = "zero") -> float | None:
    """The mismatch budget from ``rows`` (dose, score, collapsed): P(collapse) fitted
    against the score over the mismatched doses' runs (:func:`_budget_fit`); the k3
    (10 ** score) at which it equals the zero dose's share + :data:`BUDGET_RISE`. math.inf
    where the slope is not positive, that level is 1 or more, or the crossing lies above a
    k3 of 1 (no budget: the mismatch does not raise P(collapse) that far); None without
    runs."""
    base = [y for d, _, y in rows if d == zero]
    if not base or all(d == zero for d, _, _ in rows):
        return None
    level = statistics.fmean(float(y) for y in base) + BUDGET_RISE
    fitted = _budget_fit(rows, zero)
    if fitted is None or fitted[2] <= 0 or level >= 1:
        return math.inf
    center, b0, b1 = fitted
    crossing = center + (math.log(level / (1 - level)) - b0) / b1
    return math.inf if crossing > 0 else 10**crossing  # a k3 above 1: no budget either


def _budget_fit(
    rows: Sequence[tuple[str, float, bool]], zero: str
) -> tuple[float, float, float] | None:
    """The logistic fit of collapse on the score over the mismatched doses' runs: (the
    scores' mean, intercept, slope) with P = 1 / (1 + exp(-(intercept + slope x (score -
    mean)))), ridge edge.RIDGE on the slope; None without such runs or where it fails."""
    dosed = [(x, y) for d, x, y in rows if d != zero]
    if not dosed:
        return None
    center = statistics.fmean(x for x, _ in dosed)
    x = torch.tensor([[1.0, s - center] for s, _ in dosed], dtype=torch.float64)
    y = torch.tensor([float(v) for _, v in dosed], dtype=torch.float64)
    beta = edge.fit(x, y)
    return None if beta is None else (center, float(beta[0]), float(beta[1]))


def budget_interval(
    strata: Mapping[int, Sequence[tuple[str, float, bool]]], seed: int = 0
) -> tuple[float, float] | None:
    """The 2.5 and 97.5 percentiles of :func:`budget` over :data:`BOOTSTRAP` resamples of
    whole seeds (a resample without a budget counts as infinite)."""
    seeds = sorted(strata)
    if len(seeds) < 2:
        return None
    rng = torch.Generator().manual_seed(seed)
    draws = []
    for _ in range(BOOTSTRAP):
        picks = torch.randint(len(seeds), (len(seeds),), generator=rng).tolist()
        value = budget([row for k in picks for row in strata[seeds[k]]])
        draws.append(math.inf if value is None else value)
    return edge.percentiles(draws)


# --- power -----------------------------------------------------------------------------------


def power(
    per_decade: float,
    seeds: int = 20,
    base: float = TARGET,
    simulations: int = 1000,
    seed: int = 0,
) -> float:
    """The share of simulated grids in which the two-sided trend test rejects at
    :data:`ALPHA`, when a run's log-odds of collapse rise by ``per_decade`` per decade of its
    step-0 k3 above the bf16 dose's expected one (flat below it, as section 13 found for
    bf16), from ``base`` (the zero dose's share), runs independent given their k3 (the real
    grid's runs of one seed share prompts and sampling noise, which this ignores), each
    run's log10 k3 drawn about :data:`EXPECTED_K3` with SD :data:`K3_SPREAD`."""
    rng = torch.Generator().manual_seed(seed)
    floor = math.log10(EXPECTED_K3["bf16"])
    logit0 = math.log(base / (1 - base))
    rejected = 0
    for _ in range(simulations):
        strata = {}
        for s in range(seeds):
            runs = [(score(0.0), bool(torch.rand(1, generator=rng) < base))]
            for k3 in EXPECTED_K3.values():
                x = math.log10(k3) + K3_SPREAD * float(torch.randn(1, generator=rng))
                p = 1 / (1 + math.exp(-(logit0 + per_decade * max(0.0, x - floor))))
                runs.append((round(x, SCORE_DECIMALS), bool(torch.rand(1, generator=rng) < p)))
            strata[s] = runs
        rejected += trend_test(strata).p < ALPHA
    return rejected / simulations


def expected_shares(per_decade: float, base: float = TARGET) -> dict[str, float]:
    """P(collapse) per dose at its expected k3 under :func:`power`'s model."""
    floor = math.log10(EXPECTED_K3["bf16"])
    logit0 = math.log(base / (1 - base))
    shares = {"zero": base}
    for dose, k3 in EXPECTED_K3.items():
        shares[dose] = 1 / (1 + math.exp(-(logit0 + per_decade * (math.log10(k3) - floor))))
    return shares


# --- the report ------------------------------------------------------------------------------


def report_markdown(results: Mapping[Cell, History], doses: Sequence[str], lr: float) -> str:
    seeds = sorted({c.seed for c in results})
    whole = [s for s in seeds if all(Cell(lr, d, s) in results for d in doses)]
    zero = doses[0]
    lines = [
        f"LR {lr:g}; complete runs: {len(results)}; seeds with every dose: {len(whole)} "
        f"({', '.join(map(str, whole))}). Only those seeds enter the analyses.",
        "",
        "| dose | collapsed | step-0 k3: median (min to max) | held-out accuracy at step 0 |",
        "|---|---:|---|---|",
    ]
    rows: dict[int, list[tuple[str, float, bool]]] = {s: [] for s in whole}
    for dose in doses:
        runs = [results[Cell(lr, dose, s)] for s in whole]
        k3s = [step0_k3(h) for h in runs]
        fell = [collapse.persistent_collapse_step(h) is not None for h in runs]
        for s, k3, y in zip(whole, k3s, fell):
            rows[s].append((dose, score(k3), y))
        starts = sorted({h[0].get(collapse.EVAL_METRIC) for h in runs}, key=str)
        spread = f"{statistics.median(k3s):.2e} ({min(k3s):.2e} to {max(k3s):.2e})" if k3s else ""
        lines.append(
            f"| {dose} | {sum(fell)} of {len(runs)} | {spread} | "
            f"{', '.join(_fmt(a) for a in starts)} |"
        )
    if not whole:
        return "\n".join(lines) + "\n"
    lines += ["", *validity_lines(results, doses, lr, whole)]
    trend = trend_test({s: [(x, y) for _, x, y in rows[s]] for s in whole})
    lines += [
        "",
        f"Primary: exact trend test of persistent collapse on log10 step-0 k3 (floor "
        f"{K3_FLOOR:g}), permuted within seed: T = {trend.statistic:.3f} (null mean "
        f"{trend.expected:.3f}); P(T >= observed) = {trend.p_upper:.4g}, P(T <= observed) = "
        f"{trend.p_lower:.4g}; two-sided p = **{trend.p:.4g}**.",
    ]
    if "w3" in doses:
        pairs = [(dict((d, y) for d, _, y in rows[s])) for s in whole]
        only_w3 = sum(p["w3"] and not p[zero] for p in pairs)
        only_zero = sum(p[zero] and not p["w3"] for p in pairs)
        lines += [
            "",
            f"Secondary, w3 (fp8-like) against {zero}: collapsed alone {only_w3} / {only_zero} "
            f"seeds; exact one-sided McNemar p = {mcnemar_upper(only_w3, only_zero):.4g}.",
        ]
    flat = [row for s in whole for row in rows[s]]
    value = budget(flat, zero)
    interval = budget_interval(rows)
    span = "n/a" if interval is None else f"{interval[0]:.2e} to {interval[1]:.2e}"
    dosed = [x for d, x, _ in flat if d != zero]
    lines += [
        "",
        f"Secondary, the mismatch budget (step-0 k3 where the fitted P(collapse) reaches the "
        f"{zero} dose's share + {BUDGET_RISE:.2f}): "
        f"{'n/a' if value is None else f'{value:.2e}'}; 95 % interval over {BOOTSTRAP} seed "
        f"resamples: {span} (measured k3 from {10 ** min(dosed):.2e} to {10 ** max(dosed):.2e}"
        "; inf: no rise that large).",
    ]
    return "\n".join(lines) + "\n"


def plot(results: Mapping[Cell, History], doses: Sequence[str], lr: float, path: Path) -> None:
    """dose.png. Left: each dose's share of seeds collapsed (Wilson 95 % interval) at its
    median step-0 k3 (the zero dose, k3 exactly 0, at :data:`K3_FLOOR`), the budget's
    logistic fit over the mismatched doses' runs and the level it is read at (the zero
    dose's share + :data:`BUDGET_RISE`). Right: every run's step-0 k3 by dose, filled where
    the run collapsed: the ladder as delivered."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({c.seed for c in results})
    whole = [s for s in seeds if all(Cell(lr, d, s) in results for d in doses)]
    runs = {d: [results[Cell(lr, d, s)] for s in whole] for d in doses}
    fell = {d: [collapse.persistent_collapse_step(h) is not None for h in runs[d]] for d in doses}
    k3s = {d: [max(step0_k3(h), K3_FLOOR) for h in runs[d]] for d in doses}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    for i, (dose, marker) in enumerate(zip(doses, itertools.cycle(edge.MARKERS))):
        share = statistics.fmean(fell[dose])
        low, high = report.wilson(sum(fell[dose]), len(whole))
        x = statistics.median(k3s[dose])
        bars = left.errorbar(
            [x], [share], yerr=[[share - low], [high - share]], fmt=marker, capsize=3, label=dose
        )
        colour = bars[0].get_color()
        for j, (k3, y) in enumerate(zip(k3s[dose], fell[dose])):
            spread = i + 0.5 * (j / max(1, len(whole) - 1) - 0.5)  # seeds side by side
            face = colour if y else "none"
            right.plot([spread], [k3], marker, color=colour, markerfacecolor=face, alpha=0.8)
    rows = [(d, score(k), y) for d in doses for k, y in zip(k3s[d], fell[d])]
    dosed = [x for d, x, _ in rows if d != doses[0]]
    beta = _budget_fit(rows, doses[0])
    if beta is not None:
        center, b0, b1 = beta
        xs = torch.linspace(min(dosed), max(dosed), 50).tolist()
        fit = [1 / (1 + math.exp(-(b0 + b1 * (x - center)))) for x in xs]
        left.plot([10**x for x in xs], fit, "k--", linewidth=1, label="logistic fit (dosed runs)")
    level = statistics.fmean(fell[doses[0]]) + BUDGET_RISE
    left.axhline(
        level,
        color="grey",
        linestyle=":",
        linewidth=1,
        label=f"{doses[0]} share + {BUDGET_RISE:.2f}",
    )
    left.set_xscale("log")
    left.set_xlabel(
        f"step-0 k3 of the rollout (median of the dose; {doses[0]} drawn at {K3_FLOOR:g})"
    )
    left.set_ylabel("share of seeds collapsed (95 % Wilson)")
    left.set_ylim(-0.05, 1.05)
    left.set_title(
        f"Persistent collapse by dose, LR {lr:g}, {len(whole)} seeds a dose", fontsize=10
    )
    left.legend(fontsize=8)
    right.set_yscale("log")
    right.set_xticks(range(len(doses)), list(doses))
    right.set_xlabel("dose")
    right.set_ylabel("step-0 k3 of the run")
    right.set_title(
        f"Each run's step-0 k3 by dose, LR {lr:g} (filled: collapsed)",
        fontsize=10,
    )
    rundir.save_figure(fig, path)


def validity_lines(
    results: Mapping[Cell, History], doses: Sequence[str], lr: float, whole: Sequence[int]
) -> list[str]:
    """The registered validity conditions, each with yes or no: one warm-up (one held-out
    accuracy at step 0 over every run), a ladder (the mismatched doses' median step-0 k3
    strictly rising), and the design point (the zero dose's collapse share in
    :data:`ZERO_BAND`)."""
    runs = [results[Cell(lr, d, s)] for d in doses for s in whole]
    starts = sorted({_fmt(h[0].get(collapse.EVAL_METRIC)) for h in runs})
    medians = [statistics.median(step0_k3(results[Cell(lr, d, s)]) for s in whole) for d in doses]
    ladder = all(a < b for a, b in itertools.pairwise(medians[1:]))
    fell = sum(
        collapse.persistent_collapse_step(results[Cell(lr, doses[0], s)]) is not None for s in whole
    )
    low, high = ZERO_BAND
    point = low * len(whole) <= fell <= high * len(whole)
    return [
        "Validity:",
        f"1. one warm-up (a single held-out accuracy at step 0, to match the pilot's): "
        f"{'yes' if len(starts) == 1 else 'no'} ({', '.join(starts)});",
        f"2. a ladder (median step-0 k3 rising strictly over {', '.join(doses[1:])}): "
        f"{'yes' if ladder else 'no'};",
        f"3. the design point ({doses[0]} collapsed on {low:.0%} to {high:.0%} of the seeds): "
        f"{'yes' if point else 'no'} ({fell} of {len(whole)}).",
    ]


def load(
    out: Path, lrs: Sequence[float], doses: Sequence[str], seeds: Sequence[int], sets: Sequence[str]
) -> dict[Cell, History]:
    return edge.load(out, edge.grid(lrs, doses, seeds), "edge", sets)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pilot", action="store_true", help="read a pilot: pick LR*")
    parser.add_argument("--lrs", type=edge.numbers, help="the pilot's LRs")
    parser.add_argument("--lr", type=edge.learning_rate, help="LR* (the confirmatory grid's)")
    parser.add_argument(
        "--doses", type=edge.dose_ladder, default=list(DOSES), help="the ladder, zero first"
    )
    parser.add_argument("--seeds", type=edge.seeds, required=True, help="0-9 or 100,101")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="the grid's --set")
    parser.add_argument("--out", required=True, help="the grid's directory")


def main(args: argparse.Namespace) -> int:
    out = resolved(args.out)
    sets = args.set or []
    if args.pilot:
        if not args.lrs:
            raise HarnessError("dose-response --pilot: expected --lrs")
        results = load(out, args.lrs, ["zero"], args.seeds, sets)
        text, _ = pilot_markdown(results, sorted(args.lrs))
        write_atomic(out / "pilot.md", text)
    else:
        if args.lr is None:
            raise HarnessError("dose-response: expected --lr (LR*) or --pilot")
        doses = args.doses
        results = load(out, [args.lr], doses, args.seeds, sets)
        if not results:
            raise HarnessError(f"dose-response: no complete run under {out} yet")
        text = report_markdown(results, doses, args.lr)
        write_atomic(out / "dose.md", text)
        plot(results, doses, args.lr, out / "dose.png")
    print(text)
    return 0
