"""One GPU loan's measurements in one command: host cost per call, GEMM buckets, attention.

    python benchmarks/gpu_probe.py --budget 420 --out DIR [--parts host,gemm,attention,profile]
    python benchmarks/gpu_probe.py --rehearse --out DIR    (no GPU: see below)
    python benchmarks/gpu_probe.py --summarize DIR/probe.jsonl   (rewrites DIR/probe.md)

Parts run in the order given (by default the order of their value), each under its own share
of ``--budget`` seconds, and every measurement is appended to ``DIR/probe.jsonl`` as it is
taken, so a cut run keeps what it measured. ``DIR/probe.md`` summarises the records.

- ``host``: the hot ops at decode shapes (linear, rms_norm, token_logprobs, decode attention):
  per call, the host's issue time (``host_us``: calls issued without waiting, divided by their
  number), the eager time and the time replayed from a CUDA graph (``mode`` "eager" / "graph"),
  for bik with launch plans, bik through ``kernel[grid]`` (``BIK_LAUNCH_PLANS=0``) and torch;
  and whether all three bik paths give the same bits. bik's host time is also split in two:
  the op layer and launchers with the launches recorded, not run (``op_side_host_us``), and
  those launches alone, through the plans and Triton's launcher (``launch_host_us``).
- ``table``: ``bik.linear`` as shipped (its bucket table) against cuBLAS at 1-8192 rows,
  eager and replayed from a CUDA graph, and the last row's bits against that row alone.
- ``gemm``: candidate token buckets of the linear kernel (tile, warps, stages) against cuBLAS,
  each replayed from a CUDA graph (host cost out of the figure), with every row's bits compared
  with the single-row bucket's: a candidate that changes a row's bits cannot enter the table.
- ``attention``: decode over 1k-32k keys at batch 1 and 16, the split kernel and the combine
  kernel timed apart, against SDPA with its backend pinned (flash); causal prefill 2k and 8k.
- ``prefill``: causal prefill (2k, 8k; GQA 32/8, head 128) as shipped (keys and values by
  TMA, no mask on key blocks every row sees whole), with pointer loads, with every block
  masked, with the accumulator rescaled only after a block that moved some row's maximum,
  in each candidate tile (128 rows over two warpgroups) and with
  64-key blocks (timing only: another order than the contract's) against SDPA (flash),
  replayed from CUDA graphs; each variant's output against the shipped one's, bit for bit.
- ``e2e``: greedy decode of a patched model (SmolLM2-135M's shapes, a Qwen3-style 2048-wide
  one, a Qwen3.5-style hybrid; plans on and off, the bits compared) against the unpatched
  model.
- ``static``: greedy decode over ``bik.hf.StaticDecoder``, each step one replayed CUDA graph,
  against the decoder stepping eagerly, the patched and unpatched models' ``generate``, and
  the unpatched model under the same plain capture (transformers' StaticCache, each step one
  graph: ``graph_vs_plain_graph``, the issue's ratio), and with q/k/v and gate/up fused
  (``fuse_projections``: ``fused_vs_plain_graph``); the graph's tokens and logits compared
  with the eager decoder's and the fused one's.
- ``cutlass``: the CUTLASS sm90 GEMM (``make cutlass-sm90`` on a machine with nvcc; carry
  ``build/cutlass``) against cuBLAS, its rows against the same rows alone and against the
  Triton bucket issuing the same instruction.
- ``chunked``: the TP-invariant order (``chunked_linear``, 8 chunks; the triton backend's
  tensor-core chunked kernel) against ``bik.linear`` and cuBLAS, replayed from CUDA graphs,
  at decode and prefill rows; its bits at TP 1, 2, 4, 8 (each rank's ``rank_partial`` of its
  K slice, the partials combined in rank order) and a row alone against its row in the batch.
- ``moe``: the experts' grouped GEMM at Qwen3-30B-A3B's shapes (128 experts, 8 a token),
  kernel to kernel on rows sorted by expert, replayed from CUDA graphs: the triton grouped
  linear (the linear kernel's tile product), the 64 x 64 tile kernel it replaced and torch's
  ``_grouped_mm``; an expert's rows against ``bik.linear`` through its weight alone.
- ``profile``: where an eager bik.linear's host time goes (cProfile, by own time).

``--rehearse`` (no GPU): compiles every GEMM candidate for sm_90a (wgmma shape, registers,
shared memory, spills), checks each candidate's rows against the single-row bucket under the
Triton interpreter on small shapes, and runs the other parts' code on the CPU with tiny shapes
and no graphs, so the GPU run meets no bug of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--rehearse" in sys.argv and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported: before any import
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch
import torch.nn.functional as F

import bik
from bik.backends.triton import _common
from bik.contract import KEY_BLOCK, TP_CHUNKS
from bik.distributed import chunked_linear, combine_partials, rank_partial
from bik.testing import cases, cutlass_sm90, graphs
from bik.testing.attention_candidates import PREFILL_CANDIDATES, rescale_when_max_moved
from bik.testing.plain_static import PlainStaticDecode

# the modules (the package exports functions of the same names)
triton_matmul = importlib.import_module("bik.backends.triton.matmul")
triton_grouped = importlib.import_module("bik.backends.triton.grouped")
triton_attention = importlib.import_module("bik.backends.triton.attention_launch")

TokenBucket = triton_matmul.TokenBucket

# Candidate buckets by row range: the table's own first, then variants (tile width 128 halves
# the L2 -> shared-memory bytes per FLOP; deeper pipelines for bandwidth-bound decode).
GEMM_CANDIDATES = {
    "decode": [
        TokenBucket(16, 16, 4, 4),
        TokenBucket(16, 16, 4, 6),
        TokenBucket(16, 16, 4, 8),
        TokenBucket(64, 64, 4, 4),
        TokenBucket(64, 64, 4, 6),
    ],
    "mid": [
        TokenBucket(128, 128, 8, 4),
        TokenBucket(128, 128, 4, 4),
        TokenBucket(128, 128, 8, 4, 128),
        TokenBucket(None, 256, 8, 3),
        TokenBucket(None, 128, 8, 4, 128),
    ],
    "large": [
        TokenBucket(None, 256, 8, 3),
        TokenBucket(None, 256, 8, 3, 128),
        TokenBucket(None, 128, 8, 4, 128),
        TokenBucket(None, 128, 4, 4, 128),
        TokenBucket(None, 256, 8, 4),
    ],
}
GEMM_ROWS = {"decode": (1, 16, 64), "mid": (128, 512), "large": (2048, 8192)}
GEMM_WEIGHTS = [("Llama-8B q/o", 4096, 4096), ("Llama-8B gate/up", 4096, 14336)]
GEMM_WEIGHTS_LARGE = [("Llama-8B down", 14336, 4096)]
DECODE_KEYS = (1024, 8192, 32768)
PART_SHARES = {
    "host": 0.2,
    "table": 0.15,
    "gemm": 0.2,
    "attention": 0.15,
    "prefill": 0.1,
    "e2e": 0.15,
    "static": 0.1,
    "cutlass": 0.05,
    "chunked": 0.05,
    "moe": 0.05,
    "profile": 0.05,
}


class Recorder:
    """Appends each record to probe.jsonl as it comes, keeps them for the summary."""

    def __init__(self, out: Path, meta: dict) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path, self.records = out / "probe.jsonl", []
        self.path.write_text(json.dumps({"meta": meta}) + "\n")

    def __call__(self, **record) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        print(json.dumps(record, default=str), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def eager_us(fn: Callable[[], object], device: torch.device, calls: int = 50) -> float:
    """Median of 5 timings of ``calls`` calls, per call, waiting for the GPU."""
    return graphs.per_call_us(fn, device, calls, wait=True)


def graph_us(fn: Callable[[], object], calls: int = 20) -> tuple[float, object]:
    """(per-call us of ``calls`` calls captured in one CUDA graph and replayed, the first
    captured call's output after a replay): CUDA events, median of 5 replays."""
    outputs: list[object] = []
    replay = graphs.graphed(lambda: outputs.append(fn()), calls)
    replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times), outputs[2]  # after the two warm-up calls


