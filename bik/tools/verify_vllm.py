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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import hf
from ..testing import sample_prompts
from ..vllm import engine as vllm_engine

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MAX_SEQS = 8  # sequence slots per engine step (the requests outnumber them)
STEP_TOKENS = 32  # token budget per engine step: longer prompts are prefilled in chunks
TRAINER_BATCH = 8
KERNELS = {"native": "native vLLM", "bik": "vLLM + bik"}
# the row of native vLLM against an unpatched trainer: the baseline a reader starts from
PLAIN_TRAINER_ROW = "native vLLM, plain torch trainer"


def engine_settings(requests: int, longest: int) -> dict:
    """vLLM engine keywords for ``requests`` sequences: fewer slots than requests, chunked
    prefill with a small step budget, prefix caching, a context that fits the longest one."""
    return {
        "max_num_seqs": max(1, min(MAX_SEQS, requests // 2)),
        "max_num_batched_tokens": STEP_TOKENS,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "max_model_len": longest,
    }


def load_trainer(model_dir: str, device: str, dtype: torch.dtype) -> PreTrainedModel:
    """The Hugging Face model in ``model_dir`` as a trainer loads it: ``from_pretrained`` in
    ``dtype`` (buffers such as the rotary frequencies stay fp32, as in vLLM), eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    # transformers types PreTrainedModel.to through a decorator that drops its signature
    return model.to(device).eval()  # type: ignore[arg-type]


def trainer_logprobs(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], samples: Sequence[Sequence[dict]]
) -> list[list[torch.Tensor]]:
    """``bik.token_logprobs`` of every sampled token under one full forward of its sequence
    (prompt + sample), through ``model`` as it is (patch it first); ``[prompt][sample]``."""
    pad_id = model.config.pad_token_id or 0
    flat = [
        (i, torch.tensor([*prompts[i], *s["tokens"]]), len(s["tokens"]))
        for i, per_prompt in enumerate(samples)
        for s in per_prompt
    ]
    scores = []
    with torch.no_grad():
        for start in range(0, len(flat), TRAINER_BATCH):
            chunk = flat[start : start + TRAINER_BATCH]
            ids, mask = hf.left_pad([seq for _, seq, _ in chunk], pad_id)
            ids, mask = ids.to(model.device), mask.to(model.device)
            out = hf.sequence_logprobs(model, ids, mask, mask).cpu()
            scores += [out[row, ids.shape[1] - new :] for row, (_, _, new) in enumerate(chunk)]
    result: list[list[torch.Tensor]] = [[] for _ in samples]
    it = iter(scores)
    for i, _, _ in flat:
        result[i].append(next(it))
    return result


@dataclass
class Comparison:
    """One engine's log-probs against the trainer's."""

    unequal: int
    total: int
    max_diff: float
    identical_requests: int
    requests: int
    first: tuple[int, int, int] | None  # (prompt, sample, generated-token position)

    @property
    def identical(self) -> bool:
        return self.unequal == 0 and self.total > 0


def compare(
    samples: Sequence[Sequence[dict]], trained: Sequence[Sequence[torch.Tensor]]
) -> Comparison:
    """Count the sampled tokens whose engine log-prob differs from the trainer's; the first
    difference is the first in request order (prompt, then sample), then token position."""
    unequal = total = identical = requests = 0
    max_diff, first = 0.0, None
    for i, (per_prompt, ref_prompt) in enumerate(zip(samples, trained)):
        for j, (sample, ref) in enumerate(zip(per_prompt, ref_prompt)):
            got = torch.tensor(sample["logprobs"], dtype=torch.float32)
            differs = got != ref
            requests += 1
            total += len(got)
            unequal += int(differs.sum())
            identical += not bool(differs.any())
            if len(got):
                max_diff = max(max_diff, (got.double() - ref.double()).abs().max().item())
            if first is None and differs.any():
                first = (i, j, int(differs.nonzero()[0, 0]))
    return Comparison(unequal, total, max_diff, identical, requests, first)


def _cell(c: Comparison) -> str:
    verdict = "bit-identical" if c.identical else "DIFFERS"
    return (
        f"{c.unequal}/{c.total} | {c.max_diff:.2e} | {c.identical_requests}/{c.requests} "
        f"| {verdict} |"
    )


def first_difference(c: Comparison | None) -> str:
    """Where ``c``'s first difference is, 'none', or 'not run' (no comparison)."""
    if c is None:
        return "not run"
    if c.first is None:
        return "none"
    prompt, sample, position = c.first
    return f"request {prompt} (sample {sample}), generated token {position}"


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
