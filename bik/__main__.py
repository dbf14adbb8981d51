"""Command line: ``python -m bik demo|verify|bench ...`` (``python -m bik.bench`` is an alias)."""

import argparse
import sys

from .tools import bench, demo, verify

TOOLS = {
    "demo": (demo, "show plain torch moving with the batch and bik staying bit-identical"),
    "verify": (verify, "run the invariance checks on a causal LM, unpatched and patched"),
    "bench": (bench, "time bik's kernels against the non-invariant baselines, same run"),
}


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process arguments) and run the chosen tool."""
    parser = argparse.ArgumentParser(prog="python -m bik", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, summary) in TOOLS.items():
        module.add_arguments(commands.add_parser(name, help=summary, description=module.__doc__))
    args = parser.parse_args(argv)
    return TOOLS[args.command][0].main(args)


if __name__ == "__main__":
    sys.exit(main())
