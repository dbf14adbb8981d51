"""Reports of runs: the per-run summary (summary.md), the side-by-side table of several runs
(compare.md) and the PNG plots of both. Everything here is computed from metrics.jsonl.

``compare`` takes single runs and sweep arms (:class:`Seeds`: one config on several seeds,
rl_harness.sweep); an arm's cells and curves are the mean over its seeds with the half-width
of a 95 % confidence interval (Student's t, :func:`interval`) as ``±`` and as a band.
Held-out evaluation metrics (``eval/*``, rl_harness.evaluate) sit in the rows of the steps
that evaluated only; every statistic here skips the rows without them.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import collapse
from .config import DEFAULTS, flatten
from .rundir import PLOT, SUMMARY, has_metrics, read_metrics, write_atomic

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from .config import Config

History = list[dict[str, Any]]

EVAL = collapse.EVAL_METRIC
PANELS = [
    ("reward/mean", "reward"),
    ("response_length/mean", "response length"),
    ("mismatch/k3_kl", "k3 KL (rollout vs train)"),
    ("mismatch/tokens_unequal_frac", "fraction of unequal tokens"),
    ("grad_norm", "grad norm"),
    ("lr", "learning rate"),
    ("ppo/clip_frac", "share of tokens outside PPO's clip range"),
    (EVAL, "held-out accuracy (greedy)"),  # only when a run evaluated
]

# Two-sided 95 % quantiles of Student's t by degrees of freedom (1..30); beyond, the normal's.
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of its 95 % confidence interval); the half-width is NaN for one value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    df = len(values) - 1
    t = _T95[df - 1] if df <= len(_T95) else 1.960
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def clipped_errors(
    means: Sequence[float], halves: Sequence[float], low: float = 0.0, high: float = 1.0
) -> list[list[float]]:
    """matplotlib's ``yerr`` (below, above) for intervals mean ± half cut to [low, high]: a
    share or an accuracy whose Student-t interval runs past its range is drawn to the edge."""
    below = [m - max(low, m - h) for m, h in zip(means, halves)]
    above = [min(high, m + h) - m for m, h in zip(means, halves)]
    return [below, above]


def wilson(successes: int, trials: int, z: float = 1.960) -> tuple[float, float]:
    """The Wilson score interval (95 % by default) of a share: inside [0, 1] by construction,
    and not empty at 0 or n successes as the plain normal interval is."""
    if trials <= 0:
        raise ValueError(f"wilson: trials must be positive, got {trials}")
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials**2))
    return max(0.0, centre - half), min(1.0, centre + half)


def cell(values: Sequence[float | None], fmt: str, half_fmt: str | None = None) -> str:
    """A table cell: ``-`` when there is no value or any is missing (None), one value as
    ``fmt``, several as ``mean ± half-width`` of the 95 % interval (``half_fmt``, default
    ``fmt``)."""
    if not values or any(v is None for v in values):
        return "-"
    mean, half = interval(values)  # type: ignore[arg-type]  # no None left
    if math.isnan(half):
        return format(mean, fmt)
    return f"{format(mean, fmt)} ± {format(half, half_fmt or fmt)}"


@dataclass(frozen=True)
class Seeds:
    """A sweep arm: one config's histories on several seeds (``DIR/<arm>/seed<k>``)."""

    histories: list[History]


def load(path: str | Path) -> History | Seeds:
    """The metrics of a run directory, or of a sweep arm: a directory of seed runs
    ``seed0/ seed1/ ...`` (in seed order) without metrics of its own."""
    path = Path(path)
    seeds = {
        int(match[1]): child
        for child in path.iterdir()
        if (match := re.fullmatch(r"seed(\d+)", child.name)) and has_metrics(child)
    }
    if has_metrics(path) or not seeds:
        return read_metrics(path)  # a RunDirError names a directory that holds no run
    return Seeds([read_metrics(seeds[k]) for k in sorted(seeds)])


