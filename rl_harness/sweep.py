"""Multi-seed sweeps: each arm on N seeds beside its zero-mismatch twin, with 95 % intervals.

``python -m rl_harness sweep --recipe A [--recipe B ...] --seeds N --out DIR`` runs every
arm (a recipe plus the ``--set`` overrides) on seeds 0..N-1 into ``DIR/<arm>/seed<k>``, and,
for an arm that injects mismatch, its twin: the same config with every mismatch source off
(bik kernels on both sides, the trainer's dtype, no synthetic rollout noise; no remedy where
the remedy is the identity without a mismatch, so arms that differ by such a remedy alone have
one twin), into ``DIR/<arm>__twin/seed<k>``, on the same seeds. Arm and twin share the seed,
so the warm-up and the prompts agree and the per-seed difference isolates the mismatch (a
paired design). A run already complete is kept, a cut one is resumed: rerunning the command
finishes a sweep.

``DIR/sweep.md`` gives per arm the mean and a 95 % confidence interval (Student's t over the
seeds) of the reward at the start and the end, the peak k3, the share of unequal tokens and
the collapsed seeds (and, when the runs evaluate, the held-out accuracy's peak and last
value), then each arm's paired difference from its twin; ``DIR/sweep.png`` plots the mean
reward per step with its interval as a band, and beside it the held-out accuracy when the runs
evaluate. :func:`interval` is rl_harness.report's.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from . import collapse, remedies, report, rundir, runner
from .config import Config, RemedyConfig
from .errors import HarnessError
from .report import interval as interval  # sweep.interval, as before it moved
from .rundir import write_atomic

History = list[dict[str, Any]]

TWIN = "__twin"


def twin(cfg: Config) -> Config:
    """``cfg`` with every mismatch source off: the on-policy baseline of the same run."""
    rollout = dataclasses.replace(
        cfg.rollout,
        kernels="bik",
        dtype=cfg.train.dtype,
        split_size=0,
        logit_noise_std=0.0,
        logit_noise_bias=0.0,
        logit_round_bits=0,
        weight_round_bits=0,
    )
    remedy = cfg.remedy
    if is_identity_without_mismatch(remedy):
        remedy = dataclasses.replace(remedy, name="none")
    train = dataclasses.replace(cfg.train, kernels="bik", autocast="none")
    out = dataclasses.replace(cfg, rollout=rollout, train=train, remedy=remedy)
    if not out.zero_mismatch:  # a mismatch source this function does not know yet
        raise HarnessError("sweep: could not turn every mismatch source off for the twin")
    return out


def is_identity_without_mismatch(remedy: RemedyConfig) -> bool:
    """Whether ``remedy`` keeps every token at weight exactly 1 when the rollout's log-probs
    equal the trainer's (every ratio exp(0) = 1), as every remedy does unless its thresholds
    exclude a ratio of 1 (``token_mis`` with ``remedy.high`` < 1, say). Asked of the remedy
    itself on one token rather than listed, so a new remedy needs no entry here."""
    zero, one = torch.zeros(1, 1), torch.ones(1, 1)
    weight, _, _ = remedies.weights(remedy, zero, zero, one)  # the weight includes the keep
    return bool(weight.eq(1).all())


def arms(configs: dict[str, Config]) -> dict[str, Config]:
    """The arms to run: each named config, and after it its twin when it injects mismatch."""
    out = {}
    for name, cfg in configs.items():
        out[name] = cfg
        if not cfg.zero_mismatch:
            out[name + TWIN] = twin(cfg)
    return out


def run_seeds(
    cfg: Config,
    out: Path,
    seeds: int,
    cache_dir: str | Path,
    progress: bool,
    name: str,
    say: Callable[[str], None] = print,
) -> list[History]:
    """Each seed of ``cfg`` into ``out/seed<k>``: kept when complete, resumed when cut."""
    return [
        run_one(
            dataclasses.replace(cfg, seed=seed), out / f"seed{seed}", cache_dir, progress, name, say
        )
        for seed in range(seeds)
    ]


def complete(cfg: Config, run_dir: Path) -> bool:
    """Whether ``run_dir`` holds ``cfg``'s run finished: every step logged and the report
    written, which comes after the last checkpoint (a run cut between its last metrics line
    and that checkpoint is resumed)."""
    done = len(rundir.read_metrics(run_dir)) if rundir.has_metrics(run_dir) else 0
    return done >= cfg.steps and (run_dir / rundir.SUMMARY).exists()


def run_one(
    cfg: Config,
    run_dir: Path,
    cache_dir: str | Path,
    progress: bool,
    name: str,
    say: Callable[[str], None] = print,
) -> History:
    """``cfg`` into ``run_dir``: kept when complete, resumed when cut, run when new; a
    directory holding another config's run is refused. Returns the run's metrics."""
    module = cfg.task.module  # named on this command line: trusted
    if (run_dir / rundir.CONFIG).exists() and (
        rundir.task_module(run_dir) != module or rundir.load_config(run_dir, module) != cfg
    ):
        raise HarnessError(
            f"sweep: {run_dir} holds a run of another config; remove it or choose --out"
        )
    if complete(cfg, run_dir):
        say(f"{name} seed {cfg.seed}: complete, kept")
    elif (run_dir / rundir.CONFIG).exists():
        done = len(rundir.read_metrics(run_dir)) if rundir.has_metrics(run_dir) else 0
        say(f"{name} seed {cfg.seed}: resuming at step {done}")
        runner.resume(
            run_dir, cache_dir=cache_dir, progress=progress, name=name, trust_task_module=module
        )
    else:
        say(f"{name} seed {cfg.seed}: running {cfg.steps} steps")
        runner.run(cfg, run_dir, cache_dir=cache_dir, progress=progress, name=name)
    return rundir.read_metrics(run_dir)


def _reward(history: History, first: bool) -> float:
    rows = history[:5] if first else history[-5:]
    return statistics.fmean(m["reward/mean"] for m in rows)


# (column, per-run statistic; None: not measured)
Statistic = tuple[str, Callable[[History], float | None]]
REWARD_FIRST: Statistic = ("reward first 5", lambda h: _reward(h, True))
REWARD_LAST: Statistic = ("reward last 5", lambda h: _reward(h, False))
EVAL_LAST: Statistic = ("eval accuracy last", report.eval_last)
STATISTICS: tuple[Statistic, ...] = (
    REWARD_FIRST,
    REWARD_LAST,
    ("k3 max", lambda h: max(m["mismatch/k3_kl"] for m in h)),
    ("unequal tokens", lambda h: statistics.fmean(m["mismatch/tokens_unequal_frac"] for m in h)),
)


EVAL_STATISTICS: tuple[Statistic, ...] = (
    ("eval accuracy peak", report.eval_peak),
    EVAL_LAST,
)


def _k3_mean(history: History, first: bool) -> float:
    rows = history[:10] if first else history[-10:]
    return statistics.fmean(m["mismatch/k3_kl"] for m in rows)


# the per-seed table's columns, beside the collapse step: what a registered prediction reads
PER_SEED_STATISTICS: tuple[Statistic, ...] = (
    REWARD_LAST,
    ("k3 first 10", lambda h: _k3_mean(h, True)),
    ("k3 last 10", lambda h: _k3_mean(h, False)),
)
EVAL_PER_SEED_STATISTICS: tuple[Statistic, ...] = (
    ("eval accuracy first", report.eval_first),
    *EVAL_STATISTICS,
)


def _per_seed_lines(results: dict[str, list[History]], evaluated: bool) -> list[str]:
    """One row per arm and seed: the run's own figures and its first collapse step."""
    columns = PER_SEED_STATISTICS + (EVAL_PER_SEED_STATISTICS if evaluated else ())
    lines = [
        "",
        "Per seed (collapse step: the first, or none):",
        "",
        "| arm | seed | " + " | ".join(c for c, _ in columns) + " | collapse step |",
        "|---|---:|" + "---:|" * (len(columns) + 1),
    ]
    for arm, histories in results.items():
        for seed, history in enumerate(histories):
            cells = [_cell([stat(history)]) for _, stat in columns]
            step = collapse.collapse_step(history)
            lines.append(
                f"| {arm} | {seed} | "
                + " | ".join(cells)
                + f" | {'none' if step is None else step} |"
            )
    return lines


