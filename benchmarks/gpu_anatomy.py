"""The training-inference mismatch of a GPU engine, on fixed tokens: where it comes from.

One set of responses is sampled once (bik-patched fp32, so the tokens are the same whatever is
measured); every configuration then computes the log-prob of those same tokens twice: as an
engine (the prompts prefilled, then one token a step over the KV cache, ``batch`` rows at a
time) and as a trainer (one forward of every finished sequence, all rows at once). Every
difference is therefore numerics, never sampling. Both sides take the log-prob through the
trainer's formula (``bik.token_logprobs``: fp32 log-softmax, then gather), so only the model's
forward differs. The configurations separate the causes an RL engine mixes:

- ``decode_b{1,8,64}_bf16``: a native bf16 engine at engine batch 1, 8 and 64 against the bf16
  trainer (decode vs prefill, and the batch the engine happened to run);
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
from typing import TYPE_CHECKING, Any

import torch

import bik
from bik import hf, models
from bik.hf.logprobs import generation_position_ids
from bik.testing import sample_prompts
from bik.tools import demo
from bik.tools.cli import positive_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel

BAND = demo.BAND
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


CONFIGS = {
    c.name: c
    for c in (
        Config("decode_b1_bf16", "bf16", 1),
        Config("decode_b8_bf16", "bf16", 8),
        Config("decode_b64_bf16", "bf16", 64),
        Config("decode_b64_fp16", "fp16", 64),
        Config("decode_b64_fp32", "fp32", 64),
        Config("decode_b64_bf16_head32", "bf16", 64, head32=True),
        Config("decode_b64_bf16_topp", "bf16", 64, renormalised=True),
        Config("trainer_mb1_bf16", "bf16", 1, kind="trainer"),
        Config("bik_decode_b1_bf16", "bf16", 1, bik=True),
        Config("bik_decode_b64_bf16", "bf16", 64, bik=True),
        Config("bik_decode_b64_fp32", "fp32", 64, bik=True),
    )
}


@dataclass
class Batch:
    """The left-padded prompts and the fixed responses, on the device."""

    prompts: torch.Tensor  # [B, P]
    mask: torch.Tensor  # [B, P]: 1 on prompt tokens
    responses: torch.Tensor  # [B, N]


class Fp32Head(torch.nn.Module):
    """An lm_head that computes in fp32: the hidden state and the weight cast up."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), self.weight.float())


# -- the two sides -------------------------------------------------------------------------


def nucleus_log_mass(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """log of the probability mass of the top-p nucleus (the smallest set of most likely
    tokens whose mass reaches ``top_p``), per row: what renormalising over it subtracts; 0 at
    ``top_p`` 1, where engines skip the filter (a float sum of the softmax may miss 1)."""
    if top_p >= 1:
        return logits.new_zeros(logits.shape[0], dtype=torch.float32)
    probs = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
    before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each
    return torch.log((probs * (before < top_p)).sum(-1))


def in_nucleus(logits: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row sampled at temperature 1 inside the top-p nucleus."""
    probs = torch.softmax(logits.float(), -1)
    ranked, order = probs.sort(-1, descending=True)
    ranked = ranked * ((ranked.cumsum(-1) - ranked) < top_p)
    pick = torch.multinomial(ranked, 1, generator=generator)
    return order.gather(-1, pick)[:, 0]


def decode(
    model: PreTrainedModel,
    batch: Batch,
    steps: int,
    top_p: float,
    sample_seed: int | None = None,
) -> dict[str, torch.Tensor]:
    """An engine's pass: the prompts prefilled, then one token a step over the KV cache. With
    ``sample_seed`` the tokens are sampled (top-p, temperature 1); otherwise ``batch``'s
    responses are fed. Returns the tokens, their log-probs, the nucleus's log mass and the
    entropy at each step (``[B, steps]``)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    mask = batch.mask
    position = generation_position_ids(mask)
    generator = None
    if sample_seed is not None:
        generator = torch.Generator(device=mask.device).manual_seed(sample_seed)
    columns: dict[str, list[torch.Tensor]] = {
        "tokens": [],
        "logp": [],
        "log_mass": [],
        "entropy": [],
    }
    ids = batch.prompts
    with torch.no_grad():
        for step in range(steps):
            out = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position,
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1].float()
            if generator is not None:
                token = in_nucleus(logits, top_p, generator)
            else:
                token = batch.responses[:, step]
            logp = torch.log_softmax(logits, -1)
            columns["tokens"].append(token)
            columns["logp"].append(bik.token_logprobs(logits[:, None], token[:, None])[:, 0])
            columns["log_mass"].append(nucleus_log_mass(logits, top_p))
            columns["entropy"].append(-(logp.exp() * logp).sum(-1))
            ids = token[:, None]
            mask = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), 1)
            position = position[:, -1:] + 1
    return {key: torch.stack(values, 1) for key, values in columns.items()}