def histories(run: History | Seeds) -> list[History]:
    """The histories of a single run (one) or a sweep arm (one per seed)."""
    return run.histories if isinstance(run, Seeds) else [run]


def band(runs: Sequence[History], key: str) -> tuple[list[int], list[float], list[float]]:
    """The steps at which every history of ``runs`` has ``key``, the mean over the histories
    at each and the half-width of its 95 % interval (0 for a single history)."""
    by_step = [{m["step"]: m[key] for m in h if key in m} for h in runs]
    steps = sorted(set.intersection(*(set(values) for values in by_step)))
    bands = [interval([values[s] for values in by_step]) for s in steps]
    return steps, [m for m, _ in bands], [0.0 if math.isnan(w) else w for _, w in bands]


def _mean(key: str, rows: History) -> float:
    return sum(r[key] for r in rows) / max(len(rows), 1)


def eval_rows(history: History) -> History:
    """The rows of the steps that evaluated on the held-out set."""
    return [m for m in history if EVAL in m]


def eval_first(history: History) -> float | None:
    """The first held-out accuracy (None: the run did not evaluate)."""
    rows = eval_rows(history)
    return rows[0][EVAL] if rows else None


def eval_peak(history: History) -> float | None:
    """The highest held-out accuracy (None: the run did not evaluate)."""
    return max((m[EVAL] for m in eval_rows(history)), default=None)


def eval_last(history: History) -> float | None:
    """The last held-out accuracy (None: the run did not evaluate)."""
    rows = eval_rows(history)
    return rows[-1][EVAL] if rows else None


def summarize(history: History, cfg: Config, name: str, world_size: int = 1) -> dict[str, Any]:
    """The figures of one run that summary.md shows; ``world_size``: the number of
    processes that ran it (torchrun)."""
    return {
        "name": name,
        "steps": len(history),
        "world_size": world_size,
        "reward_first5": _mean("reward/mean", history[:5]),
        "reward_last5": _mean("reward/mean", history[-5:]),
        "k3_max": max((r["mismatch/k3_kl"] for r in history), default=0.0),
        "tokens_unequal_frac_mean": _mean("mismatch/tokens_unequal_frac", history),
        "logprob_abs_diff_max": max(
            (r["mismatch/logprob_abs_diff_max"] for r in history), default=0.0
        ),
        "routing_flip": _routing_flip(history),
        "eval": _eval_summary(history),
        "collapse_step": collapse.collapse_step(history),
        "first_flags": collapse.first_steps(history),
        "overrides": {k: v for k, v in flatten(cfg.to_dict()).items() if DEFAULTS.get(k) != v},
        "machine": machine(),
    }


def machine() -> str:
    """What a run's bits depend on beyond its config: the CPU as torch's kernels see it (the
    warm-up differs between AVX2 and AVX-512, and with AMX), torch and transformers."""
    import torch
    import transformers

    from bik.testing.machine import cpu_numerics

    return f"{cpu_numerics()}, torch {torch.__version__}, transformers {transformers.__version__}"


def _routing_flip(history: History) -> dict[str, float] | None:
    """A mixture-of-experts run's routing flips (rl_harness.routing): the mean and max
    fraction of response tokens routed to another expert set, and the total count; None for
    a dense run."""
    key = "mismatch/routing_flip_frac"
    if not history or key not in history[0]:
        return None
    return {
        "frac_mean": _mean(key, history),
        "frac_max": max(r[key] for r in history),
        "pair_frac_mean": _mean("mismatch/routing_flip_pair_frac", history),
        "count": sum(r["mismatch/routing_flip_count"] for r in history),
    }


def _eval_summary(history: History) -> dict[str, float] | None:
    """The held-out accuracy's peak (and its step) and last value; None without evaluation."""
    rows = eval_rows(history)
    if not rows:
        return None
    peak = max(rows, key=lambda m: m[EVAL])  # the first step that reached the peak
    return {"peak": peak[EVAL], "peak_step": peak["step"], "last": rows[-1][EVAL]}


