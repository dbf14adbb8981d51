"""Collapse detection: per-step flags, recorded into the metrics as ``collapse/<flag>``.

The reports (rl_harness.report) read the first step of each flag back from the metrics.

Grad-norm flags (w = ``collapse.window``):

- ``grad_norm_blowup``: this step's grad norm exceeds ``grad_norm_factor`` x the median of
  the w steps before it (a single-step spike).
- ``grad_norm_drop``: the smoothed grad norm, the rolling median of the last w steps (this
  one included; :func:`smoothed_grad_norm`), falls below the same rolling median one window
  earlier (steps t-2w+1 .. t-w) divided by ``grad_norm_drop_factor`` (default 3: a ~3.5x
  grad-norm drop is reported as a precursor of MoE RL collapse), while that earlier median
  exceeds ``grad_norm_floor``. The median ignores a lone small step; a sustained drop raises
  the flag once more than half the window has dropped. Needs 2w steps of history.

Held-out evaluation flag (only at the steps that evaluate, ``eval.every``; rl_harness.evaluate):

- ``eval_drop``: the held-out greedy accuracy has fallen by more than ``reward_drop`` (the
  same fraction as the reward flag, default 0.5) below its peak so far, once that peak exceeds
  :data:`PEAK_FLOOR` (a drop from a near-zero peak is noise, not collapse). Raised by
  :meth:`Detector.update_eval`; the rows of steps without evaluation lack the key.

The collapse step (:func:`collapse_step`) of a run with held-out evaluation is the first step
``eval_drop`` was raised: the pre-registered criterion, measured on a fixed prompt set with
greedy decoding, so neither sampling noise nor a lone grad-norm spike defines it (the
training-signal flags are still recorded and reported, each with its first step). A run
without evaluation keeps the training-signal criterion: the first ``reward_drop``,
``grad_norm_blowup`` or ``grad_norm_drop``.

Read back after a run (:func:`persistent_collapse_step`, :func:`signature`, :func:`endpoint`;
the stability-edge experiment, rl_harness.studies.edge, registers these): a *persistent* collapse
needs the drop to last, so that a dip the policy climbs out of is not counted: the held-out
accuracy below half its running peak on :data:`PERSIST_EVALS` consecutive evaluations, or the
training reward's ``reward_drop`` flag raised on :data:`PERSIST_STEPS` consecutive steps.
Computed from the recorded flags, it applies to every run already recorded.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import CollapseConfig

FLAGS = (
    "reward_drop",
    "grad_norm_blowup",
    "grad_norm_drop",
    "k3_growth",
    "ess_collapse",
    "length_surge",
)
EVAL_FLAGS = ("eval_drop",)  # raised at evaluation steps only (Detector.update_eval)
COLLAPSE_FLAGS = ("reward_drop", "grad_norm_blowup", "grad_norm_drop")
EVAL_METRIC = "eval/accuracy"
PEAK_FLOOR = 0.1  # a reward or accuracy peak must exceed this before a drop from it counts
PERSIST_EVALS = 2  # consecutive evaluations below half the running peak: a persistent collapse
PERSIST_STEPS = 10  # or consecutive steps with the training reward's drop flag raised
ENDPOINT_EVALS = 3  # the evaluation endpoint: the mean of the last this many evaluations
SIGNATURE_WINDOW = 10  # steps before a collapse that the signature flags look at
SIGNATURE_FACTOR = 2.0  # a signature quantity must reach this x its first window's mean


def smoothed_grad_norm(grad_norms: list[float], window: int, lag: int = 0) -> float | None:
    """The rolling median of the ``window`` grad norms ending ``lag`` steps before the last
    one (None while there are fewer than ``window + lag`` of them)."""
    if len(grad_norms) < window + lag:
        return None
    end = len(grad_norms) - lag
    return statistics.median(grad_norms[end - window : end])


class Detector:
    def __init__(self, cfg: CollapseConfig) -> None:
        self.cfg = cfg
        self.history: dict[str, list[float]] = {"reward": [], "grad_norm": [], "length": []}
        self.best_reward: float | None = None
        self.best_eval: float | None = None  # the held-out accuracy's peak so far

    def state_dict(self) -> dict[str, Any]:
        """A copy of everything the flags depend on: a detector loading it raises the flags
        an uninterrupted one would."""
        history = {key: list(values) for key, values in self.history.items()}
        return {"history": history, "best_reward": self.best_reward, "best_eval": self.best_eval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {key: list(values) for key, values in state["history"].items()}
        self.best_reward = state["best_reward"]
        self.best_eval = state.get("best_eval")  # absent from checkpoints before evaluation

    def update_eval(self, accuracy: float) -> dict[str, bool]:
        """Flags raised by a held-out accuracy (dict flag -> bool): ``eval_drop``."""
        self.best_eval = max(self.best_eval or accuracy, accuracy)
        drop = (
            self.best_eval > PEAK_FLOOR and accuracy < (1 - self.cfg.reward_drop) * self.best_eval
        )
        return {"eval_drop": drop}

    def update(self, metrics: dict[str, Any]) -> dict[str, bool]:
        """Flags raised by this step's ``metrics`` (dict flag -> bool)."""
        cfg, h, w = self.cfg, self.history, self.cfg.window
        h["reward"].append(metrics["reward/mean"])
        h["grad_norm"].append(metrics["grad_norm"])
        h["length"].append(metrics["response_length/mean"])
        flags = dict.fromkeys(FLAGS, False)
        if len(h["reward"]) >= w:
            mean_reward = sum(h["reward"][-w:]) / w
            self.best_reward = max(self.best_reward or mean_reward, mean_reward)
            flags["reward_drop"] = (
                self.best_reward > PEAK_FLOOR
                and mean_reward < (1 - cfg.reward_drop) * self.best_reward
            )
        if len(h["grad_norm"]) > w:
            median = statistics.median(h["grad_norm"][-w - 1 : -1])
            flags["grad_norm_blowup"] = metrics["grad_norm"] > cfg.grad_norm_factor * max(
                median, 1e-8
            )
        level = smoothed_grad_norm(h["grad_norm"], w)
        earlier = smoothed_grad_norm(h["grad_norm"], w, lag=w)
        if level is not None and earlier is not None:
            flags["grad_norm_drop"] = (
                earlier > cfg.grad_norm_floor and level < earlier / cfg.grad_norm_drop_factor
            )
        flags["k3_growth"] = metrics.get("mismatch/k3_kl", 0.0) > cfg.k3_max
        flags["ess_collapse"] = metrics.get("mismatch/is_ess", 1.0) < cfg.ess_min
        if len(h["length"]) >= 2 * w:
            baseline = sum(h["length"][:w]) / w
            flags["length_surge"] = sum(h["length"][-w:]) / w >= cfg.length_surge * baseline
        return flags


