"""The training-inference mismatch of a GPU engine, on fixed tokens: where it comes from.

One set of responses is sampled once (bik-patched fp32, so the tokens are the same whatever is
measured); every configuration then computes the log-prob of those same tokens twice: as an
engine (the prompts prefilled, then one token a step over the KV cache, ``batch`` rows at a
time) and as a trainer (one forward of every finished sequence, all rows at once). Every
difference is therefore numerics, never sampling. Both sides take the log-prob through the
trainer's formula (``bik.token_logprobs``: fp32 log-softmax, then gather), so only the model's
forward differs. The configurations separate the causes an RL engine mixes:

- ``decode_b{1,8,64}_bf16``: a native bf16 engine at engine batch 1, 8 and 64 against the bf16
  trainer (decode vs prefill, and the batch the engine happened to run); batch 1 on the first
  8 rows and batch 8 on the first 16 (a step costs about the same at any batch);
- ``decode_b64_fp16`` / ``decode_b64_fp32``: the same in fp16 and fp32;
- ``decode_b64_bf16_head32``: the lm_head in fp32 on both sides (the hidden state cast up);
- ``decode_b64_bf16_topp``: the engine's log-probs renormalised over its top-p nucleus (what an
  engine's processed log-probs are) against the trainer's full softmax; with ``--top-p`` below
  1 the responses are sampled inside that nucleus;
- ``trainer_mb1_bf16``: the trainer alone, each row by itself against all rows (the batch
  effect without decode);
- ``bik_*``: bik on both sides, asserted exactly 0.

Per configuration: the share of unequal tokens, mean / p99 / max |delta| (delta = trainer
minus engine), the share of ratios exp(delta) outside [0.9, 1.1], the mean |sum of delta| over
a response (a sequence's log importance weight), and mean |delta| by the policy's entropy.
``--out`` gets gpu_anatomy.json and gpu_anatomy.md. On a CPU it runs too (``--device cpu``,
small settings: the rehearsal ``tests/tools/test_gpu_anatomy.py`` runs).

    python benchmarks/gpu_anatomy.py --device cuda --out DIR                  # SmolLM2, 64 x 512
    python benchmarks/gpu_anatomy.py --device cuda --top-p 0.9 --out DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import bik
from bik.testing import models, rollouts, sample_prompts
from bik.testing.arguments import positive_int

BAND = rollouts.BAND
TEMPERATURE = 1.0  # sampling and both sides' log-probs (the demo's own is 0.7)
ENTROPY_BIN = 0.5  # nats


@dataclass(frozen=True)
class Config:
    """One measured pair: an engine (decode at ``batch`` rows) or the trainer at micro-batch 1,
    against the trainer's one forward of all rows, in ``dtype``."""

    name: str
    dtype: str
    batch: int  # engine rows at a time; 1 with kind "trainer": each row alone
    kind: str = "decode"  # or "trainer"
    head32: bool = False
    renormalised: bool = False  # the engine's log-prob over its top-p nucleus
    bik: bool = False
    rows: int = 64  # the first rows only: a decode step at batch 1 costs what one at 64 does


CONFIGS = {
    c.name: c
    for c in (
        Config("decode_b1_bf16", "bf16", 1, rows=8),
        Config("decode_b8_bf16", "bf16", 8, rows=16),
        Config("decode_b64_bf16", "bf16", 64),
        Config("decode_b64_fp16", "fp16", 64),
        Config("decode_b64_fp32", "fp32", 64),
        Config("decode_b64_bf16_head32", "bf16", 64, head32=True),
        Config("decode_b64_bf16_topp", "bf16", 64, renormalised=True),
        Config("trainer_mb1_bf16", "bf16", 1, kind="trainer"),
        Config("bik_decode_b1_bf16", "bf16", 1, bik=True, rows=8),
        Config("bik_decode_b64_bf16", "bf16", 64, bik=True),
        Config("bik_decode_b64_fp32", "fp32", 64, bik=True),
    )
}


# -- the two sides -------------------------------------------------------------------------


