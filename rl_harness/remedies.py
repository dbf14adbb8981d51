"""Mismatch remedies: importance weights / rejection masks, and the length-surge LR decay.

Every weighting remedy returns ``(weights [B, T], keep [B, T])`` from the old-policy log-probs
the trainer recomputed (``old``) and the rollout's (``rollout``), with rho = exp(old - rollout).
Names follow verl / slime usage (see the metrics reference).
"""

import torch


def _seq_mean(x, mask):
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def weights(cfg, old, rollout, mask):
    """(weights, keep, stats) for remedy ``cfg['name']``; stats: clipped / masked fractions."""
    m = mask.float()
    r = (old - rollout) * m
    rho = torch.exp(r)
    ones = torch.ones_like(rho)
    name, clip = cfg["name"], cfg["clip"]
    w, keep = ones, ones
    if name == "token_tis":  # truncated IS per token
        w = rho.clamp(max=clip)
    elif name == "seq_tis":  # truncated sequence IS: prod_t rho_t, capped
        w = torch.exp(r.sum(-1, keepdim=True)).clamp(max=clip).expand_as(rho)
    elif name == "token_mis":  # IcePop: keep rho only inside [low, high]
        inside = ((rho >= cfg["low"]) & (rho <= cfg["high"])).float()
        w, keep = rho * inside, inside
    elif name == "geo_is":  # geometric-mean sequence IS (length-invariant), capped
        w = torch.exp(_seq_mean(r, m)).clamp(max=clip).expand_as(rho)
    elif name == "geo_rs":  # geometric-mean rejection (length-invariant)
        geo = torch.exp(_seq_mean(r, m))
        keep = ((geo >= cfg["geo_low"]) & (geo <= cfg["geo_high"])).float().expand_as(rho)
    elif name == "k1_rs":
        keep = (_seq_mean(-r, m).abs() <= cfg["k_threshold"]).float().expand_as(rho)
    elif name == "k3_rs":
        keep = (_seq_mean(rho - r - 1.0, m) <= cfg["k_threshold"]).float().expand_as(rho)
    elif name == "token_veto":  # drop a sequence holding any token with rho below the veto
        vetoed = ((rho < cfg["veto"]) & mask.bool()).any(-1, keepdim=True)
        keep = (~vetoed).float().expand_as(rho)
    w = w * keep
    if cfg["self_normalize"]:
        w = w / _masked_mean(w, m).clamp(min=1e-12)
    valid = m.sum().clamp(min=1)
    stats = {
        "remedy/masked_frac": float(((1 - keep) * m).sum() / valid),
        "remedy/clipped_frac": float(((rho > clip) & mask.bool()).float().sum() / valid)
        if name in ("token_tis", "seq_tis", "geo_is")
        else 0.0,
    }
    return w, keep, stats


def _masked_mean(x, m):
    return (x * m).sum() / m.sum().clamp(min=1)


class LengthSurgeLR:
    """Algorithm 1 of arXiv 2602.01826 with its trigger: keep lr0 until the mean response length
    surges (window mean >= surge_ratio x the first window's), then halve the LR every
    decay_period steps (period = period_factor x surge step, or a fixed ``decay_period``),
    never below min_ratio x lr0."""

    def __init__(self, cfg, lr0):
        self.cfg, self.lr0, self.lr = cfg, lr0, lr0
        self.lengths, self.surge_step = [], None
        self.period = cfg["decay_period"] or None

    def state_dict(self):
        return {
            "lr": self.lr,
            "lengths": self.lengths,
            "surge_step": self.surge_step,
            "period": self.period,
        }

    def load_state_dict(self, state):
        self.lr, self.lengths = state["lr"], list(state["lengths"])
        self.surge_step, self.period = state["surge_step"], state["period"]

    def step(self, step, mean_length):
        """Record step ``step``'s mean response length; return the LR for the next update."""
        window = self.cfg["surge_window"]
        self.lengths.append(mean_length)
        if self.cfg["name"] != "length_surge":
            return self.lr
        if self.surge_step is None and len(self.lengths) >= 2 * window:
            baseline = sum(self.lengths[:window]) / window
            recent = sum(self.lengths[-window:]) / window
            if recent >= self.cfg["surge_ratio"] * baseline:
                self.surge_step = step
                self.period = self.period or max(1, round(self.cfg["period_factor"] * step))
        if (
            self.period
            and (self.surge_step is not None or self.cfg["decay_period"])
            and step > 0
            and step % self.period == 0
        ):
            self.lr = max(self.lr / 2, self.cfg["min_ratio"] * self.lr0)
        return self.lr
