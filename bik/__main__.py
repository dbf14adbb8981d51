"""Command line: ``python -m bik demo`` and ``python -m bik verify``."""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bik", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="show a row's log-probs moving with batch size under "
        "plain torch and staying bit-identical under bik",
    )
    demo.add_argument("--seed", type=int, default=0)
    check = commands.add_parser(
        "verify", help="run the invariance checks on a causal LM, unpatched and patched with bik"
    )
    check.add_argument(
        "--model",
        default="all",
        help="a preset (tiny-llama, tiny-mistral, tiny-qwen2, tiny-qwen3), 'all' "
        "(default: every preset) or a local model directory",
    )
    check.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    check.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument(
        "--skip-unpatched",
        action="store_true",
        help="do not run the checks on the unpatched model first",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from . import demo as demo_module

        return demo_module.run(seed=args.seed)
    from . import verify as verify_module

    return verify_module.main(args)


if __name__ == "__main__":
    sys.exit(main())
