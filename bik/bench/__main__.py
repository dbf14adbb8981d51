"""python -m bik.bench [--device cpu|cuda] [--ops ...] [--quick] [--json FILE] [--markdown FILE]
[--plot FILE]: bik vs the non-invariant baselines, measured in the same run."""

import argparse
import sys

from . import DTYPES, HEADER, markdown, run


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bik.bench", description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ops", nargs="+", help="only these ops (e.g. linear attention_decode)")
    parser.add_argument(
        "--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"]
    )
    parser.add_argument(
        "--quick", action="store_true", help="small shapes, about a minute on a CPU"
    )
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per timed sample set")
    parser.add_argument("--json", help="write the records to this JSON file")
    parser.add_argument("--markdown", help="write the table, with the device named, to this file")
    parser.add_argument("--plot", help="write a PNG bar chart of the ratios (needs matplotlib)")
    args = parser.parse_args(argv)
    print(HEADER)
    result = run(
        device=args.device,
        ops=args.ops,
        dtypes=args.dtypes,
        quick=args.quick,
        min_time=args.min_time,
        json_path=args.json,
        plot_path=args.plot,
    )
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(markdown(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
