"""The mismatch anatomy along training: several `mismatch_anatomy.py` runs of one path, each at
a policy an RL run kept, side by side (results/rl/RESULTS.md, section 14d).

    python benchmarks/anatomy_along_training.py --path hf_bf16 --out DIR \
        pretrained=results/rl/smollm2_anatomy/pretrained step19=.../step19 ...

Reads each point's ``anatomy.json`` and ``anatomy_bins.csv`` and writes ``DIR/along_training.md``:
the path's aggregates at each point (its mean entropy from the entropy bins' midpoints), and,
per entropy bin holding at least ``--min-tokens`` tokens at the first and at the last point,
the mean |delta| at each point and the last point's over the first's (the registered test:
within a factor 2 in every such bin); and ``DIR/along_training.png`` (mean |delta| by entropy
bin, one curve per point).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any

FACTOR = 2.0  # the registered band of section 14d: last / first within [1/2, 2]


def load_point(directory: Path, path: str) -> dict[str, Any]:
    """``path``'s record in ``directory/anatomy.json`` and its entropy bins
    ({(low, high): (tokens, mean |delta|)})."""
    records = json.loads((directory / "anatomy.json").read_text())["paths"]
    found = [r for r in records if r["path"] == path]
    if not found:
        names = [r["path"] for r in records]
        raise SystemExit(f"{directory}: no path {path!r} in anatomy.json (it has {names})")
    bins = {}
    with (directory / "anatomy_bins.csv").open() as f:
        for row in csv.DictReader(f):
            if row["path"] == path and row["axis"] == "entropy":
                bins[float(row["low"]), float(row["high"])] = (
                    int(row["tokens"]),
                    float(row["mean_abs_delta"]),
                )
    return {"record": found[0], "bins": bins}


def mean_entropy(bins: dict[tuple[float, float], tuple[int, float]]) -> float:
    """The tokens' mean entropy, each token at its bin's midpoint."""
    tokens = sum(n for n, _ in bins.values())
    return sum(n * (low + high) / 2 for (low, high), (n, _) in bins.items()) / tokens


def aggregate_table(points: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| point | tokens | mean entropy (nats, bin midpoints) | mean abs delta | p99 | "
        "ratio outside [0.9, 1.1] | abs per-sequence sum at the end: mean (max) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, point in points.items():
        r = point["record"]
        lines.append(
            f"| {name} | {r['tokens']} | {mean_entropy(point['bins']):.2f} | "
            f"{r['mean_abs_delta']:.3g} | {r['p99_abs_delta']:.3g} | "
            f"{100 * r['outside_band_share']:.1f} % | "
            f"{r['abs_cumsum_end_mean']:.3g} ({r['abs_cumsum_end_max']:.3g}) |"
        )
    return lines


def bin_table(points: dict[str, dict[str, Any]], min_tokens: int) -> tuple[list[str], bool]:
    """The per-bin comparison and whether every compared bin lies within FACTOR."""
    names = list(points)
    first, last = points[names[0]]["bins"], points[names[-1]]["bins"]
    compared = sorted(b for b in first if b in last and min(first[b][0], last[b][0]) >= min_tokens)
    header = " | ".join(f"{n}: tokens, mean abs delta" for n in names)
    lines = [
        f"| entropy bin (nats) | {header} | {names[-1]} / {names[0]} | within {FACTOR:g}x |",
        "|---|" + "---:|" * (len(names) + 2),
    ]
    held = True
    for b in compared:
        cells = []
        for n in names:
            tokens, delta = points[n]["bins"].get(b, (0, math.nan))
            cells.append(f"{tokens}, {delta:.3g}")
        ratio = last[b][1] / first[b][1]
        within = 1 / FACTOR <= ratio <= FACTOR
        held &= within
        lines.append(
            f"| {b[0]:g}-{b[1]:g} | " + " | ".join(cells) + f" | {ratio:.2f} | "
            f"{'yes' if within else 'no'} |"
        )
    return lines, held and bool(compared)


def plot(points: dict[str, dict[str, Any]], path: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rl_harness.report import STYLES, plain_ticks

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (name, point) in enumerate(points.items()):
        style, marker = STYLES[index % len(STYLES)]
        bins = sorted(point["bins"].items())
        x = [(low + high) / 2 for (low, high), _ in bins]
        kwargs = dict(linestyle=style, marker=marker, markersize=4, fillstyle="none", label=name)
        left.plot(x, [delta for _, (_, delta) in bins], **kwargs)
        right.plot(x, [tokens for _, (tokens, _) in bins], **kwargs)
    left.set_yscale("log")
    left.set_ylabel("mean |delta log p| in the bin")
    right.set_ylabel("tokens in the bin")
    for ax in (left, right):
        ax.set_xlabel("policy entropy at the token (nats)")
        plain_ticks(ax)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(
        f"Per-token mismatch of the {path} path along training, by entropy "
        "(one curve per kept policy)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out / "along_training.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("points", nargs="+", help="NAME=DIR of mismatch_anatomy.py runs, in order")
    parser.add_argument("--path", default="hf_bf16", help="the anatomy path to compare")
    parser.add_argument("--min-tokens", type=int, default=20, help="tokens a compared bin holds")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if len(args.points) < 2 or any("=" not in p for p in args.points):
        parser.error("points: expected at least two NAME=DIR")
    points = {
        name: load_point(Path(directory), args.path)
        for name, directory in (p.split("=", 1) for p in args.points)
    }
    bins, held = bin_table(points, args.min_tokens)
    names = list(points)
    text = [
        f"# The {args.path} path along training",
        "",
        *aggregate_table(points),
        "",
        f"Entropy bins with at least {args.min_tokens} tokens at {names[0]} and {names[-1]}:",
        "",
        *bins,
        "",
        f"Every compared bin within {FACTOR:g}x: {'yes' if held else 'no'}.",
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "along_training.md").write_text("\n".join(text))
    plot(points, args.path, args.out)
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
