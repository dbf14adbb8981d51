"""Learning-rate schedules: constant, or the length-surge decay of arXiv 2602.01826."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import LRScheduleConfig


class LRSchedule:
    """The schedule ``lr_schedule.name`` names. ``constant``: the LR stays lr0.
    ``length_surge``: Algorithm 1 of arXiv 2602.01826 with its trigger: keep lr0 until the
    mean response length surges (window mean >= surge_ratio x the first window's), then halve
    the LR every decay_period steps (period = period_factor x surge step, or a fixed
    ``decay_period``), never below min_ratio x lr0."""

    def __init__(self, cfg: LRScheduleConfig, lr0: float) -> None:
        self.cfg, self.lr0, self.lr = cfg, lr0, lr0
        self.lengths: list[float] = []
        self.surge_step: int | None = None
        self.period: int | None = cfg.decay_period or None

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "lengths": self.lengths,
            "surge_step": self.surge_step,
            "period": self.period,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr, self.lengths = state["lr"], list(state["lengths"])
        self.surge_step, self.period = state["surge_step"], state["period"]

    def step(self, step: int, mean_length: float) -> float:
        """Record step ``step``'s mean response length; return the LR for the next update."""
        cfg = self.cfg
        window = cfg.surge_window
        self.lengths.append(mean_length)
        if cfg.name != "length_surge":
            return self.lr
        if self.surge_step is None and len(self.lengths) >= 2 * window:
            baseline = sum(self.lengths[:window]) / window
            recent = sum(self.lengths[-window:]) / window
            if recent >= cfg.surge_ratio * baseline:
                self.surge_step = step
                self.period = self.period or max(1, round(cfg.period_factor * step))
        if (
            self.period
            and (self.surge_step is not None or cfg.decay_period)
            and step > 0
            and step % self.period == 0
        ):
            self.lr = max(self.lr / 2, cfg.min_ratio * self.lr0)
        return self.lr
