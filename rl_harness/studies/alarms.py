"""For practitioners, read back from the stability-edge grid (rl_harness.studies.edge): which signal
warns of a collapse and how early, which mismatch metric to alarm on, and the mismatch budget.

``python -m rl_harness alarms --lrs ... --doses zero,bf16,fp8w --seeds 0-9 --out DIR`` (the
grid's own arguments) reads the complete runs under ``DIR`` and writes ``DIR/alarms.md``:

- **Early warning, scored by lead time.** Each signal (:data:`SIGNALS`) raises its alarm at the
  first step where the mean of its last :data:`LEVEL_STEPS` values reaches :data:`FACTOR` x
  its mean over the first :data:`BASELINE_STEPS` steps (or falls to 1 / :data:`FACTOR` of it),
  or, for a recorded collapse flag, at the first step it was raised: a rule a monitor can
  apply as the run goes. Over the runs that collapsed persistently (rl_harness.collapse) it
  counts the alarms raised *before* the collapse step and their lead in steps; over the runs
  that survived, the false alarms (raised at any step). Mismatch signals are scored on the
  mismatched doses only (the zero dose measures exactly 0). Scored over every run, and over
  the cells where the seed alone decided (:func:`mixed_cells`), since across the grid the LR
  decides most outcomes and a signal that tracks the LR would score well.
- **Bulk or tail.** At step 0 every run of a dose has the same weights (the shared warm-up),
  so the spread of a metric over seeds is the sampling noise of one batch: each mismatch
  metric's step-0 median per dose, the ratio of the doses, and its coefficient of variation:
  how clearly one batch tells the doses apart.
- **The mismatch budget.** Per LR and dose, the persistent collapses beside the zero dose on
  the same seeds, with the exact two-sided McNemar test on the seeds where only one of the
  two collapsed; the dose each one delivers at step 0, in the metric names verl users log.

Exploratory: defined after part of the grid had run, so it is read as description, not as a
test registered in advance.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import collapse, report, rundir
from ..errors import HarnessError
from ..rollout import DIGEST_HEX
from . import edge
from .edge import Cell

History = list[dict[str, Any]]

BASELINE_STEPS = 3  # the first steps, before any collapse of the grid (the earliest is step 5)
LEVEL_STEPS = 3  # a trailing mean: one noisy batch does not raise an alarm
FACTOR = 2.0  # the rise (or fall) that raises a metric's alarm, as collapse.SIGNATURE_FACTOR


@dataclasses.dataclass(frozen=True)
class Signal:
    name: str
    key: str  # a metric key, or a recorded flag ``collapse/<flag>``
    kind: str  # "bulk" or "tail" mismatch, "policy" (no mismatch needed), or "flag"
    falls: bool = False  # alarms on a fall instead of a rise

    @property
    def mismatch(self) -> bool:
        return self.key.startswith("mismatch/") or self.key == "collapse/k3_growth"


SIGNALS = (
    Signal("k3 KL (token mean)", "mismatch/k3_kl", "bulk"),
    Signal(
        "per-token-mean log-ppl diff (verl's form of eq. 8)", "mismatch/log_ppl_abs_diff", "bulk"
    ),
    Signal("mean abs log-prob diff (token)", "mismatch/logprob_abs_diff_mean", "bulk"),
    Signal("max abs log-prob diff (token)", "mismatch/logprob_abs_diff_max", "tail"),
    Signal("chi2 of the sequence IS weight", "mismatch/chi2_seq", "tail"),
    Signal("max sequence IS weight", "mismatch/seq_is_weight_max", "tail"),
    Signal("grad norm", "grad_norm", "policy"),
    Signal("entropy", "entropy", "policy"),
    Signal("mean response length", "response_length/mean", "policy"),
    Signal("training reward (falls)", "reward/mean", "policy", falls=True),
    Signal("length_surge flag", "collapse/length_surge", "flag"),
    Signal("grad_norm_blowup flag", "collapse/grad_norm_blowup", "flag"),
    Signal("grad_norm_drop flag", "collapse/grad_norm_drop", "flag"),
    Signal("k3_growth flag", "collapse/k3_growth", "flag"),
)
BUDGET_METRICS = (  # the step-0 dose: a token mean, a sequence mean, a sequence sum (eq. 8)
    "mismatch/k3_kl",
    "mismatch/log_ppl_abs_diff",
    "mismatch/log_ppl_abs_diff_sum",
)


def alarm_step(history: History, signal: Signal) -> int | None:
    """The first step the signal raises its alarm (see the module docstring), or None."""
    if signal.kind == "flag":
        return next((m["step"] for m in history if m.get(signal.key)), None)
    values = [(m["step"], m[signal.key]) for m in history if signal.key in m]
    baseline = statistics.fmean(v for _, v in values[:BASELINE_STEPS]) if values else 0.0
    if not baseline > 0:  # the zero dose's mismatch, or a reward that starts at nothing
        return None
    for i in range(BASELINE_STEPS, len(values)):
        level = statistics.fmean(v for _, v in values[i - LEVEL_STEPS + 1 : i + 1])
        if (level <= baseline / FACTOR) if signal.falls else (level >= FACTOR * baseline):
            return values[i][0]
    return None


@dataclasses.dataclass(frozen=True)
class Score:
    collapsed: int
    leads: list[int]  # steps from the alarm to the collapse, of the alarms raised before it
    survived: int
    false_alarms: int


def score(runs: Sequence[History], signal: Signal) -> Score:
    leads, collapsed, survived, false_alarms = [], 0, 0, 0
    for history in runs:
        fell, alarm = collapse.persistent_collapse_step(history), alarm_step(history, signal)
        if fell is None:
            survived += 1
            false_alarms += alarm is not None
        else:
            collapsed += 1
            if alarm is not None and alarm < fell:
                leads.append(fell - alarm)
    return Score(collapsed, leads, survived, false_alarms)


def mcnemar(only_dose: int, only_zero: int) -> float:
    """The exact two-sided McNemar p-value on the discordant pairs (1.0 without any)."""
    n = only_dose + only_zero
    tail = sum(math.comb(n, k) for k in range(min(only_dose, only_zero) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _share(part: int, whole: int) -> str:
    return f"{part} of {whole}" if whole else "-"


def _score_table(runs: dict[Cell, History], zero: str) -> list[str]:
    everything = list(runs.values())
    mismatched = [h for c, h in runs.items() if c.dose != zero]
    lines = [
        "| signal | kind | collapsed runs warned | median lead (range), steps | "
        "surviving runs alarmed |",
        "|---|---|---:|---|---:|",
    ]
    for signal in SIGNALS:
        s = score(mismatched if signal.mismatch else everything, signal)
        lead = f"{statistics.median(s.leads):g} ({min(s.leads)}-{max(s.leads)})" if s.leads else "-"
        lines.append(
            f"| {signal.name} | {signal.kind} | {_share(len(s.leads), s.collapsed)} | {lead} | "
            f"{_share(s.false_alarms, s.survived)} |"
        )
    return lines


def mixed_cells(results: dict[Cell, History]) -> dict[Cell, History]:
    """The runs of the (LR, dose) cells where some seeds collapsed and some did not: there the
    seed alone decided, so a signal is compared between runs of one LR and dose."""
    fell: dict[tuple[float, str], set[bool]] = {}
    for cell, history in results.items():
        outcome = collapse.persistent_collapse_step(history) is not None
        fell.setdefault((cell.lr, cell.dose), set()).add(outcome)
    return {c: h for c, h in results.items() if len(fell[(c.lr, c.dose)]) == 2}


def warning_lines(results: dict[Cell, History], zero: str) -> list[str]:
    mixed = mixed_cells(results)
    cells = sorted({(c.lr, c.dose) for c in mixed})
    return [
        "## Early warning, scored by lead time",
        "",
        f"An alarm: the mean of the last {LEVEL_STEPS} steps at {FACTOR:g} x the mean of the "
        f"first {BASELINE_STEPS} (1 / {FACTOR:g} for a fall), or a recorded flag raised. Lead: "
        "steps from the alarm to the persistent collapse, over the alarms raised before it (the "
        "collapse step is where the registered rule sees it: held-out evaluations come every 10 "
        "steps, so a short lead may be the fall itself). Surviving runs: an alarm at any step. "
        "Mismatch signals over the mismatched doses only.",
        "",
        "Every run (the collapsed runs are mostly the higher LRs', the survivors the lower: a "
        "signal that tracks the LR scores well here):",
        "",
        *_score_table(results, zero),
        "",
        f"Only the cells where the seed alone decided ({len(mixed)} runs of "
        + ", ".join(f"LR {lr:g} {dose}" for lr, dose in cells)
        + "): the matched comparison.",
        "",
        *(_score_table(mixed, zero) if mixed else ["No cell holds both outcomes."]),
    ]


def _step0(results: dict[Cell, History], dose: str, key: str) -> list[float]:
    """A metric at step 0, once per seed: every LR of a seed samples step 0 alike."""
    first: dict[int, float] = {}
    for cell, history in sorted(results.items(), key=lambda kv: kv[0].lr):
        if cell.dose == dose and history and key in history[0]:
            first.setdefault(cell.seed, history[0][key])
    return list(first.values())


def _spread(values: Sequence[float]) -> str:
    if len(values) < 2:
        return "-"
    mean = statistics.fmean(values)
    return f"{statistics.stdev(values) / mean:.2f}" if mean else "-"


def bulk_tail_lines(results: dict[Cell, History], doses: Sequence[str]) -> list[str]:
    doses = doses[1:]
    lines = [
        "",
        "## Bulk or tail: what one batch tells",
        "",
        "Step 0 (the warm-up's weights, every run of a dose alike but for its seed's batch): "
        "the median over seeds, and the coefficient of variation (SD / mean) over seeds.",
        "",
        "| metric | kind | " + " | ".join(f"{d} median | {d} CV" for d in doses) + " |",
        "|---|---|" + "---:|---:|" * len(doses),
    ]
    for signal in SIGNALS:
        if not signal.key.startswith("mismatch/"):
            continue
        cells = []
        for dose in doses:
            values = _step0(results, dose, signal.key)
            cells += [_median(values), _spread(values)]
        lines.append(f"| `{signal.key}` | {signal.kind} | " + " | ".join(cells) + " |")
    return lines


def budget_lines(
    results: dict[Cell, History], lrs: Sequence[float], doses: Sequence[str]
) -> list[str]:
    zero, rest = doses[0], doses[1:]
    lines = [
        "",
        "## The mismatch budget",
        "",
        "The dose each rollout delivers at step 0 (median over seeds; batch of "
        f"{_batch(results)} responses):",
        "",
        "| dose | " + " | ".join(f"`{key}`" for key in BUDGET_METRICS) + " | mean reply, tokens |",
        "|---|" + "---:|" * (len(BUDGET_METRICS) + 1),
    ]
    for dose in rest:
        cells = [_median(_step0(results, dose, key)) for key in BUDGET_METRICS]
        cells.append(_median(_step0(results, dose, "response_length/mean")))
        lines.append(f"| {dose} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Persistent collapses beside {zero} on the same seeds; discordant seeds (only the dose "
        f"collapsed / only {zero} did) and the exact two-sided McNemar p ({len(lrs) * len(rest)} "
        "tests: 0.05 / their number is the Bonferroni threshold):",
        "",
        "| LR | dose | dose collapsed | " + zero + " collapsed | discordant | p |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for lr in lrs:
        for dose in rest:
            pairs = [
                (
                    collapse.persistent_collapse_step(h) is not None,
                    collapse.persistent_collapse_step(results[Cell(lr, zero, c.seed)]) is not None,
                )
                for c, h in results.items()
                if c.lr == lr and c.dose == dose and Cell(lr, zero, c.seed) in results
            ]
            only_dose = sum(a and not b for a, b in pairs)
            only_zero = sum(b and not a for a, b in pairs)
            lines.append(
                f"| {lr:g} | {dose} | {_share(sum(a for a, _ in pairs), len(pairs))} | "
                f"{_share(sum(b for _, b in pairs), len(pairs))} | {only_dose} / {only_zero} | "
                f"{mcnemar(only_dose, only_zero):.3g} |"
            )
    return lines


def _median(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3g}" if values else "-"


def _batch(results: dict[Cell, History]) -> str:
    """Responses a step, from the response digests of the first run that logged them."""
    for history in results.values():
        digests = history[0].get("rollout/response_digests") if history else None
        if digests:
            return str(len(digests) // DIGEST_HEX)
    return "n/a"


PLOT_SIGNALS = ("entropy", "reward/mean", "grad_norm", "response_length/mean")
PLOT_MISMATCH = ("mismatch/k3_kl", "mismatch/logprob_abs_diff_mean")
PLOT_STEPS = 30  # every collapse of the grid comes before step 20
PLOT_TICKS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4)  # a median below the lowest is drawn at it


def relative(history: History, key: str) -> list[float]:
    """``key`` per step over its mean of the first :data:`BASELINE_STEPS` steps (NaN where
    that mean is not positive): the quantity the alarm rule compares with :data:`FACTOR`."""
    values = [m[key] for m in history[:PLOT_STEPS] if key in m]
    baseline = statistics.fmean(values[:BASELINE_STEPS]) if values else 0.0
    return [v / baseline if baseline > 0 else math.nan for v in values]


def plot(results: dict[Cell, History], zero: str, path: Path) -> None:
    """One panel per signal: the median over runs of the signal relative to its own first
    steps, for the runs that collapsed and those that survived (mismatch signals: mismatched
    doses only), with the alarm thresholds dotted. The two groups differ in LR as well (the
    collapsed runs are mostly the higher LRs'): a description, not a matched comparison."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = PLOT_SIGNALS + PLOT_MISMATCH
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, key in zip(axes.flat, keys):
        for fell, label, style in ((True, "collapsed", "-"), (False, "survived", "--")):
            runs = [
                relative(h, key)
                for c, h in results.items()
                if (collapse.persistent_collapse_step(h) is not None) == fell
                and (c.dose != zero or not key.startswith("mismatch/"))
            ]
            runs = [r for r in runs if r and not math.isnan(r[0])]
            if not runs:
                continue
            steps = range(min(len(r) for r in runs))
            median = [max(statistics.median(r[t] for r in runs), PLOT_TICKS[0]) for t in steps]
            ax.plot(
                steps,
                median,
                style,
                marker="o" if fell else "s",
                markersize=3,
                label=f"{label} ({len(runs)} runs)",
            )
        for level in (FACTOR, 1 / FACTOR):
            ax.axhline(level, color="grey", linewidth=0.8, linestyle=":")
        ax.set_yscale("log")
        ax.set_yticks(PLOT_TICKS, [f"{t:g}" for t in PLOT_TICKS])
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylim(PLOT_TICKS[0] * 0.8, PLOT_TICKS[-1] * 1.25)
        ax.set_title(key + (" (falls)" if key == "reward/mean" else ""), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(f"median / its first {BASELINE_STEPS} steps", fontsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:  # the zero dose alone has no mismatch to draw, a tiny grid may lack a group
            ax.text(0.5, 0.5, "no run to draw", ha="center", transform=ax.transAxes)
    fig.suptitle(
        "Signals before a collapse: median over runs, relative to each run's start "
        f"(dotted: the alarm at x{FACTOR:g} and x1/{FACTOR:g}; {PLOT_TICKS[0]:g} or less drawn at "
        f"{PLOT_TICKS[0]:g})",
        fontsize=10,
    )
    rundir.save_figure(fig, path, dpi=90)


def report_markdown(
    results: dict[Cell, History], lrs: Sequence[float], doses: Sequence[str]
) -> str:
    seeds = sorted({c.seed for c in results})
    fell = sum(collapse.persistent_collapse_step(h) is not None for h in results.values())
    lines = [
        "# Early warning, the metric to alarm on, and the mismatch budget",
        "",
        f"From {len(results)} complete runs ({len(seeds)} seeds), {fell} collapsed "
        "persistently. Exploratory (rl_harness/studies/alarms.py).",
        "",
        *warning_lines(results, doses[0]),
        *bulk_tail_lines(results, doses),
        *budget_lines(results, lrs, doses),
    ]
    return "\n".join(lines) + "\n\n![alarms](alarms.png)\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    edge.add_grid_arguments(parser)


def main(args: argparse.Namespace) -> int:
    if len(args.doses) < 2:
        raise HarnessError("alarms --doses: expected the zero dose and at least one other")
    out = rundir.resolved(args.out)
    cells = edge.grid(args.lrs, args.doses, args.seeds)
    results = edge.load(out, cells, args.recipe, args.set or [])
    if not results:
        raise HarnessError(f"alarms: no complete run under {out} yet")
    text = report_markdown(results, sorted(args.lrs), args.doses)
    rundir.write_atomic(Path(out) / "alarms.md", text)
    report.plot_or_warn(lambda path: plot(results, args.doses[0], path), out / "alarms.png")
    print(text)
    return 0
