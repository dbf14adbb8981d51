"""argparse value types shared by every command line (``python -m bik``, ``python -m
rl_harness`` and its studies, the benchmarks): each rejects a bad value inside argparse, with one
line naming what was expected, before any work starts."""

import argparse
import math


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds below this


def seed(text: str) -> int:
    """argparse type: an integer seed that torch and random both take."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**64 - 1, got {text!r}")
    return value