def nucleus_log_mass(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """log of the probability mass of the top-p nucleus (the smallest set of most likely
    tokens whose mass reaches ``top_p``, as transformers' and vLLM's top-p filters keep it),
    per row of ``[..., V]``: what renormalising over it subtracts; 0 at ``top_p`` 1, where
    engines skip the filter (a float sum of the softmax may miss 1)."""
    if top_p >= 1:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    probs = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
    before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each
    return torch.log((probs * (before < top_p)).sum(-1))


def rows_of(rollout: rollouts.Rollout, rows: slice) -> rollouts.Rollout:
    return rollouts.Rollout(
        rollout.sequences[rows],
        rollout.mask[rows],
        rollout.response[rows],
        rollout.logprobs[rows],
        rollout.prompt_width,
    )


def engine_side(model: Any, rollout: rollouts.Rollout, config: Config, top_p: float) -> dict:
    """The engine's log-probs of the fixed tokens (``config.batch`` rows at a time), each
    renormalised over its top-p nucleus where the config says so, and the entropy at each."""
    blocks = []
    for start in range(0, rollout.sequences.shape[0], config.batch):
        part = rows_of(rollout, slice(start, start + config.batch))
        tokens = part.sequences[:, part.prompt_width :]
        logits = rollouts.decode_logits(model, part)
        # 64 positions at a time: the fp32 logits of 64 rows x 512 tokens are 6 GiB
        pieces = [
            token_measures(piece.float(), chosen, config.renormalised, top_p)
            for piece, chosen in zip(logits.split(64, 1), tokens.split(64, 1), strict=True)
        ]
        blocks.append({key: torch.cat([p[key] for p in pieces], 1) for key in pieces[0]})
    return {key: torch.cat([b[key] for b in blocks]) for key in blocks[0]}


def token_measures(
    logits: torch.Tensor, tokens: torch.Tensor, renormalised: bool, top_p: float
) -> dict:
    """The log-prob of each token (over the nucleus where ``renormalised``) and the entropy."""
    logp = bik.token_logprobs(logits, tokens, TEMPERATURE)
    if renormalised:
        logp = logp - nucleus_log_mass(logits, top_p)
    every = torch.log_softmax(logits, -1)
    return {"logp": logp, "entropy": -(every.exp() * every).sum(-1)}


def measure(
    directory: str, config: Config, rollout: rollouts.Rollout, args: argparse.Namespace
) -> dict:
    """One configuration's deltas (trainer minus the compared side) on its first
    ``config.rows`` rows, timed. The trainer's side is always one forward of every row."""
    start = time.perf_counter()
    model: Any = rollouts.load(directory, rollouts.DTYPES[config.dtype]).to(args.device)
    entropy = None
    measured = rows_of(rollout, slice(0, config.rows))
    with rollouts.fp32_head(model, config.head32), rollouts.patched(model, config.bik):
        reference = rollouts.score(model, rollout, temperature=TEMPERATURE)[: config.rows]
        if config.kind == "trainer":
            each_alone = list(range(measured.sequences.shape[0]))
            compared = rollouts.score(model, measured, each_alone, TEMPERATURE)
        else:
            engine = engine_side(model, measured, config, args.top_p)
            compared, entropy = engine["logp"], engine["entropy"].cpu()
    delta = reference.double().cpu() - compared.double().cpu()
    return {"delta": delta, "entropy": entropy, "seconds": time.perf_counter() - start}


def stats(name: str, delta: torch.Tensor, entropy: torch.Tensor | None, seconds: float) -> dict:
    size = delta.abs()
    ratio = delta.exp()
    row: dict[str, Any] = {
        "config": name,
        "tokens": delta.numel(),
        "unequal_share": (delta != 0).double().mean().item(),
        "mean_abs_delta": size.mean().item(),
        "p99_abs_delta": size.flatten().quantile(0.99).item(),
        "max_abs_delta": size.max().item(),
        "outside_band_share": ((ratio < BAND[0]) | (ratio > BAND[1])).double().mean().item(),
        "mean_abs_sum": delta.sum(-1).abs().mean().item(),
        "seconds": seconds,
        "by_entropy": [],
    }
    if entropy is not None:
        bins = (entropy.double().cpu() / ENTROPY_BIN).floor().flatten()
        for index in bins.unique().tolist():
            inside = bins == index
            row["by_entropy"].append(
                {
                    "low": index * ENTROPY_BIN,
                    "tokens": int(inside.sum()),
                    "mean_abs_delta": size.flatten()[inside].mean().item(),
                }
            )
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Device: {meta['device']}; torch {meta['torch']}; {meta['rows']} rows x "
        f"{meta['tokens']} tokens, top-p {meta['top_p']:g}, model {meta['model']}.",
        "",
        "| config | unequal | mean abs delta | p99 | max | ratio outside [0.9, 1.1] "
        "| mean abs sum over a response | s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {100 * r['unequal_share']:.1f} % | {r['mean_abs_delta']:.2e} "
            f"| {r['p99_abs_delta']:.2e} | {r['max_abs_delta']:.2e} "
            f"| {100 * r['outside_band_share']:.2f} % | {r['mean_abs_sum']:.3g} "
            f"| {r['seconds']:.0f} |"
        )
    lines += ["", "Mean abs delta by the policy's entropy at the token (nats; tokens):", ""]
    for r in rows:
        cells = [
            f"[{b['low']:g}, {b['low'] + ENTROPY_BIN:g}): {b['mean_abs_delta']:.2e} ({b['tokens']})"
            for b in r["by_entropy"]
        ]
        if cells:
            lines.append(f"- {r['config']}: " + "; ".join(cells))
    return "\n".join(lines) + "\n"


