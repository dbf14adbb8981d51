"""bik against the cheap fixes for training-inference mismatch, on the same sampled tokens.

One set of chat answers is sampled once (SmolLM2-135M-Instruct by default, plain fp32), then
every setup computes the log-probs of exactly those tokens twice, as an RL loop does: the
rollout's way (prefill, then one token at a time over the KV cache, as the engine that sampled
them) and the trainer's way (one forward of the finished, left-padded batch). The setups:

- ``plain bf16``: torch as shipped, bf16 on both sides (the baseline a user starts from);
- ``plain fp16``: both sides in fp16 (the "FP16 fixes it" remedy);
- ``plain bf16, fp32 LM head``: the last projection in fp32 on both sides (TRL's
  ``cast_lm_head_to_fp32``);
- ``plain bf16 + token IS``: the baseline's numbers, reweighted by TRL-style truncated token
  importance sampling (cap 2): the mismatch stays, the update is corrected for it;
- ``bik bf16`` and ``bik fp32``: bik's kernels on both sides.

Per setup: the share of tokens whose two log-probs differ, the share whose ratio leaves
[0.9, 1.1] (what a token-level remedy acts on), the largest |difference|, the share PPO's clip
range [0.8, 1.2] would clip at the first update (where the policy has not moved yet), and the
time of both passes against plain bf16's, measured in the same run.

    python benchmarks/cheap_fixes.py --markdown benchmarks/results/cpu-<name>-cheap-fixes-<date>.md
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bik import testing
from bik.testing import models, rollouts

PPO_CLIP = (0.8, 1.2)  # PPO's default clip range (epsilon 0.2)
IS_CAP = 2.0  # truncated token importance sampling's cap (TRL's default)
SETUPS = {  # name -> (dtype, fp32 LM head, bik on both sides)
    "plain bf16": (torch.bfloat16, False, False),
    "plain fp16": (torch.float16, False, False),
    "plain bf16, fp32 LM head": (torch.bfloat16, True, False),
    "bik bf16": (torch.bfloat16, False, True),
    "bik fp32": (torch.float32, False, True),
}
IS_ROW = "plain bf16 + token IS (cap 2)"
REPEATS = 2  # both passes of a setup are timed this often; the fastest counts


def measure(rollout_logp: torch.Tensor, train_logp: torch.Tensor) -> dict[str, float]:
    delta = (train_logp.double() - rollout_logp.double()).flatten()
    ratio = delta.exp()
    return {
        "unequal": float((delta != 0).double().mean()),
        "outside_band": float(
            ((ratio < rollouts.BAND[0]) | (ratio > rollouts.BAND[1])).double().mean()
        ),
        "max_abs": float(delta.abs().max()),
        "ppo_clipped": float(((ratio < PPO_CLIP[0]) | (ratio > PPO_CLIP[1])).double().mean()),
        "is_truncated": float((ratio > IS_CAP).double().mean()),
    }


def run(model_name: str, rows: int, tokens: int, seed: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    fp32 = testing.load_model(model_name)
    if model_name in testing.PRESETS:  # a tiny preset: random token prompts, no tokenizer
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(3, 256, (n,), generator=gen) for n in range(4, 4 + rows)]
        pad = 0
    else:
        tokenizer = AutoTokenizer.from_pretrained(models.path(model_name))
        texts = (rollouts.PROMPTS * rows)[:rows]
        prompts, pad = rollouts.chat_prompts(tokenizer, texts), tokenizer.pad_token_id
    rollout = rollouts.sample(fp32, prompts, tokens, seed, pad)  # the tokens every setup scores
    results: dict[str, Any] = {}
    for name, (dtype, head32, patched) in SETUPS.items():
        model = testing.load_model(model_name, dtype=dtype)
        with rollouts.fp32_head(model, head32), rollouts.patched(model, patched):
            seconds = math.inf
            for _ in range(REPEATS):  # the fastest of the repeats: one-time costs drop out
                start = time.perf_counter()
                rollout_logp = rollouts.decode_logprobs(model, rollout)
                train_logp = rollouts.score(model, rollout)
                seconds = min(seconds, time.perf_counter() - start)
        results[name] = {**measure(rollout_logp, train_logp), "seconds": seconds}
        print(f"  {name}: {results[name]}", file=sys.stderr, flush=True)
    # token IS leaves the log-probs as they were; it reweights (and truncates) the update
    results[IS_ROW] = {**results["plain bf16"], "corrected": True}
    return {
        "model": model_name,
        "rows": rows,
        "tokens": tokens,
        "machine": demo_machine(),
        "results": results,
    }


def demo_machine() -> str:
    from bik.testing.machine import device_name

    load = os.getloadavg()[0]
    return f"{device_name(torch.device('cpu'))}, {platform.system()}, load {load:.2f}"


def markdown(record: dict[str, Any]) -> str:
    base = record["results"]["plain bf16"]["seconds"]
    lines = [
        f"{record['model']}, {record['rows']} answers x {record['tokens']} sampled tokens, "
        f"scored by each setup both ways (KV-cache decode vs one forward); "
        f"{record['machine']}; torch {torch.__version__}.",
        "",
        "| setup | tokens unequal | ratio outside [0.9, 1.1] | max abs diff | PPO clips at the "
        "first update | IS weights truncated | time (plain bf16 = 1) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in record["results"].items():
        truncated = f"{100 * r['is_truncated']:.1f} %" if r.get("corrected") else "-"
        lines.append(
            f"| {name} | {100 * r['unequal']:.1f} % | {100 * r['outside_band']:.1f} % | "
            f"{r['max_abs']:.2g} | {100 * r['ppo_clipped']:.1f} % | {truncated} | "
            f"{r['seconds'] / base:.2f}x |"
        )
    lines += [
        "",
        "Token IS keeps the baseline's mismatch and corrects the update for it (its weights "
        "differ from 1 wherever the log-probs do); the other fixes change the numerics. Only "
        "bik makes both ways of computing a token's log-prob the same bits.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 or a tiny preset")
    parser.add_argument("--rows", type=int, default=8, help="answers sampled (8)")
    parser.add_argument("--tokens", type=int, default=24, help="tokens per answer (24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args(argv)
    text = markdown(run(args.model, args.rows, args.tokens, args.seed))
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
