"""Where a bik decode step's GPU time goes: host work per call, or the kernels themselves.

At decode shapes every bik linear on the H100 took >= 0.09 ms whatever its size, a few us of
bandwidth: host work (argument checks, descriptors, the launch) dominates. This probe runs a
chain of decode-shaped calls (one per layer, each with its own weight, as a model's layers)
eagerly and replayed from a CUDA graph, for bik and for torch, and reports the time per call of
each: the graph replay is the kernels' time without host work. It also checks that the graph
gives the eager call's bits (a graph replays the same kernels; bik's order must survive it).

    python benchmarks/cuda_graph_probe.py [--layers 24] [--json PATH] [--profile [linear] [paged]]

--profile also prints where the host time of eager calls goes (cProfile, by time spent in each
function itself, then by cumulative time): bik.linear on the first linear case (the default),
bik's paged attention decoding one sequence over 8192 paged keys (the bench's case), or both.

Needs a CUDA device; without one it runs the eager chains on the CPU to check itself.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import bik
from bik.testing.cases import paged_decode

# (label, rows M, K, N): decode batches through SmolLM2-135M's and Llama-3.1-8B's projections
LINEARS = [
    ("SmolLM2 q/o", 1, 576, 576),
    ("SmolLM2 gate/up", 1, 576, 1536),
    ("SmolLM2 down", 1, 1536, 576),
    ("Llama-8B q/o", 1, 4096, 4096),
    ("Llama-8B q/o", 16, 4096, 4096),
    ("Llama-8B gate/up", 16, 4096, 14336),
    ("Llama-8B down", 16, 14336, 4096),
]
NORMS = [("SmolLM2", 1, 576), ("Llama-8B", 16, 4096)]


def chain(op: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[], list]:
    """One call of ``op`` per layer's weight on the same input: a decode step's calls."""
    return lambda: [op(x, w) for w in weights]


def per_call_ms(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Median over 5 timings of ``fn``, divided by the ``calls`` it makes."""
    times = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / 10)
    return statistics.median(times) / calls * 1e3


def graphed(fn: Callable[[], list]) -> tuple[Callable[[], None], list]:
    """(replay, outputs): ``fn`` captured once in a CUDA graph (after warm-up calls on a side
    stream, as torch's docs ask), and the static tensors its replays write."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph.replay, outputs


def probe(name: str, bik_fn, torch_fn, calls: int, device: torch.device) -> dict:
    """Eager and graphed ms per call of both chains, and whether the graph keeps bik's bits."""
    row: dict = {"case": name, "calls": calls}
    eager = bik_fn()
    row["bik_eager_ms"] = per_call_ms(bik_fn, calls, device)
    row["torch_eager_ms"] = per_call_ms(torch_fn, calls, device)
    if device.type != "cuda":
        return row
    for label, fn in (("bik", bik_fn), ("torch", torch_fn)):
        try:
            replay, outputs = graphed(fn)
            row[f"{label}_graph_ms"] = per_call_ms(replay, calls, device)
            if label == "bik":
                replay()
                row["graph_equals_eager"] = all(
                    torch.equal(a, b) for a, b in zip(outputs, eager, strict=True)
                )
        except Exception as error:  # report, go on: the probe asks whether capture works
            row[f"{label}_graph_error"] = f"{type(error).__name__}: {error}"[:300]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="calls per chain (default 24)")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument(
        "--profile",
        nargs="*",
        choices=("linear", "paged"),
        default=None,
        help="profile eager calls of these ops (none: linear)",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    rows = []
    for label, m, k, n in LINEARS:
        if device.type == "cpu" and k * n > 576 * 1536:
            continue
        x = torch.randn(m, k, device=device).to(dtype)
        weights = [torch.randn(n, k, device=device).to(dtype) for _ in range(args.layers)]
        name = f"linear M={m} K={k} N={n} ({label})"
        rows.append(
            probe(
                name,
                chain(bik.linear, x, weights),
                chain(F.linear, x, weights),
                args.layers,
                device,
            )
        )
        print(rows[-1], flush=True)
    for label, m, d in NORMS:
        x = torch.randn(m, d, device=device).to(dtype)
        weights = [torch.randn(d, device=device).to(dtype) for _ in range(args.layers)]

        def plain(x, w):
            return F.rms_norm(x, (x.shape[-1],), w, 1e-6)

        def invariant(x, w):
            return bik.rms_norm(x, w, 1e-6)

        rows.append(
            probe(
                f"rms_norm M={m} D={d} ({label})",
                chain(invariant, x, weights),
                chain(plain, x, weights),
                args.layers,
                device,
            )
        )
        print(rows[-1], flush=True)
    _print_table(rows)
    if args.profile is not None:
        for op in args.profile or ["linear"]:
            _profile(*PROFILED[op](device, dtype), device)
    if args.json:
        meta = {
            "device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"),
            "torch": torch.__version__,
            "dtype": str(dtype),
            "layers": args.layers,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


def _linear_call(device: torch.device, dtype: torch.dtype) -> tuple[str, Callable[[], object]]:
    _, m, k, n = LINEARS[0]
    x, w = torch.randn(m, k, device=device).to(dtype), torch.randn(n, k, device=device).to(dtype)
    return f"bik.linear M={m} K={k} N={n}", lambda: bik.linear(x, w)


def _paged_call(device: torch.device, dtype: torch.dtype) -> tuple[str, Callable[[], object]]:
    case = paged_decode(1, 32, 8, 8192 if device.type == "cuda" else 256, 128)
    args = case.inputs(device, dtype)
    return f"paged attention {case.shape}", lambda: case.bik(*args)


PROFILED = {"linear": _linear_call, "paged": _paged_call}


def _profile(label: str, call: Callable[[], object], device: torch.device, calls: int = 1000):
    call()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    print(f"\nhost time of {calls} eager calls of {label}:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)


def _print_table(rows: list[dict]) -> None:
    columns = "bik eager us | bik graph us | torch eager us | torch graph us | graph == eager"
    print(f"\n| case | {columns} |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        cells = [
            f"{row[key] * 1e3:.1f}" if key in row else row.get(key.replace("_ms", "_error"), "-")
            for key in ("bik_eager_ms", "bik_graph_ms", "torch_eager_ms", "torch_graph_ms")
        ]
        same = row.get("graph_equals_eager", "-")
        print(f"| {row['case']} | " + " | ".join(cells) + f" | {same} |")


if __name__ == "__main__":
    main()