@contextlib.contextmanager
def launch_plans(on: bool):
    saved = _common.LAUNCH_PLANS
    _common.LAUNCH_PLANS = on
    try:
        yield
    finally:
        _common.LAUNCH_PLANS = saved


@contextlib.contextmanager
def launches_recorded():
    """Kernel launches recorded instead of run: what is left of a call's host time is the op
    layer's and the launchers' (checks, allocations, launch descriptions)."""
    recorded: list[_common.Launch] = []
    saved = _common.Launch.__call__
    _common.Launch.__call__ = lambda launch: recorded.append(launch)  # type: ignore[method-assign]
    try:
        yield recorded
    finally:
        _common.Launch.__call__ = saved  # type: ignore[method-assign]


def host_split(bik_fn, device) -> dict[str, float]:
    """A call's host time in two parts: the op layer and launchers with the launches
    recorded, not run (``op_side_host_us``), and the recorded launches alone, through the
    plans and Triton's launcher to the driver (``launch_host_us``)."""
    with launches_recorded() as recorded:
        op_side = graphs.host_us(bik_fn, device)
        recorded.clear()
        bik_fn()
    launches = list(recorded)
    return dict(
        op_side_host_us=op_side,
        launch_host_us=graphs.host_us(lambda: [launch() for launch in launches], device),
    )


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    return False


def host_cases(tiny: bool) -> list[cases.Case]:
    if tiny:
        return [cases.linear(1, 64, 64), cases.rms_norm(1, 64), cases.token_logprobs(2, 128)]
    return [
        cases.linear(1, 4096, 4096, "Llama-8B q/o"),
        cases.linear(16, 4096, 14336, "Llama-8B gate/up"),
        cases.linear(1, 576, 576, "SmolLM2 q/o"),
        cases.rms_norm(1, 4096),
        cases.rms_norm(16, 4096),
        cases.token_logprobs(1, 151936),
        cases.token_logprobs(16, 151936),
        cases.attention(1, 32, 8, 1, 4096, 128, "Llama-8B"),
        cases.attention(16, 32, 8, 1, 4096, 128, "Llama-8B"),
    ]


