"""Collapse detection: per-step flags; the first flagged step goes into the summary."""

import statistics

FLAGS = (
    "reward_drop",
    "grad_norm_blowup",
    "grad_norm_drop",
    "k3_growth",
    "ess_collapse",
    "length_surge",
)
COLLAPSE_FLAGS = ("reward_drop", "grad_norm_blowup", "grad_norm_drop")


class Detector:
    def __init__(self, cfg):
        self.cfg = cfg
        self.history = {"reward": [], "grad_norm": [], "length": []}
        self.best_reward = None
        self.first = {}  # flag -> first step it fired

    def state_dict(self):
        return {"history": self.history, "best_reward": self.best_reward, "first": self.first}

    def load_state_dict(self, state):
        self.history, self.best_reward = state["history"], state["best_reward"]
        self.first = {k: int(v) for k, v in state["first"].items()}

    def update(self, step, metrics):
        """Flags raised at ``step`` (dict flag -> bool), recorded into metrics as collapse/*."""
        cfg, h, w = self.cfg, self.history, self.cfg["window"]
        h["reward"].append(metrics["reward/mean"])
        h["grad_norm"].append(metrics["grad_norm"])
        h["length"].append(metrics["response_length/mean"])
        flags = dict.fromkeys(FLAGS, False)
        if len(h["reward"]) >= w:
            mean_reward = sum(h["reward"][-w:]) / w
            self.best_reward = max(self.best_reward or mean_reward, mean_reward)
            flags["reward_drop"] = (
                self.best_reward > 0.1 and mean_reward < (1 - cfg["reward_drop"]) * self.best_reward
            )
        if len(h["grad_norm"]) > w:
            median = statistics.median(h["grad_norm"][-w - 1 : -1])
            flags["grad_norm_blowup"] = metrics["grad_norm"] > cfg["grad_norm_factor"] * max(
                median, 1e-8
            )
            flags["grad_norm_drop"] = (
                median > cfg["grad_norm_floor"]
                and metrics["grad_norm"] < median / cfg["grad_norm_factor"]
            )
        flags["k3_growth"] = metrics.get("mismatch/k3_kl", 0.0) > cfg["k3_max"]
        flags["ess_collapse"] = metrics.get("mismatch/is_ess", 1.0) < cfg["ess_min"]
        if len(h["length"]) >= 2 * w:
            baseline = sum(h["length"][:w]) / w
            flags["length_surge"] = sum(h["length"][-w:]) / w >= cfg["length_surge"] * baseline
        for flag, raised in flags.items():
            if raised:
                self.first.setdefault(flag, step)
        return flags

    def collapse_step(self):
        steps = [self.first[f] for f in COLLAPSE_FLAGS if f in self.first]
        return min(steps) if steps else None