# -- main ----------------------------------------------------------------------------------


def prompts_of(directory: str, count: int, seed: int) -> tuple[list[torch.Tensor], int]:
    """Chat prompts through the tokenizer's template, or random ids for a model without one."""
    from transformers import AutoConfig, AutoTokenizer

    if Path(directory, "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(directory)
        texts = (rollouts.PROMPTS * count)[:count]
        return rollouts.chat_prompts(tokenizer, texts), tokenizer.pad_token_id
    config = AutoConfig.from_pretrained(directory)
    return [torch.tensor(p) for p in sample_prompts(seed, count, config.vocab_size)], 0


def sample_rollout(directory: str, args: argparse.Namespace) -> rollouts.Rollout:
    """The fixed tokens: sampled once by bik-patched fp32 ``generate`` (top-p ``--top-p``)."""
    prompts, pad = prompts_of(directory, args.prompts, args.seed)
    model: Any = rollouts.load(directory, torch.float32).to(args.device)
    with rollouts.patched(model, True):
        rows = prompts * args.samples
        return rollouts.sample(model, rows, args.tokens, args.seed, pad, TEMPERATURE, args.top_p)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="smollm2", help="a bik.testing.models name or a directory"
    )
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda"))
    parser.add_argument("--prompts", type=positive_int, default=16)
    parser.add_argument("--samples", type=positive_int, default=4, help="samples per prompt")
    parser.add_argument("--tokens", type=positive_int, default=512, help="tokens per response")
    parser.add_argument("--top-p", type=float, default=1.0, help="the engine's nucleus (1.0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p: expected a number in (0, 1], got {args.top_p:g}")
    directory = str(models.path(args.model) if args.model in models.MODELS else args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    rollout = sample_rollout(directory, args)
    device = (
        torch.cuda.get_device_name(args.device)
        if args.device.type == "cuda"
        else platform.processor()
    )
    meta = {
        "device": device or platform.machine(),
        "torch": torch.__version__,
        "model": args.model,
        "rows": rollout.sequences.shape[0],
        "tokens": args.tokens,
        "top_p": args.top_p,
        "seed": args.seed,
        "configs": [asdict(CONFIGS[name]) for name in args.configs],
    }
    rows = []
    for name in args.configs:
        print(f"gpu_anatomy: {name}", flush=True)
        result = measure(directory, CONFIGS[name], rollout, args)
        rows.append(stats(name, result["delta"], result["entropy"], result["seconds"]))
        report = {"meta": meta, "configs": rows}  # written after each, so a cut run keeps them
        (args.out / "gpu_anatomy.json").write_text(json.dumps(report, indent=1))
        (args.out / "gpu_anatomy.md").write_text(markdown(rows, meta))
    moved = [r["config"] for r in rows if CONFIGS[r["config"]].bik and r["unequal_share"]]
    print(markdown(rows, meta))
    if moved:
        print(f"gpu_anatomy: bik's configurations moved: {moved}")
    return 1 if moved else 0


if __name__ == "__main__":
    raise SystemExit(main())
