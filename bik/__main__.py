"""Command line: ``python -m bik demo|verify|bench|backends|model ...``."""

import argparse
import sys

from .testing import models
from .tools import backends, bench, demo, model, verify
from .tools.cli import HelpFormatter, UsageError, help_text

TOOLS = {
    "demo": (demo, "show plain torch moving with the batch and bik staying bit-identical"),
    "verify": (verify, "run the invariance checks on a causal LM, unpatched and patched"),
    "bench": (bench, "time bik's kernels against the non-invariant baselines, same run"),
    "backends": (backends, "which backend implements which op, its order, whether it runs here"),
    "model": (model, "prepare a real pretrained model (first use) and print its directory"),
}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process arguments) and run the chosen tool.

    A bad argument exits with status 2 and one line naming it (argparse's format), before
    the tool does any work: argparse checks what the text alone decides, then the tool's
    ``check(args)`` what needs the machine (the device, a model's family).
    """
    parser = argparse.ArgumentParser(
        prog="python -m bik", description=help_text(__doc__), formatter_class=HelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, (module, summary) in TOOLS.items():
        parsers[name] = commands.add_parser(
            name,
            help=summary,
            description=help_text(module.__doc__),
            formatter_class=HelpFormatter,
        )
        module.add_arguments(parsers[name])
    args = parser.parse_args(argv)
    tool = TOOLS[args.command][0]
    try:
        tool.check(args)
        return tool.main(args)
    except UsageError as error:
        parsers[args.command].error(str(error))
    except models.ModelUnavailableError as error:
        # a real model the tool needs cannot be had (offline, damaged cache): one line
        parsers[args.command].error(str(error))


if __name__ == "__main__":
    sys.exit(main())