def part_host(record: Recorder, device, dtype, deadline: float, tiny: bool) -> None:
    for case in host_cases(tiny):
        if time.monotonic() > deadline:
            return record(part="host", cut=case.op + " " + case.shape)
        args = case.inputs(device, dtype)
        bik_fn, torch_fn = case.make(device, dtype, args=args)
        row: dict[str, Any] = dict(part="host", op=case.op, shape=case.shape)
        with launch_plans(False):
            reference = bik_fn()
            row["jit_host_us"] = graphs.host_us(bik_fn, device)
            row["jit_eager_us"] = eager_us(bik_fn, device)
        with launch_plans(True):
            bik_fn()  # the first call builds the plan
            row["plans_equal_jit"] = same(bik_fn(), reference)
            row["host_us"] = graphs.host_us(bik_fn, device)
            row.update(host_split(bik_fn, device))
            row["eager_us"] = eager_us(bik_fn, device)
        row["torch_host_us"] = graphs.host_us(torch_fn, device)
        row["torch_eager_us"] = eager_us(torch_fn, device)
        if device.type == "cuda":
            row["graph_us"], replayed = graph_us(bik_fn)
            row["graph_equals_eager"] = same(replayed, reference)
            row["torch_graph_us"], _ = graph_us(torch_fn)
        record(**row)


def gemm_shapes(tiny: bool) -> list[tuple[str, str, int, int, int]]:
    """(range, label, rows, K, N)."""
    if tiny:
        return [
            ("decode", "tiny", 3, 128, 128),
            ("mid", "tiny", 20, 128, 128),
            ("large", "tiny", 40, 128, 192),
        ]
    shapes = [
        (span, label, m, k, n)
        for span, rows in GEMM_ROWS.items()
        for label, k, n in GEMM_WEIGHTS
        for m in rows
    ]
    shapes += [
        ("large", label, m, k, n) for label, k, n in GEMM_WEIGHTS_LARGE for m in (2048, 8192)
    ]
    return shapes


def run_bucket(x, weight, bucket: TokenBucket) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    triton_matmul.linear_launch(x, weight, None, out, bucket)()
    return out


def part_gemm(record: Recorder, device, dtype, deadline: float, tiny: bool) -> None:
    for span, label, m, k, n in gemm_shapes(tiny):
        x = torch.randn(m, k, device=device).to(dtype)
        weight = torch.randn(n, k, device=device).to(dtype)
        shape = f"M={m} K={k} N={n} ({label})"
        if not gemm_candidates(record, shape, x, weight, GEMM_CANDIDATES[span], deadline):
            return record(part="gemm", cut=shape)


def gemm_candidates(record, shape, x, weight, candidates, deadline: float) -> bool:
    """Each candidate bucket on ``x @ weight.T`` (and cuBLAS); False if the deadline came."""
    single = run_bucket(x, weight, triton_matmul.TOKEN_BUCKETS[0])
    flops = 2 * x.shape[0] * x.shape[1] * weight.shape[0]
    cuda = x.device.type == "cuda"
    if cuda:
        cublas_us, _ = graph_us(lambda: F.linear(x, weight), calls=10)
        record(
            part="gemm", shape=shape, kernel="cublas", us=cublas_us, tflops=flops / cublas_us / 1e6
        )
    for bucket in candidates:
        if time.monotonic() > deadline:
            return False
        row: dict[str, Any] = dict(part="gemm", shape=shape, kernel="bik", bucket=bucket._asdict())
        try:
            row["rows_equal_single_row_bucket"] = same(run_bucket(x, weight, bucket), single)
            if cuda:
                row["us"], _ = graph_us(lambda b=bucket: run_bucket(x, weight, b), calls=10)
                row["tflops"] = flops / row["us"] / 1e6
                row["vs_cublas"] = cublas_us / row["us"]
        except Exception as error:  # a candidate that does not fit: say so, go on
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        record(**row)
    return True


SAME_INSTRUCTION = TokenBucket(None, 256, 8, 3, 128)
"""The Triton bucket issuing the CUTLASS kernel's instruction (HGMMA 64x256x16, bf16)."""


