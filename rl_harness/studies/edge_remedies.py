"""The stability edge's remedy phase: at one learning rate where the fp8-like rollout
collapses runs more often than no mismatch does, which remedy delays the collapse?
(registered in results/rl/RESULTS.md)

``python -m rl_harness edge-remedies --lr 1e-3 --arms zero,fp8w,fp8w_tis --seeds 0-11
--out DIR --jobs 2`` runs each arm (:data:`ARMS`) on each seed of the recipe ``edge`` into
``DIR/lr<LR>/<arm>/seed<k>``, the layout of the edge grid (rl_harness.studies.edge): pointed at the
grid's directory, the arms ``zero`` and ``fp8w`` reuse its runs of the same LR and seed
(their configs are checked equal). Every arm of a seed shares the prompts and the sampling
noise (coupled sampling), so the arms pair by seed. ``--report`` writes the report of the
runs already complete, running none. A pair needs one warm-up, and the warm-up's bits are the
machine's (plain torch): ``--also DIR`` reads whole seeds made on another machine in a
directory of their own, each seed's arms from one directory (:func:`seed_sources`).

``DIR/remedies_lr<LR>.md`` (and ``.png``), from the complete runs:

- per arm: runs collapsed persistently (rl_harness.collapse), the restricted time to collapse
  (the persistent collapse step, or the run's length for a run that never collapsed), the
  evaluation endpoint, and how much the remedy acted (:func:`activity`);
- per remedy arm against the control (``fp8w``) on the same seeds: the mean paired difference
  of the restricted time with its 95 % interval and the exact sign-flip test's two-sided p,
  Holm-adjusted over the remedy arms (:func:`holm`); the collapses each side alone had and
  the exact McNemar test of them; the endpoint difference;
- the share of runs not yet collapsed against the step, per arm (the plot).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import collapse, recipes, report, rundir, sweep
from .. import config as config_lib
from ..config import Config
from ..errors import HarnessError
from ..rundir import write_atomic
from . import alarms, edge

History = list[dict[str, Any]]
CONTROL = "fp8w"  # the dose whose collapses the remedies are to delay


@dataclasses.dataclass(frozen=True)
class Arm:
    """A dose of rl_harness.studies.edge plus a remedy: config overrides on the recipe, a factor on
    the learning rate, and whether it decays the LR at the fixed period ``--decay-period``."""

    description: str
    dose: str
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    lr_factor: float = 1.0
    fixed_decay: bool = False


ARMS: dict[str, Arm] = {
    "zero": Arm("no mismatch (the edge grid's zero dose): the reference", "zero"),
    CONTROL: Arm("the fp8-like rollout, no remedy: the control", CONTROL),
    "fp8w_tis": Arm("token TIS: w_t = min(rho_t, 2)", CONTROL, {"remedy.name": "token_tis"}),
    "fp8w_mis": Arm(
        "token MIS (IcePop): a token with rho_t outside [0.5, 2] is dropped",
        CONTROL,
        {"remedy.name": "token_mis"},
    ),
    "fp8w_surge": Arm(
        "the length-surge LR decay (arXiv 2602.01826)",
        CONTROL,
        {"lr_schedule.name": "length_surge"},
    ),
    "fp8w_fixed": Arm(
        "the LR halved every --decay-period steps from the start: the surge decay's "
        "matched-time control",
        CONTROL,
        {"lr_schedule.name": "length_surge"},
        fixed_decay=True,
    ),
    "fp8w_half": Arm("half the learning rate", CONTROL, lr_factor=0.5),
}


def arm_config(
    recipe: str, lr: float, arm: str, seed: int, sets: Sequence[str] = (), decay_period: int = 0
) -> Config:
    """The config of ``arm`` at the grid's learning rate ``lr`` (the run's own LR is
    ``lr`` x its factor) on ``seed``."""
    spec = ARMS[arm]
    if spec.fixed_decay and decay_period < 1:
        raise HarnessError(f"edge-remedies: the arm {arm} needs --decay-period >= 1")
    overrides = {**recipes.overrides(recipe), **edge.DOSES[spec.dose][1], **spec.overrides}
    if spec.fixed_decay:
        overrides["lr_schedule.decay_period"] = decay_period
    run_sets = [*sets, f"train.lr={lr * spec.lr_factor!r}", f"seed={seed}"]
    cfg = config_lib.build(overrides, run_sets)
    return sweep.twin(cfg) if spec.dose == "zero" else cfg


@dataclasses.dataclass(frozen=True)
class Phase:
    """The runs of the remedy phase: its arms on its seeds at one learning rate."""

    recipe: str
    lr: float
    arms: list[str]
    seeds: list[int]
    sets: list[str]
    decay_period: int

    def runs(self, out: Path) -> dict[tuple[str, int], tuple[Config, Path]]:
        """(arm, seed) -> (config, run directory)."""
        return {
            (arm, seed): (
                arm_config(self.recipe, self.lr, arm, seed, self.sets, self.decay_period),
                edge.Cell(self.lr, arm, seed).path(out),
            )
            for seed in self.seeds
            for arm in self.arms
        }


def load(
    phase: Phase, out: Path, also: Sequence[Path] = ()
) -> tuple[dict[tuple[str, int], History], dict[int, Path]]:
    """The metrics of the complete runs, and the directory each seed's runs were read from
    (:func:`seed_sources`); a directory holding another config's run (a reused edge-grid run
    that does not match), or a remedy run that did not start as its control did
    (:func:`check_pairing`), is refused."""
    complete = {directory: _complete_runs(phase, directory) for directory in (out, *also)}
    sources = seed_sources(phase, complete)
    results, paths = {}, {}
    for seed, directory in sources.items():
        for arm in phase.arms:
            if (arm, seed) in complete[directory]:
                paths[arm, seed] = complete[directory][arm, seed]
                results[arm, seed] = rundir.read_metrics(paths[arm, seed])
    check_pairing(results, paths)
    return results, sources


def _complete_runs(phase: Phase, out: Path) -> dict[tuple[str, int], Path]:
    found = {}
    for key, (cfg, path) in phase.runs(out).items():
        if not sweep.complete(cfg, path):
            continue
        if rundir.load_config(path, cfg.task.module) != cfg:
            raise HarnessError(f"edge-remedies: {path} holds a run of another config")
        found[key] = path
    return found


def seed_sources(
    phase: Phase, complete: dict[Path, dict[tuple[str, int], Path]]
) -> dict[int, Path]:
    """Each seed's directory: the first (in the order given: ``--out``, then each ``--also``)
    that holds every arm of the seed complete, or, while none does, the one holding the most
    (the first on a tie). Every arm of a seed is read from one directory, because a pair
    is only a pair when both runs started from one warm-up, made on one kind of machine
    (results/rl/RESULTS.md, section 17's amendment); a seed in no directory is left out."""
    sources = {}
    for seed in phase.seeds:
        counts = {d: sum((arm, seed) in runs for arm in phase.arms) for d, runs in complete.items()}
        best = max(counts.values())
        if best:
            sources[seed] = next(d for d, n in counts.items() if n == best)
    return sources


STEP0_DIGEST = "rollout/response_digests"


def check_pairing(results: dict[tuple[str, int], History], paths: dict[Any, Path]) -> None:
    """A remedy acts on the update only, so a remedy run's step-0 rollout is its control's,
    token for token (the recipe logs each response's digest). A run whose step 0 differs
    started from another warm-up (another CPU vector capability, torch or transformers: see
    the machine line of each summary.md) and cannot be paired with its control: refused."""
    for (arm, seed), history in results.items():
        control = results.get((CONTROL, seed))
        if ARMS[arm].dose != CONTROL or arm == CONTROL or control is None:
            continue
        ours, theirs = history[0].get(STEP0_DIGEST), control[0].get(STEP0_DIGEST)
        if ours is not None and theirs is not None and ours != theirs:
            raise HarnessError(
                f"edge-remedies: {paths[arm, seed]} did not sample the step-0 rollout of "
                f"{paths[CONTROL, seed]}: it started from another warm-up (compare the "
                "machine lines of their summary.md); rerun it where the control ran"
            )


# --- the statistics --------------------------------------------------------------------------


def restricted_time(history: History) -> int:
    """The persistent collapse step, or the number of steps run when the run never
    collapsed (the time to collapse, censored at the run's end)."""
    step = collapse.persistent_collapse_step(history)
    return len(history) if step is None else step


def sign_flip_p(differences: Sequence[float]) -> float:
    """The exact two-sided p of the mean of paired ``differences`` under the sign-flip
    permutation test (every one of the 2^n sign patterns; n up to 20)."""
    n = len(differences)
    if not 0 < n <= 20:
        raise HarnessError(f"sign_flip_p: expected 1 to 20 differences, got {n}")
    observed = abs(sum(differences))
    at_least = sum(
        abs(sum(s * d for s, d in zip(signs, differences))) >= observed - 1e-9
        for signs in itertools.product((1, -1), repeat=n)
    )
    return at_least / 2**n


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of the family ``p_values`` (monotone, capped at 1)."""
    ordered = sorted(p_values, key=p_values.__getitem__)
    adjusted, running = {}, 0.0
    for rank, name in enumerate(ordered):
        running = max(running, min(1.0, (len(ordered) - rank) * p_values[name]))
        adjusted[name] = running
    return adjusted


def activity(runs: Sequence[History], before: int) -> str:
    """How much a remedy acted over ``runs``: the mean share of tokens TIS truncated or MIS
    dropped, over the steps before ``before`` and over the run, and the runs whose LR was
    lowered, with the median step of its first lowering."""
    parts = []
    for key in ("remedy/clipped_frac", "remedy/masked_frac"):
        whole = [statistics.fmean(m[key] for m in h) for h in runs if key in h[0]]
        if any(whole):
            early = [statistics.fmean(m[key] for m in h[:before]) for h in runs]
            parts.append(
                f"{key.split('/')[1]} {statistics.fmean(early):.2g} "
                f"(run {statistics.fmean(whole):.2g})"
            )
    lowered = [first_decay(h) for h in runs]
    steps = [s for s in lowered if s is not None]
    parts.append(
        f"LR lowered in {len(steps)} of {len(runs)} runs"
        + (f", first at step {statistics.median(steps):g} (median)" if steps else "")
    )
    return "; ".join(parts)


def first_decay(history: History) -> int | None:
    """The first step run at a learning rate below the first step's (None: never)."""
    return next((m["step"] for m in history if m["lr"] < history[0]["lr"]), None)


# --- the report ------------------------------------------------------------------------------


def _paired(
    results: dict[tuple[str, int], History], arm: str, seeds: Sequence[int]
) -> list[tuple[History, History]]:
    return [
        (results[arm, s], results[CONTROL, s])
        for s in seeds
        if (arm, s) in results and (CONTROL, s) in results
    ]


def report_markdown(
    results: dict[tuple[str, int], History], phase: Phase, sources: dict[int, Path] | None = None
) -> str:
    """The report; ``sources``, when the seeds were read from several directories, names
    each seed's."""
    seeds = sorted({s for _, s in results})
    horizon = max(len(h) for h in results.values())
    lines = [
        f"Learning rate {phase.lr:g}; complete runs: {len(results)} ({len(seeds)} seeds: "
        f"{', '.join(map(str, seeds))}); the runs are {horizon} steps long.",
        "",
    ]
    if sources:
        by_directory: dict[str, list[str]] = {}
        for seed, directory in sorted(sources.items()):
            by_directory.setdefault(directory.name, []).append(str(seed))
        read = "; ".join(f"seeds {', '.join(s)} from `{d}/`" for d, s in by_directory.items())
        lines += [f"Each seed's arms read from one directory (one machine): {read}.", ""]
    lines += [
        "Per arm: runs collapsed persistently, the restricted time to collapse (the collapse",
        "step, or the run's length when it never collapsed), the endpoint (mean of the last 3",
        "held-out evaluations), mean ± half-width of the 95 % interval over seeds, and how much",
        "the remedy acted (the mean share of tokens truncated or dropped, over steps 0-8 and",
        "over the run; the runs whose LR was lowered):",
        "",
        "| arm | what it is | collapsed | time to collapse | endpoint | the remedy acted |",
        "|---|---|---:|---:|---:|---|",
    ]
    for arm in phase.arms:
        runs = [results[arm, s] for s in seeds if (arm, s) in results]
        if not runs:
            continue
        fell = sum(collapse.persistent_collapse_step(h) is not None for h in runs)
        lines.append(
            f"| {arm} | {ARMS[arm].description} | {fell} of {len(runs)} | "
            f"{report.cell([restricted_time(h) for h in runs], '.0f')} | "
            f"{report.cell([collapse.endpoint(h) for h in runs], '.3f', '.2f')} | "
            f"{activity(runs, 9)} |"
        )
    lines += _paired_lines(results, phase, seeds)
    return "\n".join(lines) + f"\n\n![survival]({_plot_name(phase)})\n"


def _paired_lines(
    results: dict[tuple[str, int], History], phase: Phase, seeds: Sequence[int]
) -> list[str]:
    others = [a for a in phase.arms if a != CONTROL]
    if CONTROL not in phase.arms or not others:
        return []
    rows, p_values = {}, {}
    for arm in others:
        pairs = _paired(results, arm, seeds)
        if not pairs:
            continue
        diffs = [restricted_time(a) - restricted_time(b) for a, b in pairs]
        fell = [
            (
                collapse.persistent_collapse_step(a) is not None,
                collapse.persistent_collapse_step(b) is not None,
            )
            for a, b in pairs
        ]
        only_arm = sum(a and not b for a, b in fell)
        only_control = sum(b and not a for a, b in fell)
        ends = [sweep.minus(collapse.endpoint(a), collapse.endpoint(b)) for a, b in pairs]
        p = sign_flip_p(diffs)
        if arm != "zero":  # the mismatch's own effect: outside the remedies' family
            p_values[arm] = p
        rows[arm] = (diffs, p, only_arm, only_control, ends, len(pairs))
    adjusted = holm(p_values) if p_values else {}
    lines = [
        "",
        f"Paired with the control ({CONTROL}) on the same seeds: the mean difference of the",
        "time to collapse (arm minus control) with its 95 % interval, the exact sign-flip",
        "test's two-sided p and its Holm adjustment over the remedy arms (the zero arm, the",
        "mismatch's own effect, is outside the family); the runs that collapsed under the arm",
        "alone / the control alone, with the exact McNemar test; the endpoint difference:",
        "",
        "| arm | time difference | p | Holm p | collapsed alone: arm / control | McNemar p "
        "| endpoint difference | pairs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, (diffs, p, only_arm, only_control, ends, n) in rows.items():
        holm_p = f"{adjusted[arm]:.3g}" if arm in adjusted else "-"
        lines.append(
            f"| {arm} | {report.cell(diffs, '.1f')} | {p:.3g} | {holm_p} | "
            f"{only_arm} / {only_control} | {alarms.mcnemar(only_arm, only_control):.3g} | "
            f"{report.cell(ends, '.3f', '.2f')} | {n} |"
        )
    return lines


def _plot_name(phase: Phase) -> str:
    return f"remedies_lr{phase.lr:g}.png"


def survival(histories: Sequence[History], horizon: int) -> list[float]:
    """The share of ``histories`` not yet collapsed (persistently) after each step."""
    steps = [restricted_time(h) for h in histories]
    return [sum(t > step for t in steps) / len(steps) for step in range(horizon)]


def plot(results: dict[tuple[str, int], History], phase: Phase, path: Path) -> None:
    """The share of runs not yet collapsed against the step: one panel per remedy arm, each
    beside the control (:data:`CONTROL`, dashed) and the other arms that are no remedy
    (``zero``: dotted), drawn thin over the remedy's wide pale band, so that a remedy equal
    to its control shows as the dashes inside the band; every curve at its true height."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    horizon = max(len(h) for h in results.values())
    curves = {
        arm: (survival(runs, horizon), len(runs))
        for arm in phase.arms
        if (runs := [h for (a, _), h in results.items() if a == arm])
    }
    references = [arm for arm in curves if arm == CONTROL or ARMS[arm].dose != CONTROL]
    remedies = [arm for arm in curves if arm not in references] or references[:1]
    columns = min(3, len(remedies))
    rows = math.ceil(len(remedies) / columns)
    fig, axes = plt.subplots(
        rows, columns, figsize=(4.2 * columns, 3.2 * rows + 0.5), squeeze=False, sharey=True
    )
    for ax, arm in zip(axes.flat, remedies):
        share, n = curves[arm]  # wide and pale, under the references: equal curves both show
        ax.step(
            range(horizon), share, "-", where="post", linewidth=4, alpha=0.5, label=f"{arm} ({n})"
        )
        for reference in references:
            share, n = curves[reference]
            dash = "--" if reference == CONTROL else ":"
            ax.step(
                range(horizon), share, dash, where="post", color="black", label=f"{reference} ({n})"
            )
        ax.set_title(arm, fontsize=9)
        ax.set_xlabel("RL step", fontsize=8)
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=7, loc="lower left")
    for ax in axes[:, 0]:
        ax.set_ylabel("share of seeds not collapsed", fontsize=8)
    for ax in axes.flat[len(remedies) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"Time to persistent collapse by arm, LR {phase.lr:g}: each remedy against the "
        f"{CONTROL} control (dashed)",
        fontsize=10,
    )
    rundir.save_figure(fig, path)


def write_report(phase: Phase, out: Path, also: Sequence[Path] = ()) -> str:
    results, sources = load(phase, out, also)
    if not results:
        raise HarnessError(f"edge-remedies: no complete run under {out} yet")
    text = report_markdown(results, phase, sources if also else {})
    write_atomic(out / f"remedies_lr{phase.lr:g}.md", text)
    report.plot_or_warn(lambda path: plot(results, phase, path), out / _plot_name(phase))
    return text


# --- the command line ------------------------------------------------------------------------


def _arms(text: str) -> list[str]:
    arms = text.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(
            f"expected distinct arms among {', '.join(ARMS)}, got {text!r}"
        )
    return arms


def _lr(text: str) -> float:
    values = edge.numbers(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one learning rate, got {text!r}")
    return values[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="edge", help="the base recipe (default edge)")
    parser.add_argument("--lr", type=_lr, required=True, help="the grid's learning rate")
    parser.add_argument("--arms", type=_arms, required=True, help=f"of {', '.join(ARMS)}")
    parser.add_argument("--seeds", type=edge.seeds, required=True, help="0-11 or 100,101")
    parser.add_argument("--decay-period", type=int, default=0, help="fp8w_fixed's period")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, every run")
    parser.add_argument("--out", required=True, help="the directory (an edge grid's, to reuse)")
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="DIR",
        help="read too: whole seeds made on another machine (each seed from one directory)",
    )
    edge.add_run_arguments(parser)


def main(args: argparse.Namespace) -> int:
    out = rundir.resolved(args.out)
    phase = Phase(args.recipe, args.lr, args.arms, args.seeds, args.set or [], args.decay_period)
    runs = phase.runs(out)  # a bad --recipe, --set or --decay-period fails before any run
    if not args.report:
        edge.run_grid(list(runs.values()), out, jobs=args.jobs, cache_dir=args.cache_dir)
    print(write_report(phase, out, [rundir.resolved(d) for d in args.also]))
    return 0
