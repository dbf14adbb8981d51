"""``python -m bik verify --engine vllm``: vLLM's rollout log-probs against the trainer's.

Native vLLM and vLLM with bik (each in its own process, :mod:`bik.vllm.engine`) sample
the same prompts (random token ids of mixed lengths from a seeded generator, half of them
behind one shared prefix) in batches that exercise continuous batching (fewer sequence slots
than requests), chunked prefill (a small token budget per step), prefix caching and ``n > 1``
samples per prompt. The trainer (the bik-patched Hugging Face model loaded from the same
directory, one full forward over each finished sequence) scores every sampled token with
``bik.token_logprobs``; each engine's log-probs are compared with the trainer's bit for bit.
Native vLLM is compared with the unpatched trainer as well (the baseline a reader starts from:
neither side on bik).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .. import hf
from ..testing import sample_prompts
from ..testing.vllm_compare import (
    STEP_TOKENS,
    Comparison,
    compare,
    engine_settings,
    first_difference,
    trainer_logprobs,
)
from ..vllm import engine as vllm_engine

if TYPE_CHECKING:
    from transformers import PreTrainedModel

KERNELS = {"native": "native vLLM", "bik": "vLLM + bik"}
# the row of native vLLM against an unpatched trainer: the baseline a reader starts from
PLAIN_TRAINER_ROW = "native vLLM, plain torch trainer"


def _cell(c: Comparison) -> str:
    verdict = "bit-identical" if c.identical else "DIFFERS"
    return (
        f"{c.unequal}/{c.total} | {c.max_diff:.2e} | {c.identical_requests}/{c.requests} "
        f"| {verdict} |"
    )


def verify_vllm(
    model: PreTrainedModel,
    model_dir: str,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    prompts: int = 16,
    tokens: int = 16,
    samples: int = 2,
    seed: int = 0,
    native: bool = True,
    tensor_parallel: int | None = None,
    echo: Callable[[str], object] = print,
) -> bool:
    """Run both engines on ``model_dir`` and compare them with the trainer, ``model`` (the
    Hugging Face model loaded from ``model_dir`` in ``dtype`` on ``device``, patched here);
    print the table. Returns True if bik's log-probs equal the trainer's bit for bit.
    ``tensor_parallel``: both engines at that TP degree, bik's and the trainer in bik's
    TP-invariant order (None: TP 1, bik's default order)."""
    from ..backends import resolve

    backend = resolve(torch.device(device)).name
    tp_invariant = tensor_parallel is not None
    tensor_parallel = tensor_parallel or 1
    report = hf.patch_model(model, backend=backend, tp_invariant=tp_invariant)
    batch = sample_prompts(seed, prompts, model.config.vocab_size)
    settings = engine_settings(prompts * samples, max(map(len, batch)) + tokens)
    settings["seed"] = seed  # the engines' sampling seed
    env = {}
    if tp_invariant:
        settings["tensor_parallel_size"] = tensor_parallel
        settings["disable_custom_all_reduce"] = True
        env = vllm_engine.cpu_binding(tensor_parallel) if device == "cpu" else {}
    sampling = {
        "n": samples,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "logprobs": 0,
    }
    results, comparisons = {}, {}
    for engine in ("native", "bik") if native else ("bik",):
        echo(f"running {KERNELS[engine]} ({dtype}) ...")
        results[engine] = vllm_engine.run_engine(
            engine,
            model_dir,
            batch,
            dtype=dtype,
            backend=backend,
            tp_invariant=tp_invariant,
            engine_args=settings,
            sampling=sampling,
            env=env,
        )
        outputs = results[engine]["outputs"]
        comparisons[KERNELS[engine]] = compare(outputs, trainer_logprobs(model, batch, outputs))
        if engine == "native":  # and against the trainer without bik, the reader's baseline
            hf.unpatch_model(model)
            plain = trainer_logprobs(model, batch, outputs)
            report = hf.patch_model(model, backend=backend, tp_invariant=tp_invariant)
            comparisons[PLAIN_TRAINER_ROW] = compare(outputs, plain)
    bik_run = results["bik"]
    echo(str(report))
    echo(
        f"vLLM {bik_run['vllm']}, {dtype}, bik backend {backend}, "
        + (f"TP {tensor_parallel} (TP-invariant order)" if tp_invariant else "TP 1")
        + f": {prompts} prompts x {samples} "
        f"samples x {tokens} tokens; {settings['max_num_seqs']} sequence slots, "
        f"{STEP_TOKENS}-token steps (chunked prefill), prefix caching "
        f"({sum(bik_run['cached_tokens'])} prompt tokens read from the cache with bik)"
    )
    echo(
        "| kernels | unequal log-probs vs trainer | max abs diff | identical requests | verdict |"
        "\n|---|---:|---:|---:|---|"
    )
    for row, comparison in comparisons.items():
        echo(f"| {row} | {_cell(comparison)}")
    native_row = comparisons.get(KERNELS["native"])
    echo(f"native vLLM vs trainer, first difference: {first_difference(native_row)}")
    passed = comparisons[KERNELS["bik"]].identical
    if not passed:
        echo(f"bik: MISMATCH; first difference: {first_difference(comparisons[KERNELS['bik']])}")
    return passed
