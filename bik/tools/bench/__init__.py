"""``python -m bik bench``: bik's kernels against the non-invariant baselines, same run.

For every case and dtype, bik and its baseline are timed alternately on the same inputs;
``ratio = baseline_ms / bik_ms`` is bik's speed relative to the baseline (1.0 = as fast,
0.5 = half the throughput). Achieved TFLOP/s and GB/s are reported, and ``peak_share`` is
the larger of the compute and bandwidth shares of the peaks measured on this device in the
same run and with the same timer (a big torch matmul, a big tensor copy).

On a CPU each sample set is timed by the wall clock, and shapes whose data stay in cache can
exceed 100% of the copy bandwidth. On a GPU each sample set is timed by CUDA events, and the
inputs are copied (:func:`rotation_copies`) so that the copies together are at least twice
the L2 cache; bik and the baseline walk the copies in turn through one cursor, so no timed call
finds its inputs left in L2 by an earlier one (model cases are not copied: their weights alone
exceed L2). A case that fails on a GPU is recorded with its error and the others still run (a
real-model case that ``BIK_OFFLINE=1`` leaves without its model is recorded as skipped); an
interrupt (Ctrl-C, ``timeout -s INT``) keeps the records made so far.

The bench knows when its machine is busy: each case is timed in rounds of :data:`SAMPLES`
alternated samples, repeated (up to :data:`ROUNDS`) until both sides' spread, (max - min) /
median, is at most :data:`SPREAD_LIMIT`; a case that never settles keeps its steadiest round
and is marked unreliable (``?`` after its ratio). The load average before and after the run
is recorded, and a run that starts on a loaded machine (1-minute load above half the CPUs)
says so above its table: its ratios are not figures to quote.

``--vllm`` times vLLM instead: generated tokens/s of vLLM with bik against native vLLM, same
model and prompts, each engine in its own process (:mod:`bik.tools.bench.vllm_throughput`).
"""

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ... import backends
from ...contract import DTYPE_NAMES, TP_CHUNKS
from ...testing import PRESETS, graphs, models
from ...testing import cases as case_lib
from ...testing.arguments import positive_float, positive_int
from ...testing.machine import device_name, loaded, machine_load
from ...testing.presets import ENGINE_FAMILIES
from ...vllm import engine as vllm_engine
from .. import verify
from ..cli import AllOf, UsageError, check_device, output_file, output_problem
from . import speculative, vllm_throughput

