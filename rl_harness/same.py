"""Whether two run directories hold the same run, bit for bit.

    python -m rl_harness same RUN_A RUN_B

Compares every logged metric of every step (metrics.jsonl; each value by its exact JSON text,
so NaN equals NaN and 0.0 differs from -0.0) and everything the last checkpoint holds, which
is what a resume reads (checkpoint.pt: the master weights, the optimizer's state and its
param_groups, the LR schedule, the collapse detector and, with a KL term, the reference; each
tensor by its dtype, shape and bytes, loaded memory-mapped so that two large checkpoints fit,
every other value by its type and exact repr). Prints a markdown report; the exit status is
0 when the runs are the same, 1 when they differ (as ``cmp`` does), 2 for a directory that
cannot be read (a metrics.jsonl that is not a regular file, such as a FIFO, included).
Two runs of one config on one machine must be the same: that is the determinism bik promises,
checked on whole runs rather than single kernels.

``--ignore PREFIX`` (repeatable) leaves out the metrics whose key starts with PREFIX: a run
with a measurement-only meter (``rollout.shadow``: ``shadow/...``) against the same run
without it, whose training must be the same bit for bit.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import rundir
from .errors import RunDirError

CHECKPOINT_PARTS = ("master", "optimizer")  # what every checkpoint holds
SHOWN = 10  # metric differences listed; the rest are counted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", help="a run directory")
    parser.add_argument("run_b", help="another run directory")
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="PREFIX",
        help="leave out the metrics whose key starts with PREFIX (e.g. shadow/); repeatable",
    )


def metric_differences(
    a: list[dict[str, Any]], b: list[dict[str, Any]], ignore: tuple[str, ...] = ()
) -> list[str]:
    """One line per difference: a step count, then each step's keys whose values differ
    (keys starting with a prefix of ``ignore`` left out)."""
    lines = [] if len(a) == len(b) else [f"steps logged: {len(a)} and {len(b)}"]
    for row_a, row_b in zip(a, b):
        keys = sorted(
            k
            for k in row_a.keys() | row_b.keys()
            if not k.startswith(ignore) and _text(row_a, k) != _text(row_b, k)
        )
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


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The leaves of a nested state (tensors and plain values), each with its path
    (``state/0/exp_avg``, ``param_groups/0/lr``)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _leaves(value, f"{prefix}/{index}" if prefix else str(index))
    else:
        yield prefix, obj


def _same_leaf(a: Any, b: Any) -> bool:
    """Tensors by :func:`_same_bits`; other values by type and exact repr (NaN equals NaN,
    0.0 differs from -0.0 and from 0)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_bits(a, b)
    return type(a) is type(b) and repr(a) == repr(b)


def _numel(value: Any) -> int:
    import torch

    return value.numel() if isinstance(value, torch.Tensor) else 1


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
    """The differences of two checkpoints, part by part (step, parts one lacks, leaf paths,
    shapes, bits, values), and the number of elements compared (a plain value counts one)."""
    lines = [] if a["step"] == b["step"] else [f"checkpoint step: {a['step']} and {b['step']}"]
    compared = 0
    for part in sorted((a.keys() | b.keys()) - {"step"}):
        if part not in a or part not in b:
            lines.append(f"{part}: only in the {'first' if part in a else 'second'} checkpoint")
            continue
        leaves_a, leaves_b = dict(_leaves(a[part])), dict(_leaves(b[part]))
        if leaves_a.keys() != leaves_b.keys():
            lines.append(f"{part}: different entries ({len(leaves_a)} and {len(leaves_b)})")
            continue
        unequal = [k for k in leaves_a if not _same_leaf(leaves_a[k], leaves_b[k])]
        compared += sum(_numel(value) for value in leaves_a.values())
        if unequal:
            lines.append(
                f"{part}: {len(unequal)} of {len(leaves_a)} entries differ ({unequal[0]}, ...)"
            )
    return lines, compared


def compare(run_a: str | Path, run_b: str | Path, ignore: tuple[str, ...] = ()) -> tuple[bool, str]:
    """Whether the two runs are the same (the metrics of ``ignore``'s prefixes left out), and
    the markdown report that says why."""
    dirs = [Path(run_a), Path(run_b)]
    for d in dirs:
        if not d.is_dir():
            raise RunDirError(f"same: no run directory at {d}")
    metrics = [rundir.read_metrics(d) for d in dirs]
    metric_lines = metric_differences(metrics[0], metrics[1], ignore)
    checkpoint_lines, elements = checkpoint_differences(*[_load(d) for d in dirs])
    same = not metric_lines and not checkpoint_lines
    report = [
        f"# {dirs[0]} and {dirs[1]}: {'the same' if same else 'different'}",
        "",
        f"- metrics: {len(metrics[0])} and {len(metrics[1])} steps; "
        + (f"{len(metric_lines)} differences" if metric_lines else "every value equal")
        + (f" (left out: {', '.join(p + '*' for p in ignore)})" if ignore else ""),
        *[f"  - {line}" for line in metric_lines[:SHOWN]],
        *([f"  - ... and {len(metric_lines) - SHOWN} more"] if len(metric_lines) > SHOWN else []),
        f"- checkpoint: {elements} elements of weights, optimizer, schedule and detector state "
        "compared; " + ("differences" if checkpoint_lines else "every bit equal"),
        *[f"  - {line}" for line in checkpoint_lines],
    ]
    return same, "\n".join(report)


def main(args: argparse.Namespace) -> int:
    same, report = compare(args.run_a, args.run_b, tuple(args.ignore))
    print(report)
    return 0 if same else 1