def _ends(s: Mapping[str, Any]) -> str:
    """The steps the first and last reward means cover: 5, or every step of a shorter run."""
    count = min(5, s["steps"])
    return f"{count} step{'s' if count != 1 else ''}"


def summary_markdown(s: Mapping[str, Any]) -> str:
    overrides = json.dumps(s["overrides"], sort_keys=True) if s["overrides"] else "none (defaults)"
    collapse_at = s["collapse_step"] if s["collapse_step"] is not None else "none"
    lines = [
        f"# {s['name']}",
        "",
        f"- steps: {s['steps']}",
        f"- processes: {s['world_size']} (data-parallel world size; gradients depend on it)",
        f"- overrides: {overrides}",
        f"- reward: first {_ends(s)} {s['reward_first5']:.3f}, last {_ends(s)} "
        f"{s['reward_last5']:.3f}",
        f"- mismatch: k3 max {s['k3_max']:.3e}, mean fraction of unequal tokens "
        f"{s['tokens_unequal_frac_mean']:.3f}, "
        f"max abs log-prob diff {s['logprob_abs_diff_max']:.3e}",
        *(
            []
            if s.get("routing_flip") is None
            else [
                f"- routing flips (MoE): mean fraction of response tokens "
                f"{s['routing_flip']['frac_mean']:.4f} (max {s['routing_flip']['frac_max']:.4f}), "
                f"of (token, layer) pairs {s['routing_flip']['pair_frac_mean']:.4f}; "
                f"{s['routing_flip']['count']:.0f} tokens in all"
            ]
        ),
        *(
            []
            if s.get("eval") is None
            else [
                f"- held-out greedy accuracy: peak {s['eval']['peak']:.3f} (step "
                f"{s['eval']['peak_step']}), last {s['eval']['last']:.3f}"
            ]
        ),
        f"- first collapse step: {collapse_at}",
        f"- first step of each flag: {json.dumps(s['first_flags'], sort_keys=True)}",
        f"- machine: {s['machine']}",
        "",
        f"![metrics]({PLOT})",
        "",
    ]
    return "\n".join(lines)


PLOT_NEEDS = "pip install 'bik[rl]' (matplotlib) to get the plots"


def plot_or_warn(plot: Callable[[Path], None], path: Path) -> None:
    """``plot(path)``, or a warning when it fails (matplotlib missing or broken): a plot is
    written after the metrics and tables it shows, so a finished run never fails on it."""
    try:
        plot(path)
    except Exception as error:
        hint = f"; {PLOT_NEEDS}" if isinstance(error, ImportError) else ""
        warnings.warn(
            f"{path} not written ({type(error).__name__}: {error}){hint}", RuntimeWarning, 2
        )


def write_run_report(
    out: Path, history: History, cfg: Config, name: str, world_size: int = 1
) -> dict[str, Any]:
    """summary.md, then metrics.png (or a warning: :func:`plot_or_warn`) of the run in
    ``out``, run by ``world_size`` processes; returns the summary."""
    summary = summarize(history, cfg, name, world_size)
    write_atomic(out / SUMMARY, summary_markdown(summary))
    plot_or_warn(lambda path: plot_runs({name: history}, path), out / PLOT)
    return summary