MIN_TIME = 0.2  # seconds per timed sample set
TIMERS = {"cpu": "wall clock", "cuda": "CUDA events"}
L2_FALLBACK = 50 * 2**20  # bytes: Hopper's L2 (H100), where torch does not report the size
ROTATION_FACTOR = 2  # the rotated copies together hold at least this many L2 caches
ROTATION_BUDGET = 4 * 2**30  # bytes: at most this much memory for the copies of one case
MAX_COPIES = 1 << 16
SAMPLES = 5  # alternated samples per round of time_pair
ROUNDS = 3  # rounds at most, until the spread is within SPREAD_LIMIT
SPREAD_LIMIT = 0.2  # (max - min) / median of a round's samples, each side
# What the markdown says of a backend whose times are not performance figures.
BACKEND_NOTES = {
    "cuda": (
        "bik backend `cuda` is the portable reference backend (csrc/cuda: one thread per "
        "matmul output, scalar loads, no tensor cores), written for order-correctness, not "
        "speed: its times are not performance figures. The performance path on a GPU is the "
        "Triton backend (the default)."
    ),
}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds_per_call(fn, device, calls):
    """Mean seconds per call of ``calls`` back-to-back calls: CUDA events on a GPU (from an
    idle GPU, so the first launch's latency counts), the wall clock elsewhere."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3 / calls
    _sync(device)
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - begin) / calls


def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 cache size in bytes (torch's device properties; else Hopper's 50 MiB)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or L2_FALLBACK)


def rotation_copies(
    set_bytes: int,
    l2: int,
    budget: int = ROTATION_BUDGET,
    max_copies: int = MAX_COPIES,
) -> int:
    """How many copies of a call's inputs (``set_bytes`` each) to rotate over so that all of
    them together hold at least ROTATION_FACTOR x ``l2`` bytes: a copy is then reused only
    after more than the whole L2 cache was read since its last use. At most ``max_copies`` and
    ``budget`` bytes (where these cap it, the inputs may stay in L2); at least 1."""
    if set_bytes <= 0:
        return 1
    wanted = -(-ROTATION_FACTOR * l2 // set_bytes)
    return max(1, min(wanted, max_copies, budget // set_bytes))


class Timing(NamedTuple):
    """Median ms per call of bik and of the baseline, and the larger of their spreads."""

    bik_ms: float
    base_ms: float
    spread: float


class Timed(NamedTuple):
    """One case timed eagerly: its timing, the input copies rotated over, the bytes of one
    copy, and the two timed functions (bik's, the baseline's)."""

    timing: Timing
    copies: int
    set_bytes: int
    fns: tuple[Callable[[], object], Callable[[], object]]


def _time_case(
    case: case_lib.Case, device: torch.device, dtype: torch.dtype, l2: int, min_time: float
) -> Timed:
    """One case on ``device``, timed eagerly."""
    args = case.inputs(device, dtype)
    set_bytes = case_lib.input_bytes(args) if case.rotate else 0
    copies = rotation_copies(set_bytes, l2) if l2 and case.rotate else 1
    fns = case.make(device, dtype, copies, args)
    del args
    return Timed(time_pair(*fns, device, min_time), copies, set_bytes, fns)


def _time_graphs(fns, device: torch.device, min_time: float) -> Timing:
    """Both functions replayed from CUDA graphs of ``graphs.GRAPH_CALLS`` calls each, timed
    as :func:`time_pair` times eager calls; ms per call."""
    bik_replay, base_replay = (graphs.graphed(fn) for fn in fns)
    timing = time_pair(bik_replay, base_replay, device, min_time)
    calls = graphs.GRAPH_CALLS
    return Timing(timing.bik_ms / calls, timing.base_ms / calls, timing.spread)


def _spread(samples: list[float]) -> float:
    return (max(samples) - min(samples)) / statistics.median(samples)


def time_pair(
    bik_fn: Callable[[], object],
    base_fn: Callable[[], object],
    device: torch.device,
    min_time: float,
) -> Timing:
    """Both functions timed alternately (same conditions for both), in rounds of
    :data:`SAMPLES` until a round's spread is within :data:`SPREAD_LIMIT` (at most
    :data:`ROUNDS`; else the steadiest round): its medians, in ms per call."""
    calls = 1
    bik_fn(), base_fn()  # warm-up (and compilation)
    while calls < 4096 and _seconds_per_call(bik_fn, device, calls) * calls < min_time / 5:
        calls *= 2
    best: Timing | None = None
    for _ in range(ROUNDS):
        bik_s, base_s = [], []
        for _ in range(SAMPLES):
            bik_s.append(_seconds_per_call(bik_fn, device, calls))
            base_s.append(_seconds_per_call(base_fn, device, calls))
        spread = max(_spread(bik_s), _spread(base_s))
        timing = Timing(statistics.median(bik_s) * 1e3, statistics.median(base_s) * 1e3, spread)
        if best is None or spread < best.spread:
            best = timing
        if spread <= SPREAD_LIMIT:
            break
    assert best is not None
    return best


def measure_peaks(device: torch.device, dtype: torch.dtype, quick: bool) -> tuple[float, float]:
    """(FLOP/s, bytes/s) this device reaches with torch: one square matmul, one big copy."""
    n = 1024 if quick or device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device).to(dtype)
    flops_ms = time_pair(lambda: a @ a, lambda: None, device, 0.2).bik_ms
    x = torch.ones(1 << (24 if quick or device.type == "cpu" else 28), device=device, dtype=dtype)
    y = torch.empty_like(x)  # preallocated: time the copy, not page faults
    copy_ms = time_pair(lambda: y.copy_(x), lambda: None, device, 0.2).bik_ms
    return 2 * n**3 / (flops_ms * 1e-3), 2 * x.numel() * x.element_size() / (copy_ms * 1e-3)


def run(
    device: str | torch.device = "cpu",
    ops: Sequence[str] | None = None,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    quick: bool = False,
    min_time: float = 0.2,
    json_path: str | None = None,
    plot_path: str | None = None,
    echo: Callable[..., object] = print,
) -> dict:
    """Time the selected cases; every argument is checked before the first case runs."""
    device = torch.device(device)
    problem = unknown_ops(device.type, ops, quick)
    if problem:
        raise ValueError(f"ops: {problem}")
    for name, path in (("json_path", json_path), ("plot_path", plot_path)):
        problem = None if path is None else output_problem(path)
        if problem:
            raise ValueError(f"{name}: {problem}")
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        raise ImportError(f"plot_path: {PLOT_NEEDS}")
    backend = backends.resolve(device).name
    selected = [c for c in case_lib.cases_for(device.type, quick) if not ops or c.op in ops]
    gpu = device.type == "cuda"
    l2 = l2_bytes(device) if gpu else 0
    records: list[dict[str, Any]] = []
    peaks: dict[str, dict[str, float]] = {}
    result = {
        "device": device_name(device),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "backend": backend,
        "timer": TIMERS[device.type],
        "load_before": machine_load(),
        **(_gpu_facts(device, l2) if gpu else {}),
        "peaks": peaks,
        "records": records,
    }
    say = (lambda line: echo(line, flush=True)) if echo is print else echo
    try:
        for dtype_name in dtypes:
            dtype = DTYPE_NAMES[dtype_name]
            peak_flops, peak_bw = measure_peaks(device, dtype, quick)
            peaks[dtype_name] = {"tflops": peak_flops / 1e12, "gbps": peak_bw / 1e9}
            for case in selected:
                for record in _case_records(case, device, dtype_name, l2, min_time, backend):
                    record.update(_rates(case, record, peak_flops, peak_bw))
                    records.append(record)
                    say(_row(record))
    except KeyboardInterrupt:  # the case being timed has no record yet
        result["interrupted"] = True
        say(f"interrupted: {len(records)} records kept")
    result["load_after"] = machine_load()
    save(result, json_path, plot_path)
    return result


def _case_records(case, device, dtype_name, l2, min_time, backend) -> list[dict[str, Any]]:
    """The records of one case: eager (with each side's host cost on a GPU), and on a GPU
    the same calls replayed from CUDA graphs (kernel cases; a model's generate cannot be
    captured). A failure on a GPU is recorded, on a CPU raised."""
    dtype = DTYPE_NAMES[dtype_name]
    base = {"op": case.op, "shape": case.shape, "dtype": dtype_name, "backend": backend}
    record: dict[str, Any] = {**base, "mode": "eager"}
    gpu = device.type == "cuda"
    pinned: contextlib.AbstractContextManager = contextlib.nullcontext()
    if gpu and case.op.startswith("attention"):  # the baseline's SDPA kernel, recorded
        from torch.nn.attention import sdpa_kernel

        backend_choice = graphs.sdpa_backend(dtype)
        pinned = sdpa_kernel([backend_choice])
        base["sdpa_backend"] = record["sdpa_backend"] = backend_choice.name
    try:
        with pinned:
            timed = _time_case(case, device, dtype, l2, min_time)
            records = [{**record, **_timing_fields(timed.timing)}]
            if gpu:
                record = records[0]
                record["host_us"], record["baseline_host_us"] = (
                    graphs.host_us(fn, device) for fn in timed.fns
                )
                record.update(
                    copies=timed.copies, rotated_mib=timed.copies * timed.set_bytes / 2**20
                )
                record["l2_cold"] = not case.rotate or timed.copies * timed.set_bytes > l2
                if case.rotate:
                    records.append(_graph_record(base, timed.fns, device, min_time))
    except models.ModelOfflineError as error:  # BIK_OFFLINE=1: not a failure
        return [{**record, "skipped": str(error)}]
    except Exception as error:
        if not gpu:  # the CPU bench stops at the first failure
            raise
        return [{**record, "error": _error_line(error)}]
    finally:
        if gpu:
            gc.collect()
            torch.cuda.empty_cache()
    return records


def _graph_record(base, fns, device, min_time) -> dict[str, Any]:
    """The graph-mode record of a case whose eager calls were timed; a capture that fails is
    recorded as this record's error (the eager record stands)."""
    try:
        return {**base, "mode": "graph", **_timing_fields(_time_graphs(fns, device, min_time))}
    except Exception as error:
        return {**base, "mode": "graph", "error": _error_line(error)}


def _error_line(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def _timing_fields(timing: Timing) -> dict[str, Any]:
    return dict(
        bik_ms=timing.bik_ms,
        baseline_ms=timing.base_ms,
        ratio=timing.base_ms / timing.bik_ms,
        spread=timing.spread,
        reliable=timing.spread <= SPREAD_LIMIT,
    )


def _rates(case, record, peak_flops, peak_bw) -> dict[str, Any]:
    """Throughput fields of a timed record: TFLOP/s, GB/s and the share of the peaks, or an
    end-to-end case's tokens/s; nothing for a failed or skipped one."""
    if "bik_ms" not in record:
        return {}
    bik_s, base_s = record["bik_ms"] * 1e-3, record["baseline_ms"] * 1e-3
    if case.tokens:  # end-to-end: patched vs unpatched model throughput
        return dict(
            bik_tokens_per_s=case.tokens / bik_s, baseline_tokens_per_s=case.tokens / base_s
        )
    flops, traffic = case.flops / bik_s, case.bytes / bik_s
    return dict(
        bik_tflops=flops / 1e12,
        bik_gbps=traffic / 1e9,
        peak_share=max(flops / peak_flops, traffic / peak_bw),
    )


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_facts(device, l2):
    """What a GPU result records beside the device name: versions, the GPU's properties, the
    rotation and whether fp32 matmuls may use TF32 (bik never does; torch's default is no)."""
    props = torch.cuda.get_device_properties(device)
    return {
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": props.total_memory / 2**30,
        "l2_bytes": l2,
        "rotation": f"inputs copied until the copies hold >= {ROTATION_FACTOR} x L2",
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
    }


def save(result: dict, json_path: str | None = None, plot_path: str | None = None) -> None:
    """Write ``result`` as JSON and/or its ratios as a PNG bar chart."""
    if json_path:
        with open(json_path, "w") as out:
            json.dump(result, out, indent=1)
    if plot_path:
        plot(result, plot_path)


def unknown_ops(device_type: str, ops: Sequence[str] | None, quick: bool) -> str | None:
    """What is wrong with ``ops`` for this device type and --quick, or None."""
    offered = list(dict.fromkeys(c.op for c in case_lib.cases_for(device_type, quick)))
    unknown = [op for op in ops or () if op not in offered]
    if not unknown:
        return None
    where = f"{device_type} with --quick" if quick else device_type
    return f"no case for {', '.join(unknown)} on {where}; expected some of {', '.join(offered)}"


PLOT_NEEDS = "needs matplotlib: pip install matplotlib"

HEADER = (
    "| op | shape | dtype | bik ms | baseline ms | ratio | bik TFLOP/s | bik GB/s | peak share |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---:|"
)


def _op_label(r):
    """The op, and "(graph)" for a record replayed from CUDA graphs."""
    return r["op"] + (" (graph)" if r.get("mode") == "graph" else "")


def _row(r):
    op = _op_label(r)
    if "error" in r:
        return f"| {op} | {r['shape']} | {r['dtype']} | failed: {r['error']} |"
    if "skipped" in r:
        return f"| {op} | {r['shape']} | {r['dtype']} | skipped: {r['skipped']} |"
    head = f"| {op} | {r['shape']} | {r['dtype']} | {r['bik_ms']:.4f} | {r['baseline_ms']:.4f} "
    ratio = f"{r['ratio']:.2f}" + ("" if r.get("reliable", True) else " ?")
    if "bik_tokens_per_s" in r:  # end-to-end rows report tokens/s instead of TFLOP/s and GB/s
        return (
            f"{head}| {ratio} | {r['bik_tokens_per_s']:.0f} tok/s | "
            f"{r['baseline_tokens_per_s']:.0f} tok/s ({r.get('baseline', 'unpatched')}) | - |"
        )
    return (
        f"{head}| {ratio} | {r['bik_tflops']:.3f} | {r['bik_gbps']:.1f} | {r['peak_share']:.0%} |"
    )


def markdown(result: dict) -> str:
    vllm = f"; vLLM {result['vllm']}" if result.get("vllm") else ""
    versions = "".join(
        f", {name} {result[key]}"
        for key, name in (("triton", "Triton"), ("cuda", "CUDA"))
        if result.get(key)
    )
    lines = [
        f"Device: {result['device']}; torch {result['torch']}{versions}{vllm}; bik backend "
        f"`{result['backend']}`; {result['date']}. ratio = baseline ms / bik ms.",
    ]
    if result["backend"] in BACKEND_NOTES:
        lines += ["", f"**{BACKEND_NOTES[result['backend']]}**"]
    if result.get("timer"):
        how = f"Timed with {result['timer']}"
        if result.get("l2_bytes"):
            cold = sum(1 for r in result["records"] if r.get("l2_cold") is False)
            how += (
                f"; inputs rotated over copies holding >= {ROTATION_FACTOR} x the "
                f"{result['l2_bytes'] / 2**20:.0f} MiB L2 cache, shared by bik and the baseline"
                + (f" ({cold} rows stayed within L2: see `l2_cold` in the JSON)" if cold else "")
            )
        if result.get("tf32"):
            how += "; torch.backends.cuda.matmul.allow_tf32 was on for the baseline"
        lines += ["", how + "."]
    if result.get("peaks"):
        measured = "; ".join(
            f"{dtype} {p['tflops']:.4g} TFLOP/s, {p['gbps']:.4g} GB/s"
            for dtype, p in result["peaks"].items()
        )
        lines += ["", f"Peaks measured in this run (torch matmul, copy; same timer): {measured}."]
    if result.get("interrupted"):
        lines += ["", "**Interrupted: the cases after the last row did not run.**"]
    lines += _load_lines(result)
    lines += ["", HEADER]
    return "\n".join(lines + [_row(r) for r in result["records"]])


def _load_lines(result: dict) -> list[str]:
    """The load the run met, and a warning where its ratios cannot be quoted."""
    before, after = result.get("load_before"), result.get("load_after")
    if before is None:  # a result recorded before the bench recorded its load
        return []
    lines = [
        "",
        f"Load average (1 min) before the run {before['load_1min']:.2f}"
        + ("" if after is None else f", after it {after['load_1min']:.2f}")
        + f", on {before['cpus']} CPUs.",
    ]
    shaky = [r for r in result["records"] if r.get("reliable") is False]
    if loaded(before):
        lines += [
            "",
            f"**The machine was loaded when the run started (1-minute load "
            f"{before['load_1min']:.2f} on {before['cpus']} CPUs): other work shared it, so "
            "these ratios are not figures to quote; rerun on an idle machine.**",
        ]
    if shaky:
        lines += [
            "",
            f"**{len(shaky)} row(s) marked `?` never settled: their samples spread by more "
            f"than {SPREAD_LIMIT:.0%} in each of {ROUNDS} rounds (see `spread` in the JSON).**",
        ]
    return lines


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as error:
        raise ImportError(f"--plot {PLOT_NEEDS}") from error
    records = [r for r in result["records"] if "ratio" in r]
    labels = [f"{_op_label(r)} {r['shape']} {r['dtype']}" for r in records]
    fig, ax = plt.subplots(figsize=(12, 0.28 * len(records) + 1.5))
    ratios = [r["ratio"] for r in records]
    ax.barh(range(len(records)), ratios)
    for row, ratio in enumerate(ratios):  # the value beside each bar: a zero bar stays visible
        ax.text(ratio, row, f" {ratio:.2f}", va="center", fontsize=7)
    scale = ""
    low, high = min([*ratios, 1.0]), max([*ratios, 1.0])
    if low > 0 and high / low > 10:  # a few far bars would squash the rest to slivers
        ax.set_xscale("log")
        ax.set_xlim(low / 1.5, high * 2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        scale = ", log scale"
    else:
        ax.set_xlim(0, high * 1.15)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(records)), labels, fontsize=7)
    ax.set_ylim(len(records) - 0.5, -0.5)  # the first case on top, no empty margins
    ax.set_xlabel(f"bik speed / baseline speed (baseline ms / bik ms{scale})")
    note = " (portable reference backend)" if result.get("backend") in BACKEND_NOTES else ""
    ax.set_title(
        f"bik `{result.get('backend')}`{note} vs non-invariant baselines: {result['device']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # long case labels stay whole
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where it runs (default cpu)"
    )
    ops = case_lib.all_ops()
    parser.add_argument(
        "--ops",
        nargs="+",
        action=AllOf,
        valid=ops,
        metavar="OP",
        help=f"only these ops, of: {', '.join(ops)} (--quick offers fewer)",
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=sorted(DTYPE_NAMES), default=["float32", "bfloat16"]
    )
    parser.add_argument(
        "--quick", action="store_true", help="small shapes, about a minute on a CPU"
    )
    parser.add_argument(
        "--min-time",
        type=positive_float,
        help=f"seconds per timed sample set (> 0, default {MIN_TIME})",
    )
    vllm = parser.add_argument_group(
        "vLLM", "--vllm: tokens/s of vLLM with bik vs native vLLM instead of the kernels"
    )
    vllm.add_argument(
        "--vllm",
        action="store_true",
        help="time vLLM generation, with bik and native (each in its own process)",
    )
    vllm.add_argument(
        "--model",
        type=verify.model_name,
        help="a local model directory (default: a random-init Qwen3, hidden "
        f"{vllm_throughput.MODEL['hidden']}, {vllm_throughput.MODEL['layers']} layers, vocab "
        f"{vllm_throughput.MODEL['vocab']}; smaller with --quick)",
    )
    vllm.add_argument(
        "--family",
        choices=ENGINE_FAMILIES,
        metavar="FAMILY",
        help="the random-init model's family instead of Qwen3: its tiny preset (bik.families) "
        "at that size, e.g. nemotron_h for a Mamba2 hybrid, qwen3_next for Gated DeltaNet "
        f"(one of: {', '.join(ENGINE_FAMILIES)})",
    )
    vllm.add_argument(
        "--speculative",
        type=positive_int,
        metavar="K",
        help="time bik's engine with n-gram speculation of K draft tokens against it without, "
        "greedy, on a task that repeats its prompt and one that does not (the same bits "
        "asserted); bik's engine only",
    )
    vllm.add_argument(
        "--threads",
        type=positive_int,
        help="OpenMP threads of both engines (OMP_NUM_THREADS; default: vLLM's choice)",
    )
    vllm.add_argument(
        "--tp",
        type=positive_int,
        help="both engines' tensor-parallel degree, a worker process per rank on its share of "
        "the CPUs; bik's in the TP-invariant order (a power of two dividing "
        f"{TP_CHUNKS}; default 1)",
    )
    for option, default in vllm_throughput.DEFAULTS.items():
        what = {"prompts": "prompts", "tokens": "tokens generated per prompt"}
        vllm.add_argument(
            f"--{option}",
            type=positive_int,
            help=f"{what.get(option, 'timed runs after the warm-up')} (default {default}, "
            f"--quick {vllm_throughput.QUICK[option]})",
        )
    parser.add_argument("--json", type=output_file, help="write the records to this JSON file")
    parser.add_argument(
        "--markdown", type=output_file, help="write the table, with the device named, to this file"
    )
    parser.add_argument(
        "--plot",
        type=output_file,
        help="write a PNG bar chart of the ratios (needs matplotlib)",
    )


VLLM_ONLY = ("model", "family", "prompts", "tokens", "runs", "threads", "tp", "speculative")


def check(args: argparse.Namespace) -> None:
    """What argparse cannot see: the device, the ops offered on it (or vLLM and a model
    directory for --vllm), matplotlib for --plot, and one file per output."""
    check_device(args.device)
    try:
        backends.resolve(torch.device(args.device))
    except RuntimeError as error:
        raise UsageError("--device", str(error)) from None
    if args.vllm:
        _check_vllm(args)
    else:
        for option in VLLM_ONLY:
            if getattr(args, option) is not None:
                raise UsageError(f"--{option}", "applies to --vllm only")
    problem = unknown_ops(args.device, args.ops, args.quick)
    if problem:
        raise UsageError("--ops", problem)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot", PLOT_NEEDS)
    outputs = {"--json": args.json, "--markdown": args.markdown, "--plot": args.plot}
    seen: dict[str, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise UsageError(option, f"{path!r} is also the {seen[key]} file; give each its own")
        seen[key] = option


def _check_vllm(args):
    problem = vllm_engine.vllm_problem()
    if problem:
        raise UsageError("--vllm", problem)
    for option in ("ops", "min_time"):
        if getattr(args, option) is not None:
            raise UsageError(f"--{option.replace('_', '-')}", "times the kernels; not with --vllm")
    if args.model is not None and (args.model == "all" or args.model in PRESETS):
        raise UsageError("--model", f"expected a local model directory, got {args.model!r}")
    if args.model is not None and args.family is not None:
        raise UsageError("--family", "sizes the random-init model; not with --model")
    if args.speculative is not None:
        for option in ("family", "tp", "threads"):
            if getattr(args, option) is not None:
                raise UsageError(
                    f"--{option}", "not with --speculative (one engine, Qwen3 or --model)"
                )
    if args.tp is not None:
        if TP_CHUNKS % args.tp:
            raise UsageError("--tp", f"expected a power of two dividing {TP_CHUNKS}, got {args.tp}")
        if len(os.sched_getaffinity(0)) < args.tp:
            raise UsageError(
                "--tp", f"needs a CPU per rank; this process may use fewer than {args.tp}"
            )


def main(args: argparse.Namespace) -> int:
    print(HEADER)
    model = str(models.path(args.model)) if args.model in models.MODELS else args.model
    if args.vllm:
        common = {
            "model": model,
            "dtypes": args.dtypes,
            "prompts": args.prompts,
            "tokens": args.tokens,
            "runs": args.runs,
            "quick": args.quick,
            "device": args.device,
            "echo": lambda line: print(line, flush=True),
            "row": _row,
        }
        if args.speculative:
            result = speculative.run(args.speculative, **common)
        else:
            result = vllm_throughput.run(
                family=args.family or "qwen3",
                threads=args.threads,
                tensor_parallel=args.tp or 1,
                **common,
            )
        save(result, args.json, args.plot)
    else:
        result = run(
            device=args.device,
            ops=args.ops,
            dtypes=args.dtypes,
            quick=args.quick,
            min_time=args.min_time or MIN_TIME,
            json_path=args.json,
            plot_path=args.plot,
        )
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(markdown(result) + "\n")
    if result.get("interrupted"):
        return 130
    return 1 if any("error" in r for r in result["records"]) else 0
