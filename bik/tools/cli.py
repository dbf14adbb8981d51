"""Argument checks shared by the tools: every bad argument stops the command at its start
with one line naming the argument and what was expected, before any model or benchmark runs.

Checks that need only the argument's text run inside argparse (``type=`` / ``action=``);
the rest (the device, a model's family) raise :class:`UsageError`, which ``python -m bik``
prints in argparse's format (``python -m bik <tool>: error: argument <arg>: <message>``)
and exits with status 2, like argparse's own errors.
"""

import argparse
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch


class UsageError(Exception):
    """A command-line argument that cannot work, found after parsing."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"argument {argument}: {message}")
        self.argument = argument


def output_problem(text: str) -> str | None:
    """Why a file cannot be written at path ``text`` (None if it can); touches nothing."""
    if not text:
        return "expected a file path, got ''"
    path = Path(text)
    if path.is_dir():
        return f"{text!r} is a directory; expected a file path inside it, such as {text}/out"
    parent = path.parent
    if not parent.exists():
        return f"the directory {str(parent)!r} of {text!r} does not exist; create it first"
    if not parent.is_dir():
        return f"{str(parent)!r} in {text!r} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the directory {str(parent)!r} of {text!r} is not writable"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{text!r} exists and is not writable"
    return None


def output_file(text: str) -> str:
    """argparse type: a file path that can be written (see :func:`output_problem`)."""
    problem = output_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


class AllOf(argparse.Action):
    """``nargs="+"`` values that must each be one of ``valid``; every unknown value is named
    at once (argparse's ``choices`` stops at the first)."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, valid: Iterable[str], **kwargs
    ) -> None:
        self.valid = list(valid)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        unknown = [v for v in values if v not in self.valid]
        if unknown:
            raise argparse.ArgumentError(
                self, f"unknown {', '.join(unknown)}; expected some of {', '.join(self.valid)}"
            )
        setattr(namespace, self.dest, list(dict.fromkeys(values)))


def check_device(device: str) -> None:
    """Raise :class:`UsageError` when ``device`` is 'cuda' and torch cannot reach a GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        why = (
            "this torch is a CPU-only build"
            if torch.version.cuda is None
            else "torch sees no CUDA device"
        )
        raise UsageError(
            "--device", f"cuda requested but {why} (torch {torch.__version__}); use --device cpu"
        )


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """A tool's description as written: its paragraphs and lists kept."""


def help_text(doc: str | None) -> str:
    """A module docstring as ``--help`` shows it: without reStructuredText markup (double
    backquotes, ``:mod:`` roles)."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "`")