SHADOW_K3 = "shadow/k3_kl"  # the shadow meter's k3 (rollout.shadow; runner.SHADOW_METRICS)


def _shadow_lines(results: dict[str, list[History]]) -> list[str]:
    """The shadow meter's reading, per run: its k3 and the entropy over the first
    collapse.SIGNATURE_WINDOW steps and over the window up to the persistent collapse (the
    last steps for a run that survived); the rise of the shadow k3 is the papers' signature
    (collapse.SIGNATURE_FACTOR x), readable only where the two windows do not overlap."""
    window = collapse.SIGNATURE_WINDOW
    lines = [
        "",
        f"Shadow meter (`{SHADOW_K3}`: a native engine's mismatch on these runs' own tokens; "
        f"means over the first {window} steps and the {window} up to the persistent collapse, "
        "or the last ones):",
        "",
        "| arm | seed | persistent collapse | shadow k3 first | shadow k3 before | ratio | "
        "entropy first | entropy before | windows |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for arm, histories in results.items():
        for seed, history in enumerate(histories):
            fell = collapse.persistent_collapse_step(history)
            end = history[-1]["step"] if fell is None else fell
            k3_first, k3_before = collapse.window_means(history, SHADOW_K3, end)
            entropy = collapse.window_means(history, "entropy", end)
            ratio = k3_before / k3_first if k3_first > 0 else None
            windows = "overlap" if end < 2 * window - 1 else "apart"
            lines.append(
                f"| {arm} | {seed} | {'none' if fell is None else fell} | {_cell([k3_first])} | "
                f"{_cell([k3_before])} | {_cell([ratio])} | {_cell([entropy[0]])} | "
                f"{_cell([entropy[1]])} | {windows} |"
            )
    return lines


def minus(a: float | None, b: float | None) -> float | None:
    """``a - b``; None (not measured) where either is."""
    return None if a is None or b is None else a - b


def _cell(values: Sequence[float | None]) -> str:
    return report.cell(values, ".3g", ".2g")


def sweep_markdown(results: dict[str, list[History]], plot: str = "sweep.png") -> str:
    """Per arm: mean ± 95 % CI over seeds; then each arm's paired difference from its twin;
    then each run's own figures, seed by seed."""
    seeds = len(next(iter(results.values())))
    runs = [h for histories in results.values() for h in histories]
    evaluated = any(map(collapse.evaluated, runs))
    columns = STATISTICS + (EVAL_STATISTICS if evaluated else ())
    lines = [
        f"Mean ± half-width of the 95 % confidence interval over {seeds} seeds (Student's t).",
        "",
        "| arm | " + " | ".join(c for c, _ in columns) + " | collapsed seeds |",
        "|---|" + "---:|" * (len(columns) + 1),
    ]
    for arm, histories in results.items():
        cells = [_cell([stat(h) for h in histories]) for _, stat in columns]
        collapsed = sum(collapse.collapse_step(h) is not None for h in histories)
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {collapsed} of {len(histories)} |")
    paired = [a for a in results if a + TWIN in results]
    if paired:
        # the rewards, and the held-out accuracy where the runs evaluated
        differences = (REWARD_FIRST, REWARD_LAST) + ((EVAL_LAST,) if evaluated else ())
        lines += [
            "",
            "Paired difference, arm minus its zero-mismatch twin on the same seed:",
            "",
            "| arm | " + " | ".join(c for c, _ in differences) + " |",
            "|---|" + "---:|" * len(differences),
        ]
        for arm in paired:
            cells = [
                _cell([minus(stat(a), stat(t)) for a, t in zip(results[arm], results[arm + TWIN])])
                for _, stat in differences
            ]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += _per_seed_lines(results, evaluated)
    if any(SHADOW_K3 in m for m in runs[0]):
        lines += _shadow_lines(results)
    return "\n".join(lines) + f"\n\n![sweep]({plot})\n"


def plot_sweep(results: dict[str, list[History]], path: Path) -> None:
    """Mean reward per step of each arm, with its 95 % interval as a band; beside it the held-out
    accuracy, the same way, when the runs evaluate, and the shadow meter's k3 when they log it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward/mean", "reward (mean over seeds, 95 % CI)")]
    if any(collapse.evaluated(h) for histories in results.values() for h in histories):
        panels.append((collapse.EVAL_METRIC, "held-out greedy accuracy (mean, 95 % CI)"))
    if any(SHADOW_K3 in h[0] for histories in results.values() for h in histories if h):
        panels.append((SHADOW_K3, "shadow k3: a native engine's mismatch (mean, 95 % CI)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        report.plot_panel(ax, results, key, title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)


def sweep(
    configs: dict[str, Config],
    seeds: int,
    out: str | Path,
    *,
    cache_dir: str | Path = ".cache/rl_harness",
    progress: bool = True,
    say: Callable[[str], None] = print,
) -> str:
    """Run every arm of ``configs`` (and the twins) on ``seeds`` seeds into ``out``; write and
    return sweep.md."""
    out = rundir.resolved(out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        arm: run_seeds(cfg, out / arm, seeds, cache_dir, progress, arm, say)
        for arm, cfg in arms(configs).items()
    }
    table = sweep_markdown(results)
    write_atomic(out / "sweep.md", table)
    report.plot_or_warn(lambda path: plot_sweep(results, path), out / "sweep.png")
    return table
