"""One vLLM engine, native or with bik, run in a process of its own.

bik is switched on in vLLM per process, and stays on (:func:`bik.vllm.enable`), so a tool
that compares the two engines never builds both in one process: :func:`run_engine` starts
``python -m bik.vllm.engine REQUEST.json RESULT.json`` with ``BIK_VLLM`` removed from
the environment; the child builds one engine (``vllm.LLM``, or ``bik.vllm.LLM``), generates
from token-id prompts (no tokenizer), and writes what it sampled, the log-probs vLLM returned,
the prompt tokens read from the prefix cache and the seconds of each timed run as JSON.
"""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENGINES = ("native", "bik")
INSTALL_VLLM = "vLLM is not installed in this environment; run `make install-vllm` (the vllm extra)"
# Engine settings both sides share. Native vLLM on CPU needs a block size that is a multiple
# of 32, and bik needs eager mode, so the native engine runs eager too (a fair comparison).
COMMON_ARGS = {"enforce_eager": True, "block_size": 32, "gpu_memory_utilization": 0.5, "seed": 0}
# Environment of the child: the engine core in the child process itself, a small CPU KV cache.
CHILD_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def vllm_problem() -> str | None:
    """Why vLLM cannot run here (not installed), or None."""
    return INSTALL_VLLM if importlib.util.find_spec("vllm") is None else None


def model_problem(model_dir: str, tensor_parallel: int = 1) -> str | None:
    """Why bik.vllm cannot run the model in ``model_dir`` at ``tensor_parallel``, read off
    its config.json before any engine starts (None when it can, or when the directory has no
    readable config: the loader reports that): biased experts (gpt-oss) above TP 1."""
    from .config import moe_tensor_parallel_problem

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    problem = moe_tensor_parallel_problem(config, tensor_parallel)
    return None if problem is None else f"{model_dir!r} holds {problem}"


def cpu_binding(tensor_parallel: int) -> dict[str, str]:
    """The environment a CPU engine at ``tensor_parallel`` > 1 needs: vLLM's CPU workers each
    bind to their own cores (``VLLM_CPU_OMP_THREADS_BIND``, e.g. "0|1"), split evenly from
    this process's CPUs; empty at 1 or when the variable is set already. ValueError with fewer
    CPUs than ranks."""
    if tensor_parallel == 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tensor_parallel:
        raise ValueError(
            f"tensor parallelism {tensor_parallel} on the CPU needs a core per rank; this "
            f"process may use {len(cpus)}"
        )
    per_rank = len(cpus) // tensor_parallel
    groups = [cpus[r * per_rank : (r + 1) * per_rank] for r in range(tensor_parallel)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in groups)}


def vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version("vllm-cpu")


