"""Reports of runs: the per-run summary (summary.md), the side-by-side table of several runs
(compare.md) and the PNG plots of both. Everything here is computed from metrics.jsonl."""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import collapse
from .config import DEFAULTS, flatten
from .rundir import PLOT, SUMMARY, write_atomic

if TYPE_CHECKING:
    from .config import Config

History = list[dict[str, Any]]

PANELS = [
    ("reward/mean", "reward"),
    ("response_length/mean", "response length"),
    ("mismatch/k3_kl", "k3 KL (rollout vs train)"),
    ("mismatch/tokens_unequal_frac", "fraction of unequal tokens"),
    ("grad_norm", "grad norm"),
    ("lr", "learning rate"),
]


def _mean(key: str, rows: History) -> float:
    return sum(r[key] for r in rows) / max(len(rows), 1)


def summarize(history: History, cfg: Config, name: str) -> dict[str, Any]:
    """The figures of one run that summary.md shows."""
    import torch

    return {
        "name": name,
        "steps": len(history),
        "reward_first5": _mean("reward/mean", history[:5]),
        "reward_last5": _mean("reward/mean", history[-5:]),
        "k3_max": max((r["mismatch/k3_kl"] for r in history), default=0.0),
        "tokens_unequal_frac_mean": _mean("mismatch/tokens_unequal_frac", history),
        "logprob_abs_diff_max": max(
            (r["mismatch/logprob_abs_diff_max"] for r in history), default=0.0
        ),
        "routing_flip": _routing_flip(history),
        "collapse_step": collapse.collapse_step(history),
        "first_flags": collapse.first_steps(history),
        "overrides": {k: v for k, v in flatten(cfg.to_dict()).items() if DEFAULTS.get(k) != v},
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
    }


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


def summary_markdown(s: Mapping[str, Any]) -> str:
    overrides = json.dumps(s["overrides"], sort_keys=True) if s["overrides"] else "none (defaults)"
    collapse_at = s["collapse_step"] if s["collapse_step"] is not None else "none"
    lines = [
        f"# {s['name']}",
        "",
        f"- steps: {s['steps']}",
        f"- overrides: {overrides}",
        f"- reward: first 5 steps {s['reward_first5']:.3f}, last 5 steps {s['reward_last5']:.3f}",
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
        f"- first collapse step: {collapse_at}",
        f"- first step of each flag: {json.dumps(s['first_flags'], sort_keys=True)}",
        f"- machine: {s['machine']}",
        "",
        f"![metrics]({PLOT})",
        "",
    ]
    return "\n".join(lines)


def write_run_report(out: Path, history: History, cfg: Config, name: str) -> dict[str, Any]:
    """summary.md and metrics.png of the run in ``out``; returns the summary."""
    summary = summarize(history, cfg, name)
    write_atomic(out / SUMMARY, summary_markdown(summary))
    plot_runs({name: history}, out / PLOT)
    return summary


def compare_markdown(runs: Mapping[str, History], plot: str = "compare.png") -> str:
    """One table row per run (label -> metrics), then the plot."""
    # A column of routing flips only when a mixture-of-experts run is compared
    moe = any(_routing_flip(h) is not None for h in runs.values())
    rows = [
        "| run | steps | reward first 5 | reward last 5 | k3 max | unequal tokens (mean) | "
        + ("routing flips (mean) | " if moe else "")
        + "first collapse step |",
        "|---|---:|---:|---:|---:|---:|" + ("---:|" if moe else "") + "---|",
    ]
    for label, history in runs.items():
        if not history:
            rows.append(f"| {label} | 0 | - | - | - | - |{' - |' if moe else ''} - |")
            continue
        collapse_at = collapse.collapse_step(history)
        flip = _routing_flip(history)
        flips = "" if not moe else "- | " if flip is None else f"{flip['frac_mean']:.4f} | "
        rows.append(
            f"| {label} | {len(history)} | {_mean('reward/mean', history[:5]):.3f} | "
            f"{_mean('reward/mean', history[-5:]):.3f} | "
            f"{max(m['mismatch/k3_kl'] for m in history):.2e} | "
            f"{_mean('mismatch/tokens_unequal_frac', history):.3f} | {flips}"
            f"{collapse_at if collapse_at is not None else 'none'} |"
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


def write_compare(runs: Mapping[str, History], out: Path) -> str:
    """compare.md and compare.png in ``out``; returns the table."""
    table = compare_markdown(runs)
    plot_runs(runs, out / "compare.png")
    write_atomic(out / "compare.md", table)
    return table


def plot_runs(runs: Mapping[str, History], path: Path) -> None:
    """``runs``: {label: metrics}; one panel per metric, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, PANELS):
        for name, history in runs.items():
            ax.plot(
                [m["step"] for m in history], [m[key] for m in history], label=name, linewidth=1
            )
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if key in ("mismatch/k3_kl", "grad_norm") and any(
            m[key] > 0 for h in runs.values() for m in h
        ):
            ax.set_yscale("symlog", linthresh=1e-8 if key == "mismatch/k3_kl" else 1e-3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