def part_cutlass(record: Recorder, device, dtype, deadline: float, tiny: bool) -> None:
    """The CUTLASS sm90 GEMM (bik.testing.cutlass_sm90; its library carried from a machine
    with nvcc) against cuBLAS, each replayed from a CUDA graph; its rows against the same rows
    alone (its own invariance) and against the Triton bucket of the same instruction (equal:
    an accelerator of that backend; else a backend of its own). Under --rehearse: the library
    loads and answers on the host."""
    try:
        record(part="cutlass", config=cutlass_sm90.config())
    except OSError as error:  # FileNotFoundError: not built or not carried
        return record(part="cutlass", error=str(error))
    if device.type != "cuda" or dtype != torch.bfloat16:
        return record(part="cutlass", can_implement=cutlass_sm90.can_implement(8192, 4096, 4096))
    for _, label, m, k, n in gemm_shapes(tiny):
        if time.monotonic() > deadline:
            return record(part="cutlass", cut=f"M={m} K={k} N={n}")
        x = torch.randn(m, k, device=device).to(dtype)
        weight = torch.randn(n, k, device=device).to(dtype)
        record(part="cutlass", shape=f"M={m} K={k} N={n} ({label})", **cutlass_row(x, weight))


def cutlass_row(x: torch.Tensor, weight: torch.Tensor) -> dict[str, Any]:
    out = cutlass_sm90.linear(x, weight)
    row: dict[str, Any] = {
        "rows_equal_alone": same(out[-1:], cutlass_sm90.linear(x[-1:].contiguous(), weight)),
        "equal_triton_same_instruction": same(out, run_bucket(x, weight, SAME_INSTRUCTION)),
    }
    row["us"], _ = graph_us(lambda: cutlass_sm90.linear(x, weight), calls=10)
    row["cublas_us"], _ = graph_us(lambda: F.linear(x, weight), calls=10)
    row["vs_cublas"] = row["cublas_us"] / row["us"]
    row["tflops"] = 2 * x.shape[0] * x.shape[1] * weight.shape[0] / row["us"] / 1e6
    return row


CHUNKED_ROWS = (1, 16, 64, 2048, 8192)
CHUNKED_WEIGHTS = [("Llama-8B o_proj", 4096, 4096), ("Llama-8B down", 14336, 4096)]


def part_chunked(record: Recorder, device, dtype, deadline: float, tiny: bool) -> None:
    """The TP-invariant chunked linear on the triton backend against bik.linear and cuBLAS."""
    weights = [("tiny", 8 * 32, 64)] if tiny else CHUNKED_WEIGHTS
    with bik.use_backend("triton"):
        for label, k, n in weights:
            for m in (1, 40, 100) if tiny else CHUNKED_ROWS:
                if time.monotonic() > deadline:
                    return record(part="chunked", cut=f"M={m} K={k} N={n}")
                x = torch.randn(m, k, device=device).to(dtype)
                weight = torch.randn(n, k, device=device).to(dtype)
                row = chunked_row(x, weight)
                record(part="chunked", shape=f"M={m} K={k} N={n} ({label})", **row)


