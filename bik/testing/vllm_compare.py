"""A vLLM engine's rollout log-probs against the trainer's: the engine settings that exercise
continuous batching, chunked prefill and prefix caching, the trainer as it loads the same model
directory, its log-probs of every sampled token, and the count of where they part (the
comparison of ``python -m bik verify --engine vllm``, shared with the vLLM tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import hf

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MAX_SEQS = 8  # sequence slots per engine step (the requests outnumber them)
STEP_TOKENS = 32  # token budget per engine step: longer prompts are prefilled in chunks
TRAINER_BATCH = 8


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


def first_difference(c: Comparison | None) -> str:
    """Where ``c``'s first difference is, 'none', or 'not run' (no comparison)."""
    if c is None:
        return "not run"
    if c.first is None:
        return "none"
    prompt, sample, position = c.first
    return f"request {prompt} (sample {sample}), generated token {position}"