def engine_side(model: PreTrainedModel, batch: Batch, config: Config, top_p: float) -> dict:
    """The engine's log-probs of the fixed responses, ``config.batch`` rows at a time."""
    parts = []
    for start in range(0, batch.prompts.shape[0], config.batch):
        rows = slice(start, start + config.batch)
        part = Batch(batch.prompts[rows], batch.mask[rows], batch.responses[rows])
        parts.append(decode(model, part, batch.responses.shape[1], top_p))
    out = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    if config.renormalised:
        out["logp"] = out["logp"] - out["log_mass"]
    return out


def trainer_side(model: PreTrainedModel, batch: Batch, rows_alone: bool) -> torch.Tensor:
    """The trainer's log-probs of the responses: one forward of all rows, or each row alone
    (cut to its own length, no padding)."""
    sequences = torch.cat((batch.prompts, batch.responses), 1)
    mask = torch.cat((batch.mask, torch.ones_like(batch.responses)), 1)
    response = torch.cat((torch.zeros_like(batch.mask), torch.ones_like(batch.responses)), 1)
    width = batch.prompts.shape[1]
    with torch.no_grad():
        if not rows_alone:
            return hf.sequence_logprobs(model, sequences, mask, response)[:, width:]
        scored = []
        for row in range(sequences.shape[0]):
            start = int(mask[row].argmax())
            seq, resp = sequences[row : row + 1, start:], response[row : row + 1, start:]
            scored.append(
                hf.sequence_logprobs(model, seq, torch.ones_like(seq), resp)[0, width - start :]
            )
        return torch.stack(scored)


# -- measuring -----------------------------------------------------------------------------


def load(directory: str, dtype: str, device: torch.device, head32: bool = False) -> Any:
    """The model in ``dtype`` on ``device`` (its lm_head in fp32 with ``head32``)."""
    model: Any = demo.load(directory, demo.DTYPES[dtype])
    if head32:
        model.set_output_embeddings(Fp32Head(model.get_output_embeddings().weight))
    return model.to(device)


def measure(directory: str, config: Config, batch: Batch, args: argparse.Namespace) -> dict:
    """One configuration's deltas, timed."""
    start = time.perf_counter()
    model = load(directory, config.dtype, args.device, config.head32)
    with demo.patched(model, config.bik):
        reference = trainer_side(model, batch, rows_alone=False)
        if config.kind == "trainer":
            compared = trainer_side(model, batch, rows_alone=True)
            entropy = None
        else:
            engine = engine_side(model, batch, config, args.top_p)
            compared, entropy = engine["logp"], engine["entropy"]
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
        texts = (demo.PROMPTS * count)[:count]
        return demo.chat_prompts(tokenizer, texts), tokenizer.pad_token_id
    config = AutoConfig.from_pretrained(directory)
    return [torch.tensor(p) for p in sample_prompts(seed, count, config.vocab_size)], 0


def sample_batch(directory: str, args: argparse.Namespace) -> Batch:
    """The fixed responses: sampled once by bik-patched fp32 decode, all rows at once."""
    prompts, pad = prompts_of(directory, args.prompts, args.seed)
    ids, mask = hf.left_pad(prompts * args.samples, pad)
    batch = Batch(ids.to(args.device), mask.to(args.device), ids.new_zeros(0, 0))
    model = load(directory, "fp32", args.device)
    with demo.patched(model, True):
        sampled = decode(model, batch, args.tokens, args.top_p, sample_seed=args.seed)
    batch.responses = sampled["tokens"]
    return batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a bik.models name or a directory")
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
    batch = sample_batch(directory, args)
    device = (
        torch.cuda.get_device_name(args.device)
        if args.device.type == "cuda"
        else platform.processor()
    )
    meta = {
        "device": device or platform.machine(),
        "torch": torch.__version__,
        "model": args.model,
        "rows": batch.prompts.shape[0],
        "tokens": args.tokens,
        "top_p": args.top_p,
        "seed": args.seed,
        "configs": [asdict(CONFIGS[name]) for name in args.configs],
    }
    rows = []
    for name in args.configs:
        print(f"gpu_anatomy: {name}", flush=True)
        result = measure(directory, CONFIGS[name], batch, args)
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
