"""The plug-ins' two switches, read from the environment every verl process inherits."""

from __future__ import annotations

import os

ROLLOUT_NAME = "bik"  # actor_rollout_ref.rollout.name of bik's rollout
NATIVE_ENV = "BIK_VERL_NATIVE"  # 1: neither side patched (the negative control)
AUDIT_ENV = "BIK_VERL_AUDIT_EVERY"  # N: in bypass mode, recompute and compare every Nth step


def native() -> bool:
    """True when the run is the negative control: verl's own numerics on both sides."""
    value = os.environ.get(NATIVE_ENV, "0").strip().lower()
    if value not in ("0", "1", "", "false", "true"):
        raise ValueError(f"{NATIVE_ENV}: expected 0 or 1, got {value!r}")
    return value in ("1", "true")


def audit_every() -> int:
    """Every how many steps a bypass-mode run recomputes pi_old to check it (0: never)."""
    value = os.environ.get(AUDIT_ENV, "0").strip()
    if not value.isdigit():
        raise ValueError(
            f"{AUDIT_ENV}: expected a whole number of steps (0: no audit), got {value!r}"
        )
    return int(value)
