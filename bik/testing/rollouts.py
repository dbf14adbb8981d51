"""Sample a rollout and score it as a trainer does: the measurements of ``python -m bik demo``,
shared with benchmarks/ (the cheap fixes, the mismatch anatomy) and the tests.

A :class:`Rollout` is sampled with transformers' ``generate`` (:func:`sample`), then its
tokens are scored the engine's way (:func:`decode_logprobs`: token by token over the KV cache)
and the trainer's (:func:`score`: one forward of the finished batch, or each row alone);
:func:`differ` counts where two sets of log-probs part.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import hf
from ..ops.log_softmax import token_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PROMPTS = (
    "What is the capital of France?",
    "Give me one tip for sleeping better.",
    "What is 12 + 7?",
    "Name a fruit that is yellow.",
)
TEMPERATURE = 0.7
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BAND = (0.9, 1.1)  # a ratio exp(delta) outside it is what a token-level remedy acts on


def load(directory: str, dtype: torch.dtype) -> PreTrainedModel:
    """The model as a trainer loads it (rotary frequencies stay fp32), eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def chat_prompts(tokenizer: Any, texts: tuple[str, ...]) -> list[torch.Tensor]:
    """Each text as a user turn of the tokenizer's chat template, ready for the answer."""
    return [
        torch.tensor(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for text in texts
    ]


@dataclass
class Rollout:
    """A sampled left-padded batch: sequences, masks and the sampler's own log-probs."""

    sequences: torch.Tensor  # [B, P + N]
    mask: torch.Tensor  # 1 on prompt and response tokens, 0 on padding
    response: torch.Tensor  # 1 on response tokens
    logprobs: torch.Tensor  # [B, N]: from the logits generate sampled with
    prompt_width: int


def _token_counter(tokens: int) -> Any:
    """A stopping criterion that stops nothing and prints how many tokens were generated
    (generation is the demo's longest wait on a loaded machine)."""
    from transformers import StoppingCriteria

    class Counter(StoppingCriteria):
        done = 0

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            self.done += 1
            end = "\n" if self.done == tokens else ""
            print(f"\r  .. token {self.done}/{tokens}", end=end, flush=True)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return Counter()


def sample(
    model: PreTrainedModel,
    prompts: list[torch.Tensor],
    tokens: int,
    seed: int,
    pad: int,
    temperature: float = TEMPERATURE,
    top_p: float = 1.0,
) -> Rollout:
    """``tokens`` sampled tokens per prompt (EOS suppressed, so every row has them all), from
    the top-p nucleus (1: the whole distribution), on the model's device; the log-probs are the
    sampler's raw logits for the token it sampled, through ``bik.token_logprobs`` at
    ``temperature`` (the trainer's formula)."""
    from transformers import StoppingCriteriaList

    ids, mask = (t.to(model.device) for t in hf.left_pad(prompts, pad))
    torch.manual_seed(seed)
    with torch.no_grad():
        # GenerationMixin.generate: its output's type follows the flags (Any here)
        out = cast(Any, model).generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=top_p,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
            stopping_criteria=StoppingCriteriaList([_token_counter(tokens)]),
        )
    generated = out.sequences[:, ids.shape[1] :]
    logprobs = token_logprobs(torch.stack(out.logits, 1).float(), generated, temperature)
    full = torch.cat([mask, torch.ones_like(generated)], 1)
    response = torch.cat([torch.zeros_like(mask), torch.ones_like(generated)], 1)
    return Rollout(out.sequences, full, response, logprobs, ids.shape[1])


def score(
    model: PreTrainedModel,
    rollout: Rollout,
    rows: list[int] | None = None,
    temperature: float = TEMPERATURE,
) -> torch.Tensor:
    """The trainer's log-probs of the sampled tokens ``[B, N]``: one forward of the batch, or
    (``rows``) of those rows alone, each cut to its own length (no padding)."""
    with torch.no_grad():
        if rows is None:
            out = hf.sequence_logprobs(
                model, rollout.sequences, rollout.mask, rollout.response, temperature
            )
            return out[:, rollout.prompt_width :]
        scored = []
        for row in rows:
            start = int(rollout.mask[row].argmax())
            seq = rollout.sequences[row : row + 1, start:]
            resp = rollout.response[row : row + 1, start:]
            out = hf.sequence_logprobs(model, seq, torch.ones_like(seq), resp, temperature)
            scored.append(out[0, rollout.prompt_width - start :])
        return torch.stack(scored)


@contextmanager
def fp32_head(model: Any, on: bool) -> Iterator[None]:
    """The LM head in fp32, its input cast up (TRL's cast_lm_head_to_fp32), while active."""
    if not on:
        yield
        return
    head = model.lm_head
    weight = head.weight  # may be the embedding's too (tied): that one stays as it is
    head.weight = torch.nn.Parameter(weight.detach().float(), requires_grad=False)
    hook = head.register_forward_pre_hook(lambda _, args: (args[0].float(),))
    try:
        yield
    finally:
        hook.remove()
        head.weight = weight


@torch.no_grad()
def decode_logits(model: Any, rollout: Rollout) -> torch.Tensor:
    """The rollout's way on given tokens: the prompt prefilled, then each response token fed
    one at a time over the KV cache, as the engine that sampled them computed it. Returns the
    logits each token was drawn from, ``[B, N, V]`` in the model's dtype."""
    from transformers import DynamicCache

    width = rollout.prompt_width
    mask = rollout.mask
    positions = hf.generation_position_ids(mask[:, :width])
    cache = DynamicCache(config=model.config)  # a hybrid's recurrent layers need theirs
    out = model(
        input_ids=rollout.sequences[:, :width],
        attention_mask=mask[:, :width],
        position_ids=positions,
        **hf.cache_argument(model, cache),
        use_cache=True,
    )
    logits = [out.logits[:, -1]]
    for step, column in enumerate(range(width, rollout.sequences.shape[1] - 1), 1):
        out = model(
            input_ids=rollout.sequences[:, column : column + 1],
            attention_mask=mask[:, : column + 1],
            position_ids=positions[:, -1:] + step,
            **hf.cache_argument(model, cache),
            use_cache=True,
        )
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def decode_logprobs(model: Any, rollout: Rollout, temperature: float = TEMPERATURE) -> torch.Tensor:
    """The rollout's log-probs of its own tokens, recomputed the engine's way
    (:func:`decode_logits`), through the trainer's formula ``[B, N]``."""
    generated = rollout.sequences[:, rollout.prompt_width :]
    return token_logprobs(decode_logits(model, rollout).float(), generated, temperature)


def differ(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, float, float]:
    """(tokens unequal, tokens, max |a - b|, share of tokens with exp(a - b) outside BAND)."""
    delta = (a.double() - b.double()).flatten()
    ratio = delta.exp()
    outside = ((ratio < BAND[0]) | (ratio > BAND[1])).double().mean().item()
    return int((delta != 0).sum()), delta.numel(), delta.abs().max().item(), outside


@contextmanager
def patched(model: PreTrainedModel, on: bool) -> Iterator[PreTrainedModel]:
    if on:
        hf.patch_model(model)
    try:
        yield model
    finally:
        if on:
            hf.unpatch_model(model)
