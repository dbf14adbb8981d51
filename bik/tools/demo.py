"""The README's main job: one row's numbers, alone and inside batches, plain torch vs bik.

1. A row's log-probs through an LM head (linear + log-softmax), computed alone and with the
   same row placed at a random position inside batches of other rows (up to 3000).
2. Attention for the last token: full prefill vs one decode step over the KV cache.
On a CPU machine without a compiled CPU backend the Triton kernels run in the interpreter.
"""

import argparse
import os

import torch

from .cli import seed as seed_type


def _prefer_interpreter():
    """Run the Triton kernels in the interpreter when no GPU is present (must precede their
    import)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _row_in_batches(row_fn, inputs, batch_sizes, generator):
    """Max |difference| of row 0's result inside each batch vs computed alone.

    ``row_fn(*batch)`` maps a batch of rows of every tensor in ``inputs`` to one result per row.
    """
    alone = row_fn(*(t[:1] for t in inputs))[0]
    diffs = []
    for size in batch_sizes:
        where = int(torch.randint(size, (1,), generator=generator))
        order = torch.arange(size)
        order[[0, where]] = order[[where, 0]]  # put row 0 at a random position
        diffs.append((row_fn(*(t[order] for t in inputs))[where] - alone).abs().max().item())
    return diffs


def _logprob_table(device, generator):
    import bik

    # An odd hidden size and batches up to 3000 rows: torch's CPU and GPU matmuls pick their
    # kernel (and K blocking) by M, so a row's bits move between these sizes (K = 4097 and
    # M = 1 vs 3000 differ in fp32 on every machine we have tried).
    hidden, vocab, rows = 4097, 2048, 3000
    h = torch.randn(rows, hidden, generator=generator).to(device)
    w = (torch.randn(vocab, hidden, generator=generator) / hidden**0.5).to(device)

    def plain(x):
        return torch.log_softmax(torch.nn.functional.linear(x, w), dim=-1)

    def invariant(x):
        return bik.log_softmax(bik.linear(x, w))

    sizes = [1, 2, 7, 33, 512, rows]
    plain_d = _row_in_batches(plain, (h,), sizes, generator)
    bik_d = _row_in_batches(invariant, (h,), sizes, generator)
    print(
        f"\n1) row 0's log-probs over all {vocab} tokens, alone vs inside a batch "
        f"(fp32 LM head, hidden {hidden})"
    )
    print("| batch size | plain torch max abs diff | bik max abs diff |")
    print("|---:|---:|---:|")
    for size, p, b in zip(sizes, plain_d, bik_d):
        print(f"| {size} | {p:.3e} | {b:.3e} |")
    return max(bik_d), max(plain_d)


def _attention_table(device, generator):
    import bik

    heads, length, dim = 4, 200, 64
    q, k, v = (torch.randn(1, heads, length, dim, generator=generator).to(device) for _ in range(3))
    plain_full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    plain_decode = torch.nn.functional.scaled_dot_product_attention(q[:, :, -1:], k, v)
    bik_full = bik.attention(q, k, v)
    bik_decode = bik.attention(q[:, :, -1:], k, v)
    plain_d = (plain_full[:, :, -1:] - plain_decode).abs().max().item()
    bik_d = (bik_full[:, :, -1:] - bik_decode).abs().max().item()
    print(
        f"\n2) attention output of the last token: prefill vs decode over a {length}-token KV cache"
    )
    print("| path | max abs diff |\n|---|---:|")
    print(f"| plain torch (SDPA) | {plain_d:.3e} |\n| bik | {bik_d:.3e} |")
    return bik_d, plain_d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=seed_type, default=0)


def check(args: argparse.Namespace) -> None:
    """Nothing to check beyond argparse: the demo runs on whatever device there is."""


def main(args: argparse.Namespace) -> int:
    return run(seed=args.seed)


def run(seed: int = 0) -> int:
    _prefer_interpreter()
    from .. import backends

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = backends.resolve(device).name
    print(f"bik demo on {device} (backend: {backend})")
    generator = torch.Generator().manual_seed(seed)
    bik_worst, plain_worst = map(
        max, zip(_logprob_table(device, generator), _attention_table(device, generator))
    )
    print(
        f"\nbik: every difference is {bik_worst:.1e} (bit-identical: {bik_worst == 0}); "
        f"plain torch's largest is {plain_worst:.1e}."
    )
    if plain_worst == 0:
        print(
            "plain torch did not move for these shapes on this machine: its kernels happened "
            "to keep one order here. bik's bits do not depend on that luck."
        )
    return 0 if bik_worst == 0 else 1