# (header, a run's statistic (None: not measured), format) of the compare table
Column = tuple[str, Callable[[History], float | None], str]
COLUMNS: tuple[Column, ...] = (
    ("reward first 5", lambda h: _mean("reward/mean", h[:5]), ".3f"),
    ("reward last 5", lambda h: _mean("reward/mean", h[-5:]), ".3f"),
    ("k3 max", lambda h: max(m["mismatch/k3_kl"] for m in h), ".2e"),
    ("unequal tokens (mean)", lambda h: _mean("mismatch/tokens_unequal_frac", h), ".3f"),
)
FLIPS_COLUMN: Column = (
    "routing flips (mean)",
    lambda h: None if (flip := _routing_flip(h)) is None else flip["frac_mean"],
    ".4f",
)
# PPO's ratio at the first step (before any update the trainer's pi_old equals the rollout's
# policy, so a ratio other than 1 is mismatch alone) and the share of tokens it clipped
PPO_COLUMNS: tuple[Column, ...] = (
    ("PPO ratio min (step 0)", lambda h: h[0].get("ppo/ratio_min") if h else None, ".3f"),
    ("PPO ratio max (step 0)", lambda h: h[0].get("ppo/ratio_max") if h else None, ".3f"),
    ("clipped tokens (mean)", lambda h: _mean("ppo/clip_frac", h) if _ppo(h) else None, ".3f"),
)
EVAL_COLUMNS: tuple[Column, ...] = (
    ("eval accuracy peak", eval_peak, ".3f"),
    ("eval accuracy last", eval_last, ".3f"),
)


def _ppo(history: History) -> bool:
    """Whether every step of ``history`` logged PPO's ratio (a REINFORCE run logs none)."""
    return bool(history) and all("ppo/clip_frac" in m for m in history)


def _columns(runs: Sequence[History]) -> list[Column]:
    """The table's columns: PPO's ratio and clipping when a run logged them, routing flips
    only when a mixture-of-experts run is compared, the held-out accuracy only when a run
    evaluated."""
    columns = list(COLUMNS)
    if any(_ppo(h) for h in runs):
        columns += PPO_COLUMNS
    if any(_routing_flip(h) is not None for h in runs):
        columns.append(FLIPS_COLUMN)
    if any(collapse.evaluated(h) for h in runs):
        columns += EVAL_COLUMNS
    return columns


def _steps_cell(runs: Sequence[History]) -> str:
    lengths = sorted({len(h) for h in runs})
    return str(lengths[0]) if len(lengths) == 1 else f"{lengths[0]}-{lengths[-1]}"


def _collapse_cell(run: History | Seeds) -> str:
    """A run's first collapse step; for a sweep arm, how many of its seeds collapsed."""
    if isinstance(run, Seeds):
        collapsed = sum(collapse.collapse_step(h) is not None for h in run.histories)
        return f"{collapsed} of {len(run.histories)} seeds"
    if not run:
        return "-"
    at = collapse.collapse_step(run)
    return "none" if at is None else str(at)


def compare_markdown(runs: Mapping[str, History | Seeds], plot: str = "compare.png") -> str:
    """One table row per run or sweep arm (label -> metrics), then the plot."""
    columns = _columns([h for run in runs.values() for h in histories(run)])
    rows = [
        "| run | steps | "
        + "".join(f"{header} | " for header, _, _ in columns)
        + "first collapse step |",
        "|---|---:|" + "---:|" * len(columns) + "---|",
    ]
    if any(isinstance(run, Seeds) for run in runs.values()):
        rows[:0] = [
            "Sweep arms: mean ± half-width of the 95 % confidence interval over the seeds "
            "(Student's t).",
            "",
        ]
    for label, run in runs.items():
        done = [h for h in histories(run) if h]
        cells = [cell([stat(h) for h in done], fmt) for _, stat, fmt in columns]
        rows.append(
            f"| {label} | {_steps_cell(histories(run))} | "
            + "".join(f"{c} | " for c in cells)
            + f"{_collapse_cell(run)} |"
        )
    return "\n".join(rows) + f"\n\n![compare]({plot})\n"


def unique_labels(dirs: Sequence[str | Path]) -> list[str]:
    """Short, distinct labels for run directories: the basename, or as many trailing path
    parts as it takes to tell runs apart (``a/run``, ``b/run``); a directory given twice
    gets ``#2``."""
    parts = [Path(d).resolve().parts for d in dirs]
    labels = []
    for i, p in enumerate(parts):
        depth = 1
        while depth < len(p) and any(
            q[-depth:] == p[-depth:] and q != p for j, q in enumerate(parts) if j != i
        ):
            depth += 1
        labels.append("/".join(p[-depth:]))
    seen: dict[str, int] = {}
    for i, label in enumerate(labels):
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            labels[i] = f"{label}#{seen[label]}"
    return labels


