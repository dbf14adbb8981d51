"""Decode-shaped bik.linear on the CPU: per-call packing vs weights packed once, vs F.linear.

For each dtype and shape, ``torch / bik`` (above 1: bik is faster) with the weight packed on
every call (plain bik.linear) and with it packed once (bik.pack_weights), each timed beside
F.linear in the same process. Weights are rotated through 96 MiB so that none stays in cache
(a decode step reads every weight once); the packing itself is done before the timing.

    python benchmarks/packed_weights_speed.py [--threads 1]
"""

import argparse
import time

import torch
import torch.nn.functional as F

import bik

SHAPES = ((1024, 1024), (512, 1536), (1536, 512), (512, 32000))  # K, N


def layers(k: int, n: int, dtype: torch.dtype, packed: bool) -> list[torch.nn.Linear]:
    """As many weights as fill 96 MiB (at least 2)."""
    count = max(2, (96 << 20) // (n * k * torch.finfo(dtype).bits // 8))
    made = [
        torch.nn.Linear(k, n, bias=False, dtype=dtype).requires_grad_(False) for _ in range(count)
    ]
    if packed:
        for layer in made:
            bik.pack_weights(layer)
    return made


def best_time(fn, x: torch.Tensor, weights: list[torch.nn.Linear]) -> float:
    """The fastest of 5 passes over every weight, twice each."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(2):
            for layer in weights:
                fn(x, layer.weight)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch and OpenMP threads")
    torch.set_num_threads(parser.parse_args().threads)
    torch.manual_seed(0)
    print("| dtype | M x K -> N | torch / bik (per-call packing) | torch / bik (packed once) |")
    print("|---|---|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 4, 16):
            for k, n in SHAPES:
                x = torch.randn(m, k).to(dtype)
                plain, packed = layers(k, n, dtype, False), layers(k, n, dtype, True)
                for layer in packed:
                    bik.linear(x, layer.weight)  # packs it, outside the timing
                per_call = best_time(F.linear, x, plain) / best_time(bik.linear, x, plain)
                once = best_time(F.linear, x, packed) / best_time(bik.linear, x, packed)
                name = str(dtype).removeprefix("torch.")
                print(f"| {name} | {m} x {k} -> {n} | {per_call:.2f} | {once:.2f} |", flush=True)


if __name__ == "__main__":
    main()
