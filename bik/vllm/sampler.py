"""vLLM's sampler with bik's log-softmax: the log-probs it returns are bik's formula.

``raw_logprobs`` (vLLM's default) is ``bik.log_softmax`` of the logits, upcast to fp32;
``processed_logprobs`` is ``bik.log_softmax`` of the logits vLLM samples from (after
temperature, and top-k/top-p masking when asked). vLLM divides fp32 logits by an fp32
temperature, exactly as ``bik.token_logprobs(logits, tokens, temperature)`` does inside its
kernel, so both give the same bits. The sampler is patched in place (it has no extension
point); the sampling itself is vLLM's.
"""

from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.sample.sampler import Sampler

from ..ops.log_softmax import log_softmax

_ORIGINAL: dict[str, Callable[..., Any]] = {"__init__": Sampler.__init__, "sample": Sampler.sample}


def _compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return log_softmax(logits, dtype=torch.float32)


def _init(self: Sampler, logprobs_mode: str = "raw_logprobs", *args: Any, **kwargs: Any) -> None:
    _ORIGINAL["__init__"](self, logprobs_mode, *args, **kwargs)
    if logprobs_mode == "processed_logprobs":
        # Let the top-k/top-p sampler hand back the processed logits; bik takes their
        # log-softmax in sample() below.
        self.topk_topp_sampler.logprobs_mode = "processed_logits"


def _sample(
    self: Sampler,
    logits: torch.Tensor,
    sampling_metadata: Any,
    logprobs_mode_override: str | None = None,
) -> tuple[Any, torch.Tensor | None]:
    mode = logprobs_mode_override or self.logprobs_mode
    sampled, processed = _ORIGINAL["sample"](
        self, logits, sampling_metadata, logprobs_mode_override
    )
    if mode == "processed_logprobs" and not sampling_metadata.all_greedy:
        processed = _compute_logprobs(processed)  # the greedy path already called it
    return sampled, processed


def install() -> None:
    """Route the sampler's log-softmax through bik (once per process)."""
    patches = {
        "compute_logprobs": staticmethod(_compute_logprobs),
        "__init__": _init,
        "sample": _sample,
    }
    for name, method in patches.items():
        setattr(Sampler, name, method)
