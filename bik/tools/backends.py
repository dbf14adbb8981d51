"""``python -m bik backends``: which backend implements which op, how each fixes its order,
and whether it can run here (built, installed, a device it serves)."""

import argparse
import textwrap

import torch

from .. import backends
from ..backends.base import ACCELERATORS, OPS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No arguments: the table covers every registered backend and this machine's devices."""


def check(args: argparse.Namespace) -> None:
    """Nothing to check beyond argparse."""


def _devices() -> list[torch.device]:
    return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def _status(name: str) -> tuple[backends.Backend | None, str]:
    """(the backend or None, where it runs on this machine or why it cannot load)."""
    try:
        backend = backends.load(name)
    except ImportError as error:
        return None, f"not available: {error}"
    usable, refusals = [], []
    for device in _devices():
        try:
            backend.check_device(device)
            usable.append(device.type)
        except RuntimeError as error:
            refusals.append(str(error))
    if usable:
        return backend, f"runs here on {', '.join(usable)}"
    return backend, "loads, but runs on no device here: " + "; ".join(refusals)


def table() -> str:
    """The op x backend matrix (x: implemented), then each backend's order and status."""
    names = [name for name in backends.available_backends() if name != "auto"]
    loaded = {name: _status(name) for name in names}
    # capabilities beyond the ops: the Backend field each row reads
    extras = {"attention sinks": "attention_sinks"}
    extras.update({f"{field} ({ACCELERATORS[field][0]})": field for field in ACCELERATORS})
    rows = (*OPS, *extras)
    width = max(len(row) for row in rows)
    lines = [" " * width + "  " + "  ".join(names)]
    for op in rows:
        cells = []
        for name in names:
            backend = loaded[name][0]
            if backend is None:
                mark = "?"
            elif op in extras:
                mark = "x" if getattr(backend, extras[op]) else "-"
            else:
                mark = "x" if backend.implements(op) else "-"
            cells.append(mark.center(len(name)))
        lines.append(op.ljust(width) + "  " + "  ".join(cells))
    lines.append("(x: implemented, -: not, ?: the backend cannot load here)")
    lines.append("Without an accelerator bik composes the same bits (base kernels, torch):")
    lines += [f"  {field}: {then}" for field, (_, then) in ACCELERATORS.items()]
    lines.append("")
    for name in names:
        backend, status = loaded[name]
        invariant = "" if backend is None or backend.invariant else " [NOT batch-invariant]"
        lines.append(f"{name}{invariant}: {status}")
        if backend is not None:
            lines.append(
                textwrap.fill(backend.order, 96, initial_indent="    ", subsequent_indent="    ")
            )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    print(table())
    return 0
