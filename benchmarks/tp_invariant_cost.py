"""What bik's tensor-parallel-invariant order costs on the CPU, each pair timed side by side.

1. Kernels: a row-parallel linear (SmolLM2-135M's o_proj, 576 -> 576, and down_proj,
   1536 -> 576) in bik's default order (``bik.linear``, one chain over K) against the
   TP-invariant order (``bik.distributed.chunked_linear``, TP_CHUNKS chunks and a tree: one
   call of the cpu backend's chunked kernel), and that order as one bik.linear per chunk
   (``per_chunk_partial``, what backends without the kernel run; fp32 partial, no rounding).
2. The trainer: one forward of a random-init Qwen3 (hidden 512, 4 layers) patched with
   ``bik.patch_model`` against the same model patched with ``tp_invariant=True``.
3. vLLM (``--vllm``): generated tokens/s of vLLM with bik (``tp_invariant=True``) against
   native vLLM, both at tensor parallelism 2, each engine in its own process.
4. The sharded trainer (``--sharded``): the forward of that Qwen3 patched with
   ``tp_invariant=True`` and sharded by ``bik.distributed.tensor_parallel`` over 2 gloo
   processes of one thread each, against the same one-process model on one thread (timed in
   the first process while the second waits at a barrier; a second thread there would compete
   with the waiting rank). The sharded logits are checked against the one-process ones first.

The sides of a comparison are timed alternately in one run (median of ``--reps``), so
machine load hits them alike. Writes a JSON record and markdown tables:

    python benchmarks/tp_invariant_cost.py [--vllm] [--sharded] --json F.json --markdown F.md
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

import bik
from bik.contract import TP_CHUNKS
from bik.distributed import chunked_linear, per_chunk_partial
from bik.testing import sample_prompts
from bik.testing.cases import qwen3_config
from bik.testing.machine import device_name
from bik.testing.presets import save_model
from bik.vllm import engine as vllm_engine

LINEARS = {"o_proj 576->576": (576, 576), "down_proj 1536->576": (1536, 576)}
ROWS = (1, 128)
DTYPES = (torch.float32, torch.bfloat16)


def alternate(fns: Sequence[Callable[[], object]], reps: int) -> list[float]:
    """Median milliseconds of each of ``fns``, called in turn after one warm-up each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def kernel_rows(reps: int) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, (k, n) in LINEARS.items():
        for dtype in DTYPES:
            weight = torch.randn(n, k, generator=gen).to(dtype)
            for m in ROWS:
                x = torch.randn(m, k, generator=gen).to(dtype)
                default, chunked, per_chunk = alternate(
                    [
                        partial(bik.linear, x, weight),
                        partial(chunked_linear, x, weight),
                        partial(per_chunk_partial, x, weight, TP_CHUNKS),
                    ],
                    reps,
                )
                row = _row("linear", f"{name}, {m} rows", dtype, default, chunked)
                rows.append(dict(row, per_chunk_ms=per_chunk))
    return rows


TRAINER_SHAPE = "Qwen3 hidden 512, 4 layers, forward of 4 x 128 tokens"