COMPARE_FILES = ("compare.md", "compare.png")


def write_compare(runs: Mapping[str, History | Seeds], out: Path) -> str:
    """compare.md, then compare.png (or a warning: :func:`plot_or_warn`) in ``out``;
    returns the table."""
    table = compare_markdown(runs)
    write_atomic(out / COMPARE_FILES[0], table)
    plot_or_warn(lambda path: plot_runs(runs, path), out / COMPARE_FILES[1])
    return table


# Line styles and markers by run, so that a curve lying on another one stays visible.
STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1)), "v"), ((0, (1, 2)), "x")]


def plain_ticks(ax: Axes) -> None:
    """Each y tick labelled with its own value, no offset text and no shared exponent to
    combine with it: in 3 significant digits, or as many more as it takes for every tick to
    read differently (0.9995 and 0.9990 are both 0.999 in 3)."""
    from matplotlib.ticker import FuncFormatter

    def label(value: float, _: int | None) -> str:
        ticks = ax.yaxis.get_majorticklocs()
        digits = next(
            (d for d in range(3, 9) if len({f"{t:.{d}g}" for t in ticks}) == len(ticks)), 9
        )
        return f"{value:.{digits}g}"

    ax.yaxis.set_major_formatter(FuncFormatter(label))


FEW_STEPS = 4  # runs up to this many steps get one x tick per step


def plot_panel(ax: Axes, runs: Mapping[str, Sequence[History]], key: str, title: str) -> None:
    """One line per label of ``runs``: a single history's ``key`` per step, or the mean over
    several (seeds) with the 95 % interval as a band. Each run has its own line style and
    marker; tick labels are plain numbers (no offset or shared exponent), and a flat panel
    still gets a range with several ticks."""
    from matplotlib.ticker import MaxNLocator

    values = []
    for index, (name, group) in enumerate(runs.items()):
        steps, mean, half = band(group, key)
        style, marker = STYLES[index % len(STYLES)]
        (line,) = ax.plot(
            steps,
            mean,
            label=name,
            linewidth=1.2,
            linestyle=style,
            marker=marker,
            markersize=4,
            markevery=max(1, len(steps) // 12),
            fillstyle="none",
        )
        values += mean
        if len(group) > 1:
            low = [m - w for m, w in zip(mean, half)]
            high = [m + w for m, w in zip(mean, half)]
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
    finite = [v for v in values if math.isfinite(v)]
    if finite and max(finite) == min(finite):  # flat: one tick would say nothing
        centre = finite[0]
        pad = abs(centre) * 0.5
        ax.set_ylim(*((centre - pad, centre + pad) if pad else (-0.1, 1.0)))
    plain_ticks(ax)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    last = max((m["step"] for group in runs.values() for h in group for m in h), default=0)
    if last < FEW_STEPS:  # the locator falls back to fractions on a narrow range: whole steps
        ax.set_xlim(-0.5, last + 0.5)
        ax.set_xticks(range(last + 1))
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(title.split(" (")[0], fontsize=8)


def plot_runs(runs: Mapping[str, History | Seeds], path: Path) -> None:
    """``runs``: {label: metrics of a run or a sweep arm}; one panel per metric (held-out
    accuracy only when a run evaluated), one line (an arm: with its band) per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {label: histories(run) for label, run in runs.items()}
    rows = [m for group in groups.values() for h in group for m in h]
    panels = [(key, title) for key, title in PANELS if key != EVAL or any(EVAL in m for m in rows)]
    columns = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(2, columns, figsize=(13 * columns / 3, 6.5))
    for ax, (key, title) in zip(axes.flat, panels):
        plot_panel(ax, groups, key, title)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()  # one legend, above the panels
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.95), ncol=4, fontsize=8)
    fig.suptitle(f"rl_harness: {', '.join(groups)} (per step)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
