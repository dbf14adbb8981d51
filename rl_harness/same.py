"""Whether two run directories hold the same run, bit for bit.

    python -m rl_harness same RUN_A RUN_B

Compares every logged metric of every step (metrics.jsonl; each value by its exact JSON text,
so NaN equals NaN and 0.0 differs from -0.0) and the last checkpoint's master weights and
optimizer state (checkpoint.pt; each tensor's dtype, shape and bytes, loaded memory-mapped so
that two large checkpoints fit). Prints a markdown report; the exit status is 0 when the runs
are the same, 1 when they differ (as ``cmp`` does), 2 for a directory that cannot be read.
Two runs of one config on one machine must be the same: that is the determinism bik promises,
checked on whole runs rather than single kernels.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import rundir
from .errors import RunDirError

CHECKPOINT_PARTS = ("master", "optimizer")
SHOWN = 10  # metric differences listed; the rest are counted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", help="a run directory")
    parser.add_argument("run_b", help="another run directory")


def metric_differences(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """One line per difference: a step count, then each step's keys whose values differ."""
    lines = [] if len(a) == len(b) else [f"steps logged: {len(a)} and {len(b)}"]
    for row_a, row_b in zip(a, b):
        keys = sorted(k for k in row_a.keys() | row_b.keys() if _text(row_a, k) != _text(row_b, k))
        if keys:
            lines.append(f"step {row_a.get('step')}: {', '.join(keys)}")
    return lines


def _text(row: dict[str, Any], key: str) -> str:
    """A metric's exact text (floats print in full; NaN is "NaN"); a missing key is unique."""
    return json.dumps(row[key]) if key in row else "<missing>"


def _same_bits(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (torch.equal alone promotes dtypes and finds NaN != NaN)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The tensors of a nested state dict, each with its path (``state/0/exp_avg``)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}/{index}" if prefix else str(index))


def _load(run_dir: Path) -> dict[str, Any]:
    import torch

    path = run_dir / rundir.CHECKPOINT
    if not path.exists():
        raise RunDirError(f"same: {run_dir} has no {rundir.CHECKPOINT}")
    try:
        state = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except Exception as error:
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise RunDirError(f"same: {path} is not a readable checkpoint ({reason})") from None
    if not isinstance(state, dict) or not {"step", *CHECKPOINT_PARTS} <= set(state):
        raise RunDirError(f"same: {path} is not an rl_harness checkpoint")
    return state


def checkpoint_differences(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], int]:
    """The differences of two checkpoints (step, tensor paths, shapes, bits) and the number
    of tensor elements compared."""
    lines = [] if a["step"] == b["step"] else [f"checkpoint step: {a['step']} and {b['step']}"]
    compared = 0
    for part in CHECKPOINT_PARTS:
        tensors_a, tensors_b = dict(_tensors(a[part])), dict(_tensors(b[part]))
        if tensors_a.keys() != tensors_b.keys():
            lines.append(f"{part}: different tensors ({len(tensors_a)} and {len(tensors_b)})")
            continue
        unequal = [k for k in tensors_a if not _same_bits(tensors_a[k], tensors_b[k])]
        compared += sum(t.numel() for t in tensors_a.values())
        if unequal:
            lines.append(
                f"{part}: {len(unequal)} of {len(tensors_a)} tensors differ ({unequal[0]}, ...)"
            )
    return lines, compared


def compare(run_a: str | Path, run_b: str | Path) -> tuple[bool, str]:
    """Whether the two runs are the same, and the markdown report that says why."""
    dirs = [Path(run_a), Path(run_b)]
    for d in dirs:
        if not d.is_dir():
            raise RunDirError(f"same: no run directory at {d}")
    metrics = [rundir.read_metrics(d) for d in dirs]
    metric_lines = metric_differences(*metrics)
    checkpoint_lines, elements = checkpoint_differences(*[_load(d) for d in dirs])
    same = not metric_lines and not checkpoint_lines
    report = [
        f"# {dirs[0]} and {dirs[1]}: {'the same' if same else 'different'}",
        "",
        f"- metrics: {len(metrics[0])} and {len(metrics[1])} steps; "
        + (f"{len(metric_lines)} differences" if metric_lines else "every value equal"),
        *[f"  - {line}" for line in metric_lines[:SHOWN]],
        *([f"  - ... and {len(metric_lines) - SHOWN} more"] if len(metric_lines) > SHOWN else []),
        f"- checkpoint: {elements} elements of weights and optimizer state compared; "
        + ("differences" if checkpoint_lines else "every bit equal"),
        *[f"  - {line}" for line in checkpoint_lines],
    ]
    return same, "\n".join(report)


def main(args: argparse.Namespace) -> int:
    same, report = compare(args.run_a, args.run_b)
    print(report)
    return 0 if same else 1
