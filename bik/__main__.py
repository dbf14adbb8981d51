"""Command line: ``python -m bik demo``."""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bik", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="show a row's log-probs moving with batch size under "
                                            "plain torch and staying bit-identical under bik")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from . import demo as demo_module

        return demo_module.run(seed=args.seed)
    return 2


if __name__ == "__main__":
    sys.exit(main())