def trainer_model(dtype: torch.dtype, tp_invariant: bool) -> torch.nn.Module:
    """The trainer benchmark's random Qwen3 (the same weights on every call), patched."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_config(512, 4, 8192, 1024))
    model = model.to(dtype).eval()
    bik.patch_model(model, backend="cpu", tp_invariant=tp_invariant)
    return model


def trainer_ids() -> torch.Tensor:
    return torch.randint(3, 8192, (4, 128), generator=torch.Generator().manual_seed(1))


def trainer_rows(reps: int) -> list[dict]:
    rows = []
    ids = trainer_ids()
    for dtype in DTYPES:
        models = [trainer_model(dtype, tp_invariant) for tp_invariant in (False, True)]
        with torch.no_grad():
            default, chunked = alternate([partial(models[0], ids), partial(models[1], ids)], reps)
        rows.append(_row("trainer forward", TRAINER_SHAPE, dtype, default, chunked))
    return rows


def _sharded_row(rank: int, dtype: torch.dtype, mesh: object, reps: int) -> dict:
    import torch.distributed as dist

    from bik.distributed import tensor_parallel

    ids = trainer_ids()
    one = trainer_model(dtype, True)
    sharded = tensor_parallel(trainer_model(dtype, True), mesh)

    def run_sharded() -> torch.Tensor:
        return sharded(ids).logits

    def run_one() -> None:  # rank 1 waits
        if rank == 0:
            one(ids)
        dist.barrier()

    with torch.no_grad():
        if not torch.equal(run_sharded(), one(ids).logits):
            raise AssertionError(f"{dtype}: the sharded logits differ from the one-process ones")
        ms = alternate([run_sharded, run_one], reps)
    return {
        "what": "trainer forward, tp_invariant=True",
        "shape": TRAINER_SHAPE,
        "dtype": str(dtype).removeprefix("torch."),
        "one_process_ms": ms[1],
        "tp2_ms": ms[0],
        "cost": ms[0] / ms[1],
    }


def _sharded_rank(rank: int, directory: str, reps: int) -> None:
    """One of the 2 ranks of :func:`sharded_rows`; rank 0 writes the rows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    bik.set_backend("cpu")
    torch.set_num_threads(1)
    store = f"file://{os.path.join(directory, 'store')}"
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        rows = [_sharded_row(rank, dtype, mesh, reps) for dtype in DTYPES]
        if rank == 0:
            with open(os.path.join(directory, "rows.json"), "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def sharded_rows(reps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.spawn(_sharded_rank, args=(directory, reps), nprocs=2)
        with open(os.path.join(directory, "rows.json")) as f:
            return json.load(f)


def _row(what: str, shape: str, dtype: torch.dtype, default_ms: float, chunked_ms: float) -> dict:
    return {
        "what": what,
        "shape": shape,
        "dtype": str(dtype).removeprefix("torch."),
        "default_ms": default_ms,
        "tp_invariant_ms": chunked_ms,
        "cost": chunked_ms / default_ms,
    }


def vllm_rows(dtypes: list[str], runs: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        save_model(directory, 512, 4, 8192)
        prompts = sample_prompts(0, 16, 8192)
        settings = {
            "enable_prefix_caching": False,
            "max_model_len": max(map(len, prompts)) + 32,
            "tensor_parallel_size": 2,
            "disable_custom_all_reduce": True,
        }
        sampling = {"max_tokens": 32, "min_tokens": 32, "ignore_eos": True, "logprobs": 0}
        for dtype in dtypes:
            results = {
                engine: vllm_engine.run_engine(
                    engine,
                    directory,
                    prompts,
                    dtype=dtype,
                    backend="cpu",
                    tp_invariant=engine == "bik",
                    engine_args=settings,
                    sampling=sampling,
                    timed_runs=runs,
                    env=vllm_engine.cpu_binding(2),
                )
                for engine in ("native", "bik")
            }
            per_s = {
                engine: r["generated_tokens"] / statistics.median(r["seconds"])
                for engine, r in results.items()
            }
            rows.append(
                {
                    "what": "vLLM generate, TP 2",
                    "shape": "Qwen3 hidden 512, 4 layers; 16 prompts x 32 tokens",
                    "dtype": dtype,
                    "native_tokens_per_s": per_s["native"],
                    "bik_tokens_per_s": per_s["bik"],
                    "bik_over_native": per_s["bik"] / per_s["native"],
                    "native_runs_s": results["native"]["seconds"],
                    "bik_runs_s": results["bik"]["seconds"],
                }
            )
    return rows


def markdown(result: dict) -> str:
    lines = [
        f"Device: {result['device']}, {result['threads']} threads, torch {result['torch']}; "
        f"TP_CHUNKS = {TP_CHUNKS}; load average before/after: {result['load'][0]} / "
        f"{result['load'][1]}",
        "",
        "| what | shape | dtype | default order ms | TP-invariant ms | cost "
        "| TP-invariant as per-chunk calls ms |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        per_chunk = f"{r['per_chunk_ms']:.3f}" if "per_chunk_ms" in r else "-"
        lines.append(
            f"| {r['what']} | {r['shape']} | {r['dtype']} | {r['default_ms']:.3f} "
            f"| {r['tp_invariant_ms']:.3f} | {r['cost']:.2f}x | {per_chunk} |"
        )
    if result["vllm"]:
        lines += [
            "",
            "| what | shape | dtype | native vLLM tokens/s | vLLM + bik tokens/s | bik / native |",
            "|---|---|---|---:|---:|---:|",
        ]
        for r in result["vllm"]:
            lines.append(
                f"| {r['what']} | {r['shape']} | {r['dtype']} | {r['native_tokens_per_s']:.1f} "
                f"| {r['bik_tokens_per_s']:.1f} | {r['bik_over_native']:.2f} |"
            )
    if result["sharded"]:
        lines += [
            "",
            "| what | shape | dtype | 1 process, 1 thread ms "
            "| TP 2 (2 gloo processes x 1 thread) ms | TP 2 / 1 process |",
            "|---|---|---|---:|---:|---:|",
        ]
        for r in result["sharded"]:
            lines.append(
                f"| {r['what']} | {r['shape']} | {r['dtype']} "
                f"| {r['one_process_ms']:.1f} | {r['tp2_ms']:.1f} | {r['cost']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--vllm", action="store_true", help="also vLLM at TP 2 (minutes)")
    parser.add_argument("--vllm-runs", type=int, default=3)
    parser.add_argument(
        "--sharded", action="store_true", help="also the trainer sharded over 2 gloo processes"
    )
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    bik.set_backend("cpu")
    load_before = os.getloadavg()[0]
    rows = kernel_rows(args.reps) + trainer_rows(max(3, args.reps // 4))
    vllm = vllm_rows(["float32", "bfloat16"], args.vllm_runs) if args.vllm else []
    sharded = sharded_rows(max(3, args.reps // 4)) if args.sharded else []
    result = {
        "device": device_name(torch.device("cpu")),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rows": rows,
        "vllm": vllm,
        "sharded": sharded,
    }
    text = markdown(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