def first_steps(history: list[dict[str, Any]]) -> dict[str, int]:
    """{flag: first step it was raised} over a run's metrics."""
    first: dict[str, int] = {}
    for m in history:
        for flag in FLAGS + EVAL_FLAGS:
            if m.get(f"collapse/{flag}"):
                first.setdefault(flag, m["step"])
    return first


def evaluated(history: list[dict[str, Any]]) -> bool:
    """Whether a run's metrics hold held-out evaluations."""
    return any(EVAL_METRIC in m for m in history)


def collapse_step(history: list[dict[str, Any]]) -> int | None:
    """The first collapse step: with held-out evaluation the first ``eval_drop``, else the
    first reward drop, grad-norm blow-up or drop (see the module docstring)."""
    criterion = EVAL_FLAGS if evaluated(history) else COLLAPSE_FLAGS
    steps = [step for flag, step in first_steps(history).items() if flag in criterion]
    return min(steps) if steps else None


def _first_streak(steps: list[int], raised: list[bool], length: int) -> int | None:
    """The step that starts the first run of ``length`` consecutive raised entries."""
    streak = 0
    for i, up in enumerate(raised):
        streak = streak + 1 if up else 0
        if streak == length:
            return steps[i - length + 1]
    return None


def persistent_collapse_step(history: list[dict[str, Any]]) -> int | None:
    """The first step of a persistent collapse (see the module docstring), or None: the
    earlier of the held-out streak's first evaluation step and the reward streak's first
    step."""
    evals = [m for m in history if "collapse/eval_drop" in m]
    candidates = [
        _first_streak(
            [m["step"] for m in evals],
            [bool(m["collapse/eval_drop"]) for m in evals],
            PERSIST_EVALS,
        ),
        _first_streak(
            [m["step"] for m in history],
            [bool(m.get("collapse/reward_drop")) for m in history],
            PERSIST_STEPS,
        ),
    ]
    found = [step for step in candidates if step is not None]
    return min(found) if found else None


def endpoint(history: list[dict[str, Any]]) -> float | None:
    """The mean held-out accuracy of the last :data:`ENDPOINT_EVALS` evaluations (None: the
    run evaluated fewer times)."""
    accuracies = [m[EVAL_METRIC] for m in history if EVAL_METRIC in m]
    if len(accuracies) < ENDPOINT_EVALS:
        return None
    return statistics.fmean(accuracies[-ENDPOINT_EVALS:])


SIGNATURES = {  # flag -> the metric whose rise it marks
    "log_ppl_spike": "mismatch/log_ppl_abs_diff",  # eq. 8 of arXiv 2602.01826 per token (verl)
    "k3_spike": "mismatch/k3_kl",
    "grad_norm_rise": "grad_norm",
}


def window_means(history: list[dict[str, Any]], key: str, step: int) -> tuple[float, float]:
    """``key``'s mean over the first :data:`SIGNATURE_WINDOW` steps and over the
    :data:`SIGNATURE_WINDOW` steps up to ``step`` (a row without ``key`` counts 0). The two
    windows overlap when ``step`` comes before step 2 x :data:`SIGNATURE_WINDOW` - 1."""
    first = history[:SIGNATURE_WINDOW]
    last = [m for m in history if step - SIGNATURE_WINDOW < m["step"] <= step] or first
    return (
        statistics.fmean(m.get(key, 0.0) for m in first),
        statistics.fmean(m.get(key, 0.0) for m in last),
    )


def signature(history: list[dict[str, Any]], step: int) -> dict[str, bool]:
    """The papers' collapse signature before ``step``: each :data:`SIGNATURES` metric's mean
    over the :data:`SIGNATURE_WINDOW` steps up to ``step`` at least :data:`SIGNATURE_FACTOR`
    x its mean over the first window (and above 0; :func:`window_means`), and
    ``length_surge`` (the recorded flag) raised at or before ``step``."""
    flags = {}
    for flag, key in SIGNATURES.items():
        before, now = window_means(history, key, step)
        flags[flag] = now > 0 and now >= SIGNATURE_FACTOR * before
    flags["length_surge"] = any(
        m.get("collapse/length_surge") for m in history if m["step"] <= step
    )
    return flags
