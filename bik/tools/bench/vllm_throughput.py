"""``python -m bik bench --vllm``: generated tokens/s of vLLM with bik against native vLLM.

Both engines run the same model, prompts and settings (eager mode, block size 32, prefix
caching off, since every timed run repeats the prompts) in a process of their own
(:mod:`bik.vllm.engine`), one after the other: one ``generate`` call as the warm-up,
then ``runs`` timed calls. Sampling is a rollout's: temperature 1, the sampled tokens'
log-probs returned, ``tokens`` new tokens per prompt (end-of-sequence ignored).
``ratio = bik tokens/s / native tokens/s`` (= native ms / bik ms, the kernel bench's ratio).
With ``tensor_parallel`` above 1 both engines run that many worker processes, a share of the
CPUs each (bik.vllm.engine.cpu_binding), bik's in the TP-invariant order.
"""

import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from ...contract import DTYPE_NAMES
from ...testing import sample_prompts
from ...testing.machine import device_name
from ...testing.presets import save_model
from ...vllm import engine as vllm_engine

OP = "vllm_generate"
# The default model (random init, saved to a temporary directory): a small Qwen3 (or, with
# ``family``, that family's tiny preset at this size).
MODEL = {"hidden": 512, "layers": 4, "vocab": 8192}
QUICK_MODEL = {"hidden": 128, "layers": 2, "vocab": 1024}
DEFAULTS = {"prompts": 32, "tokens": 64, "runs": 3}
QUICK = {"prompts": 8, "tokens": 16, "runs": 1}


def describe(config) -> str:
    """'FAMILY hidden=H layers=L vocab=V' of a model config."""
    return (
        f"{config.model_type} hidden={config.hidden_size} layers={config.num_hidden_layers} "
        f"vocab={config.vocab_size}"
    )


def time_engine(
    engine: str,
    model_dir: str,
    prompts: Sequence[Sequence[int]],
    dtype: str,
    backend: str,
    tokens: int,
    runs: int,
    threads: int | None = None,
    tensor_parallel: int = 1,
    temperature: float = 1.0,
    engine_args: dict | None = None,
) -> dict:
    """One engine's warm-up and ``runs`` timed generate calls; its :func:`run_engine` result.
    threads: the engine's OpenMP threads (OMP_NUM_THREADS), None: vLLM's choice;
    tensor_parallel: its TP degree (bik's then in the TP-invariant order); engine_args: more
    keywords of the engine (a speculative_config)."""
    env = vllm_engine.cpu_binding(tensor_parallel)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    sharded = {"tensor_parallel_size": tensor_parallel, "disable_custom_all_reduce": True}
    return vllm_engine.run_engine(
        engine,
        model_dir,
        prompts,
        dtype=dtype,
        backend=backend,
        tp_invariant=tensor_parallel > 1,
        engine_args={
            "enable_prefix_caching": False,
            "max_model_len": max(map(len, prompts)) + tokens,
            **(sharded if tensor_parallel > 1 else {}),
            **(engine_args or {}),
        },
        sampling={
            "max_tokens": tokens,
            "min_tokens": tokens,
            "ignore_eos": True,
            "temperature": temperature,
            "logprobs": 0,
        },
        timed_runs=runs,
        env=env or None,
    )


def record(shape: str, dtype: str, backend: str, bik: dict, native: dict) -> dict:
    """One bench record from the two engines' results (median of the timed runs)."""
    bik_s, native_s = statistics.median(bik["seconds"]), statistics.median(native["seconds"])
    tokens = bik["generated_tokens"]
    if native["generated_tokens"] != tokens:
        raise RuntimeError(
            f"the engines generated {tokens} (bik) and {native['generated_tokens']} (native) "
            "tokens per run; the timings are not comparable"
        )
    return {
        "op": OP,
        "shape": f"{shape}, {bik['threads']} thread{'s' if bik['threads'] != 1 else ''}",
        "dtype": dtype,
        "backend": backend,
        "bik_ms": bik_s * 1e3,
        "baseline_ms": native_s * 1e3,
        "ratio": native_s / bik_s,
        "bik_tokens_per_s": tokens / bik_s,
        "baseline_tokens_per_s": tokens / native_s,
        "baseline": "native vLLM",
        "generated_tokens": tokens,
        "bik_runs_s": bik["seconds"],
        "baseline_runs_s": native["seconds"],
        "engine_threads": bik["threads"],
    }


def run(
    model: str | None = None,
    family: str = "qwen3",
    device: str = "cpu",
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    prompts: int | None = None,
    tokens: int | None = None,
    runs: int | None = None,
    threads: int | None = None,
    quick: bool = False,
    seed: int = 0,
    tensor_parallel: int = 1,
    echo: Callable[..., object] = print,
    row: Callable[[dict], str] = str,
) -> dict:
    """Time native vLLM and vLLM with bik on ``model`` (a local directory; None: a random-init
    model of ``family`` (:func:`save_model`), :data:`MODEL` or with ``quick``
    :data:`QUICK_MODEL`); the bench's result dict.
    Unset counts come from :data:`DEFAULTS` (``quick``: :data:`QUICK`); ``threads`` sets
    both engines' OpenMP threads (None: vLLM's choice); ``tensor_parallel`` both engines'
    TP degree."""
    from transformers import AutoConfig

    from ... import backends

    problem = vllm_engine.vllm_problem()
    if problem:
        raise ImportError(problem)
    unknown = [d for d in dtypes if d not in DTYPE_NAMES]
    if unknown:
        raise ValueError(f"dtypes: unknown {', '.join(unknown)}; expected some of {DTYPE_NAMES}")
    given = {"prompts": prompts, "tokens": tokens, "runs": runs}
    counts = {k: given[k] or v for k, v in (QUICK if quick else DEFAULTS).items()}
    backend = backends.resolve(torch.device(device)).name
    load_before = os.getloadavg()[0]  # other work on the machine skews the timings
    with tempfile.TemporaryDirectory(prefix="bik-bench-vllm-") as scratch:
        size = QUICK_MODEL if quick else MODEL
        model_dir = model or save_model(scratch, **size, seed=seed, family=family)
        config = AutoConfig.from_pretrained(model_dir)
        shape = f"{describe(config)} {counts['prompts']} prompts x {counts['tokens']} tokens"
        if tensor_parallel > 1:
            shape += f", TP {tensor_parallel}"
        batch = sample_prompts(seed, counts["prompts"], config.vocab_size)
        records, version = [], None
        for dtype in dtypes:
            results = {
                engine: time_engine(
                    engine,
                    model_dir,
                    batch,
                    dtype,
                    backend,
                    counts["tokens"],
                    counts["runs"],
                    threads,
                    tensor_parallel,
                )
                for engine in ("native", "bik")
            }
            version = results["bik"]["vllm"]
            records.append(record(shape, dtype, backend, results["bik"], results["native"]))
            echo(row(records[-1]))
    return result(device, backend, version, load_before, records)


def result(
    device: str, backend: str, version: str | None, load_before: float, records: list[dict]
) -> dict:
    """An engine bench's result dict: the machine, versions, load and ``records``."""
    return {
        "device": device_name(torch.device(device)),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "backend": backend,
        "vllm": version,
        "load_average_1min": [load_before, os.getloadavg()[0]],  # before, after
        "peaks": {},
        "records": records,
    }