def run_engine(
    engine: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    dtype: str = "float32",
    backend: str = "auto",
    tp_invariant: bool = False,
    engine_args: dict | None = None,
    sampling: dict | None = None,
    timed_runs: int = 0,
    weights_from: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> dict:
    """Generate from ``prompts`` (token ids) with one engine in a child process.

    engine: 'native' (``vllm.LLM``) or 'bik' (``bik.vllm.LLM`` with kernel ``backend`` and
    ``tp_invariant``).
    engine_args, sampling: keywords of ``vllm.LLM`` (over :data:`COMMON_ARGS`) and of
    ``vllm.SamplingParams``. The first ``generate`` call returns the outputs; with
    ``timed_runs`` > 0 it is the warm-up, and that many more calls are timed. ``env``: more
    environment variables for the child (such as ``OMP_NUM_THREADS``).

    Returns ``{"vllm", "threads", "outputs", "cached_tokens", "seconds", "generated_tokens",
    "speculation"}``:
    ``outputs[i][j]`` is ``{"tokens", "logprobs"}`` of sample j of prompt i (``logprobs`` the
    sampled tokens' log-probs when ``sampling`` asks for them, else None),
    ``cached_tokens[i]`` prompt i's tokens read from the prefix cache, ``seconds`` each timed
    run, ``generated_tokens`` the tokens one run generates and ``speculation`` the draft
    tokens proposed and kept and the engine steps over all its calls (:func:`speculation_counts`:
    None unless the engine has a ``speculative_config`` and ``disable_log_stats=False``).

    weights_from (bik only): a model directory whose weights are pushed into the running
    engine with ``bik.vllm.update_weights`` before the first ``generate`` (an RL weight sync,
    into every TP rank's worker).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine: expected one of {', '.join(ENGINES)}, got {engine!r}")
    if not isinstance(timed_runs, int) or timed_runs < 0:
        raise ValueError(f"timed_runs: expected an integer >= 0, got {timed_runs!r}")
    if weights_from is not None and engine != "bik":
        raise ValueError("weights_from: only the bik engine takes pushed weights")
    problem = vllm_problem()
    if problem:
        raise ImportError(problem)
    request = {
        "engine": engine,
        "model": str(model),
        "dtype": dtype,
        "backend": backend,
        "tp_invariant": tp_invariant,
        "engine_args": {**COMMON_ARGS, **(engine_args or {})},
        "sampling": dict(sampling or {}),
        "prompts": [[int(t) for t in p] for p in prompts],
        "timed_runs": timed_runs,
        "weights_from": None if weights_from is None else str(weights_from),
    }
    child_env = {**CHILD_ENV, **os.environ, **(env or {})}
    child_env.pop("BIK_VLLM", None)  # native means native: no bik plugin in the child
    with tempfile.TemporaryDirectory(prefix="bik-vllm-") as scratch:
        request_path, result_path = Path(scratch, "request.json"), Path(scratch, "result.json")
        request_path.write_text(json.dumps(request))
        done = subprocess.run(
            [sys.executable, "-m", __name__, str(request_path), str(result_path)],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0 or not result_path.exists():
            log = "\n".join((done.stdout + done.stderr).strip().splitlines()[-40:])
            raise RuntimeError(
                f"the {engine} vLLM engine on {model} failed (exit status {done.returncode}); "
                f"the end of its log:\n{log}"
            )
        return json.loads(result_path.read_text())


# -- the child -----------------------------------------------------------------------------


def _generate(llm, inputs, params) -> list:
    return llm.generate(inputs, params, use_tqdm=False)


def _samples(output, with_logprobs: bool) -> list[dict]:
    samples = []
    for completion in output.outputs:
        tokens = list(completion.token_ids)
        logprobs = (
            [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
            if with_logprobs
            else None
        )
        samples.append({"tokens": tokens, "logprobs": logprobs})
    return samples


def _push_weights(llm: Any, model_dir: str, dtype: str) -> None:
    """``model_dir``'s weights (cast to the engine's dtype) into the running engine."""
    from transformers import AutoModelForCausalLM

    from ..contract import DTYPE_NAMES
    from . import update_weights

    source = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPE_NAMES[dtype])
    update_weights(llm, source.named_parameters())


def serve(request: dict) -> dict:
    """Build the engine ``request`` names, generate, time; the result :func:`run_engine`
    returns. Runs in the child process (it may switch bik on for good)."""
    import torch
    import vllm
    from vllm.inputs import TokensPrompt

    kwargs = {"skip_tokenizer_init": True, "dtype": request["dtype"], **request["engine_args"]}
    if request["engine"] == "bik":
        from bik.vllm import LLM

        llm = LLM(
            request["model"],
            backend=request["backend"],
            tp_invariant=request["tp_invariant"],
            **kwargs,
        )
    else:
        llm = vllm.LLM(model=request["model"], **kwargs)
    if request.get("weights_from"):
        _push_weights(llm, request["weights_from"], request["dtype"])
    params = vllm.SamplingParams(detokenize=False, **request["sampling"])
    inputs = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    outputs = _generate(llm, inputs, params)
    seconds = []
    for _ in range(request["timed_runs"]):
        start = time.perf_counter()
        timed = _generate(llm, inputs, params)
        seconds.append(time.perf_counter() - start)
        outputs = timed
    with_logprobs = request["sampling"].get("logprobs") is not None
    return {
        "vllm": vllm_version(),
        "threads": torch.get_num_threads(),
        "outputs": [_samples(o, with_logprobs) for o in outputs],
        "cached_tokens": [o.num_cached_tokens or 0 for o in outputs],
        "seconds": seconds,
        "generated_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
        "speculation": speculation_counts(llm),
    }


# vLLM's counters of speculative decoding (its logged stats), and the histogram of the tokens
# each engine step ran, whose count is the steps (model forwards) the engine took
SPECULATION_METRICS = {
    "proposed": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}
STEPS_METRIC = "vllm:iteration_tokens_total"


def speculation_counts(llm: Any) -> dict[str, int] | None:
    """A speculative engine's draft tokens ``proposed`` and ``accepted`` and its steps
    (``forwards``) over all its calls so far, or None unless it has a ``speculative_config``
    and logs stats (``disable_log_stats=False``)."""
    engine = llm.llm_engine
    if engine.vllm_config.speculative_config is None or not engine.log_stats:
        return None
    metrics = engine.get_metrics()
    counts = {
        key: int(sum(m.value for m in metrics if m.name == name))
        for key, name in SPECULATION_METRICS.items()
    }
    counts["forwards"] = int(sum(m.count for m in metrics if m.name == STEPS_METRIC))
    return counts


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m bik.vllm.engine REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    request = json.loads(Path(argv[0]).read_text())
    result = serve(request)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
