"""bik.hf.StaticDecoder with fused q/k/v and gate/up projections against separate ones.

A random model of SmolLM2-135M's shapes, patched by bik.patch_model, decodes ``--new``
tokens after a ``--prompt``-token prompt through two StaticDecoders (``fuse_projections``
False and True; steps eager on the CPU, CUDA graphs on a GPU), their logits compared bit for
bit first, then each generate timed alternately (median of ``--reps``), so machine load hits
both alike. Writes markdown:

    python benchmarks/fused_projections.py [--batch 1 16] --markdown F.md
"""

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

import bik
from bik.testing import cases
from bik.testing.machine import cpu_numerics


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(batch: int, prompt: int, new: int, reps: int, device: torch.device) -> dict:
    _, patched = cases.plain_and_patched(cases.smollm2_config(prompt + new), device, torch.bfloat16)
    ids = torch.randint(1, 1000, (batch, prompt), device=device)
    mask = torch.ones_like(ids)
    separate = bik.hf.StaticDecoder(patched, prompt + new)
    fused = bik.hf.StaticDecoder(patched, prompt + new, fuse_projections=True)
    equal = torch.equal(separate.generate(ids, mask, new)[1], fused.generate(ids, mask, new)[1])
    times: dict[str, list[float]] = {"separate": [], "fused": []}
    for _ in range(reps):
        times["separate"].append(_timed(lambda: separate.generate(ids, mask, new)))
        times["fused"].append(_timed(lambda: fused.generate(ids, mask, new)))
    medians = {name: statistics.median(values) for name, values in times.items()}
    return dict(batch=batch, logits_equal=equal, **medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--markdown", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    machine = torch.cuda.get_device_name() if device.type == "cuda" else cpu_numerics()
    lines = [
        "# StaticDecoder: fused q/k/v and gate/up projections vs separate",
        "",
        f"Machine: {machine} ({platform.machine()}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads. SmolLM2-135M shapes, bf16, random weights, "
        f"{args.prompt}-token prompts, {args.new} new tokens, median of {args.reps} "
        "alternating generates (prefill included).",
        "",
        "| batch | logits equal | separate (s) | fused (s) | separate / fused |",
        "|---|---|---|---|---|",
    ]
    for batch in args.batch:
        row = measure(batch, args.prompt, args.new, args.reps, device)
        print(row, flush=True)
        lines.append(
            f"| {batch} | {row['logits_equal']} | {row['separate']:.3f} | {row['fused']:.3f} | "
            f"{row['separate'] / row['fused']:.2f}x |"
        )
    args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