def chunked_row(x: torch.Tensor, weight: torch.Tensor) -> dict[str, Any]:
    chunks = TP_CHUNKS
    out = chunked_linear(x, weight, chunks=chunks)
    step = x.shape[1] // chunks
    degrees = {}
    for degree in (2, 4, 8):
        width = step * chunks // degree
        partials = [
            rank_partial(x[:, r * width : (r + 1) * width], weight[:, r * width : (r + 1) * width],
                         chunks // degree)
            for r in range(degree)
        ]  # fmt: skip
        degrees[degree] = same(combine_partials(partials, None, x.dtype), out)
    row: dict[str, Any] = {
        "tp_2_4_8_equal": all(degrees.values()),
        "rows_equal_alone": same(out[-1:], chunked_linear(x[-1:], weight, chunks=chunks)),
    }
    if x.device.type == "cuda":
        row["chunked_us"], _ = graph_us(lambda: chunked_linear(x, weight, chunks=chunks), 10)
        row["linear_us"], _ = graph_us(lambda: bik.linear(x, weight), calls=10)
        row["cublas_us"], _ = graph_us(lambda: F.linear(x, weight), calls=10)
        row["chunked_over_linear"] = row["chunked_us"] / row["linear_us"]
        row["tflops"] = 2 * x.shape[0] * x.shape[1] * weight.shape[0] / row["chunked_us"] / 1e6
    return row


# Qwen3-30B-A3B's experts: 128 of them, 8 a token, gate/up [1536, 2048] and down [2048, 768].
MOE_EXPERTS, MOE_TOP_K = 128, 8
MOE_WEIGHTS = [("Qwen3-30B-A3B gate/up", 2048, 1536), ("Qwen3-30B-A3B down", 768, 2048)]
MOE_TOKENS = (1, 16, 256, 4096)


def part_moe(record: Recorder, device, dtype, deadline: float, tiny: bool) -> None:
    """The experts' grouped GEMM: the triton grouped linear (the linear kernel's tile product)
    and the 64 x 64 tile kernel it replaced, against torch's ``_grouped_mm``, kernel to kernel
    on rows already sorted by expert, each replayed from a CUDA graph."""
    experts, top_k = (4, 2) if tiny else (MOE_EXPERTS, MOE_TOP_K)
    with bik.use_backend("triton"):
        moe_rows(record, experts, top_k, device, dtype, deadline, tiny)


def moe_rows(record: Recorder, experts: int, top_k: int, device, dtype, deadline, tiny) -> None:
    for label, k, n in [("tiny", 64, 48)] if tiny else MOE_WEIGHTS:
        weight = torch.randn(experts, n, k, device=device).to(dtype)
        for tokens in (1, 40) if tiny else MOE_TOKENS:
            if time.monotonic() > deadline:
                return record(part="moe", cut=f"T={tokens} K={k} N={n}")
            chosen = torch.randint(0, experts, (tokens * top_k,), device=device)
            x = torch.randn(tokens * top_k, k, device=device).to(dtype)
            row = moe_row(x, weight, chosen)
            record(part="moe", shape=f"T={tokens} top{top_k} of {experts} K={k} N={n} ({label})",
                   **row)  # fmt: skip


def moe_row(x: torch.Tensor, weight: torch.Tensor, chosen: torch.Tensor) -> dict[str, Any]:
    order = torch.sort(chosen, stable=True).indices
    counts = torch.bincount(chosen, minlength=weight.shape[0])
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    packed, b = x[order], weight.transpose(1, 2)
    out = triton_grouped.grouped_matmul(packed, b, offsets)

    def tile():
        result = torch.empty_like(out)
        triton_grouped.grouped_matmul_launch(packed, b, offsets, result)()
        return result

    mine = chosen[order] == chosen[order][-1]
    row: dict[str, Any] = {
        "bucket": bucket_of(-(-x.shape[0] // weight.shape[0]), weight[0])._asdict(),
        "expert_equal_linear": same(out[mine], bik.linear(packed[mine], weight[chosen[order][-1]])),
    }
    ends = offsets[1:].to(torch.int32)
    try:  # the non-invariant baseline, checked to compute the same product
        baseline = torch._grouped_mm(packed, b, offs=ends)
        row["max_diff_grouped_mm"] = (out.float() - baseline.float()).abs().max().item()
    except (RuntimeError, AttributeError) as error:  # not on this GPU / torch
        row["grouped_mm"] = f"{type(error).__name__}: {error}"[:200]
    if x.device.type != "cuda":
        return row
    row["us"], _ = graph_us(lambda: triton_grouped.grouped_matmul(packed, b, offsets), calls=10)
    row["tile_us"], _ = graph_us(tile, calls=10)
    row["vs_tile"] = row["tile_us"] / row["us"]
    if "max_diff_grouped_mm" in row:
        row["grouped_mm_us"], _ = graph_us(lambda: torch._grouped_mm(packed, b, offs=ends), 10)
        row["vs_grouped_mm"] = row["grouped_mm_us"] / row["us"]
    row["tflops"] = 2 * x.shape[0] * x.shape[1] * weight.shape[1] / row["us"] / 1e6
    return row


TABLE_ROWS = (1, 16, 64, 128, 512, 2048, 8192)


def part_table(record: Recorder, device, dtype, deadline: float, tiny: bool) -> None:
    """bik.linear as shipped (its bucket table) against cuBLAS, eager and from a CUDA graph."""
    weights = [("tiny", 64, 320)] if tiny else GEMM_WEIGHTS + GEMM_WEIGHTS_LARGE
    for label, k, n in weights:
        for m in (1, 40, 100) if tiny else TABLE_ROWS:
            if time.monotonic() > deadline:
                return record(part="table", cut=f"M={m} K={k} N={n}")
            case = cases.linear(m, k, n, label)
            args = case.inputs(device, dtype)
            bik_fn, cublas_fn = case.make(device, dtype, args=args)
            x, weight = args
            row: dict[str, Any] = dict(
                part="table", shape=case.shape, bucket=bucket_of(m, weight)._asdict()
            )
            row["eager_us"] = eager_us(bik_fn, device, calls=20)
            row["cublas_eager_us"] = eager_us(cublas_fn, device, calls=20)
            row["rows_equal_alone"] = same(bik_fn()[-1:], bik.linear(x[-1:], weight))
            if device.type == "cuda":
                row["graph_us"], _ = graph_us(bik_fn, calls=10)
                row["cublas_graph_us"], _ = graph_us(cublas_fn, calls=10)
                row["vs_cublas_graph"] = row["cublas_graph_us"] / row["graph_us"]
                row["tflops"] = case.flops / row["graph_us"] / 1e6
            record(**row)


def bucket_of(rows: int, weight: torch.Tensor) -> TokenBucket:
    return triton_matmul.token_bucket(
        rows, weight.shape[0], triton_matmul.multiprocessors(weight.device)
    )


def attention_launch_us(q, k, v, device) -> dict:
    """The split-parallel decode's two kernels replayed apart: split, combine."""
    from bik.ops.attention import validate_options

    options = validate_options(q, False, None, None, None, None, None)
    out = torch.empty_like(q)
    kv_start = torch.zeros(q.shape[0], dtype=torch.int32, device=device)
    launches = triton_attention.attention_launches(
        q, k, v, kv_start, out, options, split_parallel=True
    )
    times = {}
    for name, launch in zip(("split_us", "combine_us"), launches):
        launch()
        times[name] = graph_us(launch)[0] if device.type == "cuda" else 0.0
    return times


def attention_cases(tiny: bool) -> list[cases.Case]:
    if tiny:
        return [cases.attention(1, 4, 2, 1, 64, 16), cases.attention(1, 4, 2, 16, 16, 16)]
    decode = [
        cases.attention(b, 32, 8, 1, t, 128, "Llama-8B") for b in (1, 16) for t in DECODE_KEYS
    ]
    return decode + [cases.attention(1, 32, 8, t, t, 128, "Llama-8B") for t in (2048, 8192)]


def part_attention(record: Recorder, device, dtype, deadline: float, tiny: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if device.type == "cuda" else SDPBackend.MATH
    for case in attention_cases(tiny):
        if time.monotonic() > deadline:
            return record(part="attention", cut=case.op + " " + case.shape)
        args = case.inputs(device, dtype)
        bik_fn, sdpa_fn = case.make(device, dtype, args=args)
        row: dict[str, Any] = dict(
            part="attention", op=case.op, shape=case.shape, sdpa_backend=backend.name
        )
        with sdpa_kernel([backend]):
            row["eager_us"] = eager_us(bik_fn, device, calls=20)
            row["sdpa_eager_us"] = eager_us(sdpa_fn, device, calls=20)
            if device.type == "cuda":
                row["graph_us"], _ = graph_us(bik_fn)
                row["sdpa_graph_us"], _ = graph_us(sdpa_fn)
                row["vs_sdpa_graph"] = row["sdpa_graph_us"] / row["graph_us"]
        if case.op == "attention_decode":
            row.update(attention_launch_us(*args, device))
        record(**row)


def part_prefill(record: Recorder, device, dtype, deadline: float, tiny: bool) -> None:
    """Causal prefill as shipped (TMA keys and values, the shipped tile, no mask on the key
    blocks every row sees whole), with pointer loads, with every block masked, with the
    conditional rescale, in each candidate tile (``PREFILL_CANDIDATES``) and with 64-key
    blocks (timing only: not the contract's order) against SDPA (flash), replayed from CUDA
    graphs; each variant's output against the shipped one's, bit for bit (a variant that
    moves a bit cannot ship)."""
    heads, kv_heads, dim = (4, 2, 16) if tiny else (32, 8, 128)
    for length in (100,) if tiny else (2048, 8192):
        q = torch.randn(1, heads, length, dim, device=device).to(dtype)
        k, v = (torch.randn(1, kv_heads, length, dim, device=device).to(dtype) for _ in "kv")
        if not prefill_rows(record, q, k, v, deadline):
            return


def prefill_variants(dtype) -> list[tuple[str, dict[str, Any], int]]:
    """(label, attention() choices, key block) of each variant :func:`part_prefill` times."""
    shipped = triton_attention.shipped_tile(dtype)
    variants = [("shipped", {}, KEY_BLOCK), ("pointer loads", {"tma_kv": False}, KEY_BLOCK)]
    variants += [("every block masked", {"mask_every_block": True}, KEY_BLOCK)]
    variants += [("conditional rescale", {"rescale_acc": rescale_when_max_moved}, KEY_BLOCK)]
    variants += [(f"tile {tuple(t)}", {"tile": t}, KEY_BLOCK) for t in PREFILL_CANDIDATES]
    variants += [(f"{2 * KEY_BLOCK}-key blocks, tile {tuple(t)}", {"tile": t}, 2 * KEY_BLOCK)
                 for t in (shipped, *PREFILL_CANDIDATES)]  # fmt: skip
    return variants


@contextlib.contextmanager
def key_block(keys: int):
    """Attention launches with ``keys`` keys a block (for timing: another order than the
    contract's unless ``keys`` is KEY_BLOCK)."""
    saved = triton_attention.BLOCK_N
    triton_attention.BLOCK_N = keys
    try:
        yield
    finally:
        triton_attention.BLOCK_N = saved


def prefill_rows(record: Recorder, q, k, v, deadline: float) -> bool:
    """One shape's rows of :func:`part_prefill`; False if the deadline came."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from bik.ops.attention import validate_options

    (_, heads, length, dim), kv_heads = q.shape, k.shape[1]
    shape = f"B=1 H={heads}/{kv_heads} T={length} D={dim} causal"
    kv_start = torch.zeros(1, dtype=torch.int32, device=q.device)
    options = validate_options(q, True, None, None, None, None, None)
    run = functools.partial(triton_attention.attention, q, k, v, kv_start, options)
    shipped = run()
    sdpa_us = None
    if q.device.type == "cuda":
        sdpa = functools.partial(
            F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True
        )
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            sdpa_us, _ = graph_us(sdpa, calls=5)
    for label, choices, keys in prefill_variants(q.dtype):
        if time.monotonic() > deadline:
            record(part="prefill", cut=f"{shape} {label}")
            return False
        row: dict[str, Any] = dict(part="prefill", shape=shape, variant=label)
        with key_block(keys):
            row["equal_shipped"] = same(run(**choices), shipped)
            if sdpa_us is not None:
                row["us"], _ = graph_us(functools.partial(run, **choices), calls=5)
        if sdpa_us is not None:
            row["sdpa_flash_us"] = sdpa_us
            row["vs_sdpa"] = sdpa_us / row["us"]
            row["tflops"] = 4 * heads * length * length / 2 * dim / row["us"] / 1e6
        record(**row)
    return True


def e2e_cases(tiny: bool) -> list[cases.Case]:
    if tiny:
        return [cases.end_to_end("decode", 2, 8, 64, 2, new_tokens=2)]
    return [
        cases.smollm2_decode(16, 512, 8),
        cases.end_to_end("decode", 16, 512, 2048, 8, 8),
        cases.hybrid_decode(16, 512, 2048, 8, 8),
    ]


def part_e2e(record: Recorder, device, dtype, deadline: float, tiny: bool) -> None:
    """Greedy decode of a patched model (plans on, plans off) against the unpatched one."""
    for case in e2e_cases(tiny):
        if time.monotonic() > deadline:
            return record(part="e2e", cut=case.op + " " + case.shape)
        bik_fn, plain_fn = case.make(device, dtype)
        row: dict[str, Any] = dict(part="e2e", op=case.op, shape=case.shape)
        with launch_plans(False):
            reference = bik_fn()
            row["jit_ms"] = eager_us(bik_fn, device, calls=2) / 1e3
        with launch_plans(True):
            row["plans_equal_jit"] = same(bik_fn(), reference)
            row["ms"] = eager_us(bik_fn, device, calls=2) / 1e3
        row["plain_ms"] = eager_us(plain_fn, device, calls=2) / 1e3
        row["vs_plain"] = row["plain_ms"] / row["ms"]
        record(**row)


def static_cases(tiny: bool) -> list[tuple[str, Any, int, int, int]]:
    """(label, config, batch, prompt length, new tokens) of the static-cache decode."""
    if tiny:
        return [("tiny Qwen3-style", cases.qwen3_config(64, 2, 256, 16), 2, 8, 4)]
    smollm2, qwen3 = cases.smollm2_config(576), cases.qwen3_config(2048, 8, 32000, 576)
    return [
        ("SmolLM2-135M shapes", smollm2, 1, 512, 64),
        ("SmolLM2-135M shapes", smollm2, 16, 512, 64),
        ("Qwen3-style 2048 wide, 8 layers", qwen3, 16, 512, 64),
    ]


def part_static(record: Recorder, device, dtype, deadline: float, tiny: bool) -> None:
    """Greedy decode over bik.hf.StaticDecoder, each step one replayed CUDA graph (eager under
    --rehearse), against the same decoder stepping eagerly and the patched and unpatched
    models' generate (each with its prefill); the graph's tokens and logits against the eager
    decoder's."""
    for label, config, batch, length, new in static_cases(tiny):
        if time.monotonic() > deadline:
            return record(part="static", cut=label)
        row = static_row(config, batch, length, new, device, dtype)
        record(part="static", op="static_decode", shape=f"{label} B={batch} T={length}", **row)


def static_row(config, batch: int, length: int, new: int, device, dtype) -> dict[str, Any]:
    """One model's static-cache decode (``new`` tokens after ``length``) timed six ways."""
    plain, patched = cases.plain_and_patched(config, device, dtype)
    ids = torch.randint(1, config.vocab_size, (batch, length), device=device)
    mask = torch.ones_like(ids)
    graphed = bik.hf.StaticDecoder(patched, length + new)  # a graph on CUDA
    eager = bik.hf.StaticDecoder(patched, length + new, graph=False)
    fused = bik.hf.StaticDecoder(patched, length + new, fuse_projections=True)
    outputs = zip(graphed.generate(ids, mask, new), eager.generate(ids, mask, new))
    row: dict[str, Any] = {"new": new, "graph_equal_eager": all(same(a, b) for a, b in outputs)}
    outputs = zip(graphed.generate(ids, mask, new), fused.generate(ids, mask, new))
    row["fused_equal_graph"] = all(same(a, b) for a, b in outputs)
    plain_graphed = PlainStaticDecode(plain, length + new)  # a graph on CUDA, as bik's
    plain_tokens = cases.generate_or_forward(plain, ids, "decode", new, 0)[:, length:]
    row["plain_graph_tokens_equal_generate"] = same(
        plain_graphed.generate(ids, mask, new)[0], plain_tokens
    )
    timed = {
        "graph_ms": lambda: graphed.generate(ids, mask, new),
        "fused_graph_ms": lambda: fused.generate(ids, mask, new),
        "eager_ms": lambda: eager.generate(ids, mask, new),
        "generate_ms": lambda: cases.generate_or_forward(patched, ids, "decode", new, 0),
        "plain_graph_ms": lambda: plain_graphed.generate(ids, mask, new),
        "plain_generate_ms": lambda: cases.generate_or_forward(plain, ids, "decode", new, 0),
    }
    for name, fn in timed.items():
        row[name] = eager_us(fn, device, calls=2) / 1e3
    row["graph_vs_plain_graph"] = row["plain_graph_ms"] / row["graph_ms"]
    row["graph_vs_plain_generate"] = row["plain_generate_ms"] / row["graph_ms"]
    row["fused_vs_plain_graph"] = row["plain_graph_ms"] / row["fused_graph_ms"]
    return row


def part_profile(record: Recorder, device, dtype, deadline: float, tiny: bool) -> None:
    case = host_cases(tiny)[0]
    bik_fn, _ = case.make(device, dtype)
    bik_fn()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        bik_fn()
    sync(device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    record(part="profile", case=case.shape, calls=300, text=text.getvalue()[-6000:])


PARTS = {
    "host": part_host,
    "table": part_table,
    "gemm": part_gemm,
    "attention": part_attention,
    "prefill": part_prefill,
    "e2e": part_e2e,
    "static": part_static,
    "cutlass": part_cutlass,
    "chunked": part_chunked,
    "moe": part_moe,
    "profile": part_profile,
}


def rehearse_sm90(record: Recorder) -> None:
    """Every GEMM candidate compiled for sm_90a: its wgmma, registers, shared memory, spills."""
    from bik.testing import sm90

    seen = set()
    for candidates in GEMM_CANDIDATES.values():
        for bucket in candidates:
            if bucket in seen:
                continue
            seen.add(bucket)
            rows = bucket.max_rows or 4096
            launch = triton_matmul.linear_launch(
                sm90.meta(rows, 4096), sm90.meta(4096, 4096), None, sm90.meta(rows, 4096), bucket
            )
            binary = sm90.compile_launch(launch)
            record(
                part="sm90",
                bucket=bucket._asdict(),
                mma=sorted(binary.mma),
                registers=binary.registers,
                shared_bytes=binary.shared_bytes,
                local_bytes=binary.local_bytes,
                tma_loads=binary.count("UTMALDG"),
            )


def plans_held(records: list[dict]) -> bool:
    """Whether every host record ran and its plans gave kernel[grid]'s bits."""
    host = [r for r in records if r.get("part") == "host"]
    return all("error" not in r and r.get("plans_equal_jit", True) for r in host)


def summary(meta: dict, records: list[dict]) -> str:
    """Markdown: the run's machine and versions, then one table per part (its records' keys
    as columns), cuts and errors as lines, the profile as text."""
    lines = ["# GPU probe", "", ", ".join(f"{k}: {v}" for k, v in meta.items()), ""]
    for part in dict.fromkeys(r["part"] for r in records):
        rows = [r for r in records if r["part"] == part]
        lines += [f"## {part}", ""]
        table = [r for r in rows if not {"cut", "error", "note", "text"} & r.keys()]
        columns = list(dict.fromkeys(k for r in table for k in r if k != "part"))
        if table:
            lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in table]
        for r in rows:
            if "text" in r:
                lines += ["```", r["text"].rstrip(), "```"]
            for key in ("cut", "error", "note"):
                if key in r:
                    lines.append(f"- {key}: {r[key]}")
        lines.append("")
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):  # a bucket: its fields in order
        return "/".join(str(v) for v in value.values())
    return str(value)


def summarize(path: Path) -> None:
    """probe.md beside a probe.jsonl, from its records."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.with_suffix(".md").write_text(summary(lines[0]["meta"], lines[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all parts")
    parser.add_argument("--out", type=Path, help="folder for probe.jsonl, probe.md")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, in order")
    parser.add_argument("--rehearse", action="store_true", help="no GPU: see the docstring")
    parser.add_argument("--summarize", type=Path, help="only write the .md of this .jsonl")
    args = parser.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    if args.out is None:
        parser.error("--out: expected a folder for the results")
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; expected some of {list(PARTS)}")
    device = torch.device("cpu" if args.rehearse else "cuda")
    if not args.rehearse and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --rehearse on a machine without a GPU")
    dtype = torch.bfloat16
    meta = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (rehearsal)",
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        dtype=str(dtype),
        budget_s=args.budget,
    )
    record = Recorder(args.out, meta)
    torch.manual_seed(0)
    start = time.monotonic()
    if args.rehearse:
        rehearse_sm90(record)
    shares = sum(PART_SHARES[p] for p in parts)
    for part in parts:
        seconds = args.budget * PART_SHARES[part] / shares
        deadline = min(time.monotonic() + seconds, start + args.budget)
        try:
            PARTS[part](record, device, dtype, deadline, args.rehearse)
        except Exception as error:  # one part's failure must not cost the others' figures
            record(part=part, error=f"{type(error).__name__}: {error}"[:500])
        if part == "host" and not plans_held(record.records):
            _common.LAUNCH_PLANS = False  # the later parts measure kernel[grid]: say so
            record(part="host", note="plans differed or failed: later parts use kernel[grid]")
        summarize(record.path)
        print(f"gpu_probe: {part} done at {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
