"""The anatomy of the training-inference mismatch on a real model (no training).

Every rollout path samples the same chat prompts (``--prompts`` x ``--samples`` rows,
temperature 1, EOS suppressed so every row reaches ``--tokens`` tokens); the fp32 trainer,
bik-patched (one full forward of each finished sequence), scores the tokens each path
sampled. The rollout's log-prob of a token is the sampler's own: the logits it sampled that
token from, through the trainer's formula (``bik.token_logprobs``: fp32 log-softmax at the
temperature, then gather). For Hugging Face ``generate`` these are its raw logits (decode over
the KV cache, in the path's dtype); for vLLM the log-prob it returns (its raw log-softmax in
fp32; at temperature 1 the same formula). The trainer paths compare the plain trainer with
itself: the same sequences scored at micro-batch 1 against all rows in one forward.

Per token, ``delta = log p_trainer - log p_rollout`` (the log of the token's importance
ratio; for the trainer paths, micro-batch 1 minus the full batch): its size by position, by
the token's probability and by the policy's entropy (both from the fp32 reference), the share
of tokens whose ratio ``exp(delta)`` leaves [0.9, 1.1], and per sequence the cumulative sum
of ``delta`` as the response grows (the log of the sequence's importance weight). Beside them,
bik's paths (bik-patched ``generate``, bik inside vLLM, bik's trainer at micro-batch 1 vs all
rows) are asserted to be exactly 0 against bik's trainer in the same dtype.

Each path's tokens and log-probs are cached under ``--out``/cache (resumable path by path);
``--out`` gets anatomy.json, anatomy.md, anatomy_bins.csv and the plots. ``--policy`` takes
the weights from a policy an RL run kept (``python -m rl_harness run --keep-policies``): the
anatomy at a point of training.

    python benchmarks/mismatch_anatomy.py --out results/anatomy
    python benchmarks/mismatch_anatomy.py --policy RUN/policies/step19.pt --paths hf_bf16 ...
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bik import hf
from bik.testing import models, progress, rollouts, sample_prompts
from bik.testing.arguments import positive_int
from bik.testing.machine import cpu_model
from bik.vllm import engine as vllm_engine

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TEMPERATURE = 1.0
BAND = rollouts.BAND
MARKS = (128, 256, 512, 1024, 2048, 4096)  # response lengths the cumulative sums are read at
POSITION_BINS = 16  # bins over a response's length (64 tokens each at 1024)
PAPER_DRIFT = math.log(1.0047)  # the 0.47 % per-token biased drift of VeXact's worked example


@dataclass(frozen=True)
class Source:
    """One compared pair: what samples (or scores the sequences twice) and against what."""

    kind: str  # "hf": generate; "vllm": a vLLM engine; "trainer": micro-batch 1 vs all rows
    dtype: str  # fp32, bf16, fp16
    bik: bool  # bik on both sides (asserted 0) or plain / native against bik's fp32 trainer
    label: str


# In the order they run (a run cut short keeps the paths it finished; the trainer paths'
# sequences run first): vLLM, the trainer's batch effect, then Hugging Face generate.
PATHS = {
    "vllm_bf16": Source("vllm", "bf16", False, "vLLM bf16"),
    "vllm_fp32": Source("vllm", "fp32", False, "vLLM fp32"),
    "trainer_fp32": Source("trainer", "fp32", False, "trainer fp32, mb 1 vs all"),
    "trainer_bf16": Source("trainer", "bf16", False, "trainer bf16, mb 1 vs all"),
    "bik_trainer_fp32": Source("trainer", "fp32", True, "bik: trainer fp32, mb 1 vs all"),
    "hf_fp32": Source("hf", "fp32", False, "HF generate fp32"),
    "hf_bf16": Source("hf", "bf16", False, "HF generate bf16"),
    "bik_hf_fp32": Source("hf", "fp32", True, "bik: HF generate fp32"),
    "bik_hf_bf16": Source("hf", "bf16", True, "bik: HF generate bf16"),
    "hf_fp16": Source("hf", "fp16", False, "HF generate fp16"),
    "bik_vllm_fp32": Source("vllm", "fp32", True, "bik: vLLM fp32"),
    "bik_trainer_bf16": Source("trainer", "bf16", True, "bik: trainer bf16, mb 1 vs all"),
}
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass
class Setup:
    directory: str
    prompts: list[torch.Tensor]
    pad: int
    args: argparse.Namespace

    def rows(self) -> list[torch.Tensor]:
        return self.prompts * self.args.samples


# -- sampling and scoring ------------------------------------------------------------------


def reference(
    model: PreTrainedModel, rollout: rollouts.Rollout, micro: int
) -> dict[str, torch.Tensor]:
    """The trainer's log-probs of the sampled tokens and the policy's entropy at each (both
    ``[B, N]``, temperature 1), ``micro`` rows per forward; ``model`` as it is (patched or not)."""
    head = model.get_output_embeddings()
    assert head is not None
    entropies: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: Any, logits: torch.Tensor) -> None:
        # logits at column t predict token t + 1: the response's predictions start one earlier
        logp = torch.log_softmax(logits[:, rollout.prompt_width - 1 : -1].float() / TEMPERATURE, -1)
        entropies.append(-(logp.exp() * logp).sum(-1))

    handle = head.register_forward_hook(keep)
    logps = []
    try:
        with torch.no_grad():
            for start in range(0, rollout.sequences.shape[0], micro):
                part = slice(start, start + micro)
                out = hf.sequence_logprobs(
                    model,
                    rollout.sequences[part],
                    rollout.mask[part],
                    rollout.response[part],
                    TEMPERATURE,
                )
                logps.append(out[:, rollout.prompt_width :])
    finally:
        handle.remove()
    return {"logp": torch.cat(logps), "entropy": torch.cat(entropies)}


def vllm_rollout(setup: Setup, dtype: str, engine: str, tokens: int) -> rollouts.Rollout:
    """``--samples`` samples of every prompt from a vLLM engine ('native' or 'bik', in a
    process of its own), as a left-padded batch with vLLM's log-probs of the sampled tokens."""
    prompts = [p.tolist() for p in setup.prompts]
    result = vllm_engine.run_engine(
        engine,
        setup.directory,
        prompts,
        dtype=VLLM_DTYPES[dtype],
        engine_args={
            "max_model_len": max(map(len, prompts)) + tokens,
            "max_num_seqs": len(prompts) * setup.args.samples,
            "seed": setup.args.seed,
        },
        sampling={
            "n": setup.args.samples,
            "max_tokens": tokens,
            "min_tokens": tokens,
            "ignore_eos": True,
            "temperature": TEMPERATURE,
            "logprobs": 0,
        },
    )
    # the HF paths' row order: every prompt once, then every prompt again (sample j of prompt i
    # is row j * prompts + i)
    outputs = result["outputs"]
    samples = [outputs[i][j] for j in range(setup.args.samples) for i in range(len(prompts))]
    full = [torch.tensor(prompts[i % len(prompts)] + s["tokens"]) for i, s in enumerate(samples)]
    width = max(map(len, prompts))
    ids, mask = hf.left_pad(full, setup.pad)
    response = torch.zeros_like(mask)
    response[:, width:] = 1
    logprobs = torch.tensor([s["logprobs"] for s in samples], dtype=torch.float32)
    return rollouts.Rollout(ids, mask, response, logprobs, width)


def as_rollout(record: dict[str, Any]) -> rollouts.Rollout:
    return rollouts.Rollout(
        record["sequences"],
        record["mask"],
        record["response"],
        record["rollout"],
        record["prompt_width"],
    )


def run_path(name: str, setup: Setup, done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One path's record: its sequences, the compared log-probs (``rollout``: the path's;
    ``trainer``: what it is compared with) and the fp32 reference's entropy."""
    path, args = PATHS[name], setup.args
    dtype = rollouts.DTYPES[path.dtype]
    if path.kind == "trainer":
        sequences = done[args.trainer_sequences]
        rollout = as_rollout(sequences)
        model = rollouts.load(setup.directory, dtype)
        with rollouts.patched(model, path.bik):
            progress.note(f"{path.label}: all {rollout.sequences.shape[0]} rows in one forward")
            batch = rollouts.score(model, rollout, temperature=TEMPERATURE)
            progress.note(f"{path.label}: each row alone")
            alone = rollouts.score(model, rollout, list(range(len(batch))), TEMPERATURE)
        record = {"rollout": batch, "trainer": alone, "entropy": sequences["entropy"]}
        return {**record, "probability": sequences["reference"].exp()}
    tokens = args.bik_tokens if path.bik else args.hf_tokens if path.kind == "hf" else args.tokens
    progress.note(f"{path.label}: sampling {len(setup.rows())} x {tokens} tokens")
    if path.kind == "hf":
        model = rollouts.load(setup.directory, dtype)
        with rollouts.patched(model, path.bik):
            rollout = rollouts.sample(
                model, setup.rows(), tokens, args.seed, setup.pad, TEMPERATURE
            )
    else:
        rollout = vllm_rollout(setup, path.dtype, "bik" if path.bik else "native", tokens)
    fp32 = rollouts.load(setup.directory, torch.float32)
    progress.note("the fp32 trainer (bik) scores them")
    with rollouts.patched(fp32, True):
        ref = reference(fp32, rollout, args.micro)
    trainer = ref["logp"]
    if path.bik and dtype != torch.float32:  # bik against bik's trainer in the same dtype
        progress.note(f"bik's {path.dtype} trainer scores them")
        model = rollouts.load(setup.directory, dtype)
        with rollouts.patched(model, True):
            trainer = reference(model, rollout, args.micro)["logp"]
    return {
        "sequences": rollout.sequences,
        "mask": rollout.mask,
        "response": rollout.response,
        "prompt_width": rollout.prompt_width,
        "rollout": rollout.logprobs,
        "trainer": trainer,
        "reference": ref["logp"],
        "probability": ref["logp"].exp(),
        "entropy": ref["entropy"],
    }


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the vLLM engines)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def settings_of(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """What path ``name``'s record depends on (its cache is read back only with these)."""
    path = PATHS[name]
    keys = ["model", "policy", "prompts", "samples", "seed"]
    if path.kind == "trainer":
        keys.append("trainer_sequences")
    else:
        keys.append("bik_tokens" if path.bik else "hf_tokens" if path.kind == "hf" else "tokens")
    return {"temperature": TEMPERATURE, **{k: _plain(getattr(args, k)) for k in keys}}


def _plain(value: Any) -> Any:
    """A setting as the cache and anatomy.json store it (a path as its text)."""
    return str(value) if isinstance(value, Path) else value


def cached(name: str, setup: Setup, done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The path's record from the cache, or computed, timed and cached."""
    file = Path(setup.args.out, "cache", f"{name}.pt")
    settings = settings_of(setup.args, name)
    if file.exists():
        record = torch.load(file, weights_only=False)
        if record["settings"] != settings:
            raise ValueError(
                f"{file} was made with {record['settings']}, not {settings}: "
                "remove the cache folder or choose another --out"
            )
        progress.note(f"{name}: cached ({record['cpu_s']:.0f} s of CPU when made)")
        return record
    start, wall = cpu_seconds(), time.perf_counter()
    record = run_path(name, setup, done)
    record.update(settings=settings, cpu_s=cpu_seconds() - start, wall_s=time.perf_counter() - wall)
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(record, file)
    return record


# -- analysis ------------------------------------------------------------------------------


def deltas(record: dict[str, Any]) -> torch.Tensor:
    """``log p_trainer - log p_rollout`` per token, float64 ``[B, N]``."""
    return record["trainer"].double() - record["rollout"].double()


def outside(delta: torch.Tensor) -> torch.Tensor:
    ratio = delta.exp()
    return (ratio < BAND[0]) | (ratio > BAND[1])


def summary(name: str, record: dict[str, Any]) -> dict[str, Any]:
    delta = deltas(record)
    cumulative = delta.cumsum(-1)
    size = delta.abs()
    row: dict[str, Any] = {
        "path": name,
        "label": PATHS[name].label,
        "tokens": delta.numel(),
        "length": delta.shape[1],
        "sequences": delta.shape[0],
        "unequal_share": (delta != 0).double().mean().item(),
        "mean_abs_delta": size.mean().item(),
        "p99_abs_delta": size.flatten().quantile(0.99).item(),
        "max_abs_delta": size.max().item(),
        "outside_band_share": outside(delta).double().mean().item(),
        "mean_delta": delta.mean().item(),
        "cpu_s": record["cpu_s"],
        "wall_s": record["wall_s"],
    }
    row["abs_cumsum_end_mean"] = cumulative[:, -1].abs().mean().item()
    row["abs_cumsum_end_max"] = cumulative[:, -1].abs().max().item()
    for mark in MARKS:
        if mark <= delta.shape[1]:
            at = cumulative[:, mark - 1].abs()
            row[f"abs_cumsum_{mark}_mean"] = at.mean().item()
            row[f"abs_cumsum_{mark}_max"] = at.max().item()
    return row


def bins(record: dict[str, Any], axis: str) -> list[dict[str, Any]]:
    """Mean |delta| and the share outside the band per bin of position (1/16 of the length), token
    probability (decades) or entropy (0.5 nats)."""
    delta = deltas(record).flatten()
    length = record["rollout"].shape[1]
    edges: list[float]
    if axis == "position":
        value = torch.arange(length, dtype=torch.float64).repeat(record["rollout"].shape[0])
        width = max(1, length // POSITION_BINS)
        edges = [float(e) for e in range(0, length + width, width)]
    elif axis == "probability":
        value = record["probability"].double().flatten()
        edges = [10.0**k for k in range(-8, 1)]
        edges[0] = 0.0
    else:
        value = record["entropy"].double().flatten()
        top = math.ceil(2 * value.max().item()) / 2 + 0.5
        edges = [k / 2 for k in range(int(2 * top) + 1)]
    rows = []
    for low, high in itertools.pairwise(edges):
        inside = (value >= low) & ((value < high) if high < edges[-1] else (value <= high))
        count = int(inside.sum())
        if count:
            part = delta[inside]
            rows.append(
                {
                    "axis": axis,
                    "low": low,
                    "high": high,
                    "tokens": count,
                    "mean_abs_delta": part.abs().mean().item(),
                    "outside_band_share": outside(part).double().mean().item(),
                }
            )
    return rows


# -- report --------------------------------------------------------------------------------


def display_key(path: Source) -> tuple[bool, int, int]:
    return (
        path.bik,
        ["hf", "vllm", "trainer"].index(path.kind),
        list(rollouts.DTYPES).index(path.dtype),
    )


def markdown(rows: list[dict[str, Any]], machine: str) -> str:
    longest = max(r["length"] for r in rows)
    marks = [m for m in MARKS if m <= longest]
    head = (
        "| path | rows x tokens | unequal | mean abs delta | p99 | max "
        + f"| mean delta | ratio outside {list(BAND)} | "
        + "".join(f"abs cumsum at {m}: mean (max) | " for m in marks)
        + "abs cumsum at the end: mean (max) | CPU s |"
    )
    lines = [f"Machine: {machine}.", "", head, "|---|" + "---:|" * (9 + len(marks))]
    for r in rows:
        sums = [
            f"{r[f'abs_cumsum_{m}_mean']:.3g} ({r[f'abs_cumsum_{m}_max']:.3g})"
            if f"abs_cumsum_{m}_mean" in r
            else "-"
            for m in marks
        ]
        lines.append(
            f"| {r['label']} | {r['sequences']} x {r['length']} | "
            f"{100 * r['unequal_share']:.1f} % | {r['mean_abs_delta']:.2e} | "
            f"{r['p99_abs_delta']:.2e} | {r['max_abs_delta']:.2e} | {r['mean_delta']:.2e} | "
            f"{100 * r['outside_band_share']:.2f} % | "
            + "".join(f"{c} | " for c in sums)
            + f"{r['abs_cumsum_end_mean']:.3g} ({r['abs_cumsum_end_max']:.3g}) | "
            + f"{r['cpu_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: dict[str, dict[str, Any]], curves: list[dict[str, Any]], out: Path) -> None:
    """anatomy_profile.png (|delta| and the band share by position, probability, entropy) and
    anatomy_cumulative.png (per-sequence cumulative sums, one panel per path)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from rl_harness.report import STYLES, plain_ticks

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    shown = [n for n in records if not PATHS[n].bik]
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    titles = {
        "position": "response position (token)",
        "probability": "token probability under the fp32 policy",
        "entropy": "policy entropy at the token (nats)",
    }
    for column, (axis, xlabel) in enumerate(titles.items()):
        for row, (key, ylabel) in enumerate(
            (("mean_abs_delta", "mean |delta log p|"), ("outside_band_share", "share outside"))
        ):
            ax = axes[row, column]
            for index, name in enumerate(shown):
                points = [c for c in curves if c["path"] == name and c["axis"] == axis]
                x = [
                    (c["low"] + c["high"]) / 2
                    if axis != "probability"
                    else math.sqrt(max(c["low"], 1e-9) * c["high"])
                    for c in points
                ]
                style, marker = STYLES[index % len(STYLES)]
                values = [c[key] for c in points]
                if key == "mean_abs_delta":  # a log axis: bins without a difference are left out
                    values = [v if v > 0 else math.nan for v in values]
                ax.plot(
                    x,
                    values,
                    linestyle=style,
                    marker=marker,
                    markersize=4,
                    fillstyle="none",
                    label=PATHS[name].label,
                )
            sizes = [c[key] for c in curves if c["axis"] == axis and c[key] > 0]
            if key == "mean_abs_delta" and max(sizes, default=1) > 10 * min(sizes, default=1):
                ax.set_yscale("log")  # only where the sizes span decades: else no tick labels
            ax.set_xscale("log" if axis != "entropy" else "linear")  # positions: 1 to 1024
            if axis == "position":
                ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            for scale in (ax.xaxis, ax.yaxis):  # plain numbers, no minor-tick labels
                scale.set_major_formatter(plain)
                scale.set_minor_formatter(NullFormatter())
            ax.set_xlabel(xlabel, fontsize=9)
            ax.set_ylabel(
                ylabel if key == "mean_abs_delta" else f"share of ratios outside {list(BAND)}",
                fontsize=9,
            )
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    title = (
        "Per-token |log p_trainer - log p_rollout| on SmolLM2-135M-Instruct, against the fp32 bik "
        "trainer (bik's own paths: exactly 0, see anatomy.md)"
    )
    save(fig, title, out / "anatomy_profile.png")

    if not shown:  # bik's paths alone: every sum is 0
        return
    columns = min(3, len(shown))
    rows = math.ceil(len(shown) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.8 * rows + 0.6), squeeze=False)
    for ax, name in zip(axes.flat, shown):
        cumulative = deltas(records[name]).cumsum(-1)
        steps = range(1, cumulative.shape[1] + 1)
        for row in cumulative:
            ax.plot(steps, row.tolist(), linewidth=0.8)
        biggest = max(cumulative.abs().max().item(), 1e-12)
        drift = [PAPER_DRIFT * s for s in steps]
        if PAPER_DRIFT * len(steps) < 20 * biggest:  # only where it does not flatten the rest
            ax.plot(  # a reference, not a measurement: grey, dotted and named as such
                steps,
                drift,
                ":",
                color="grey",
                linewidth=1.2,
                label="reference, not measured: VeXact's\nillustrative drift, 0.47 % a token",
            )
            ax.legend(fontsize=7)
        ax.set_title(PATHS[name].label, fontsize=9)
        ax.set_xlabel("response length (tokens)", fontsize=8)
        ax.set_ylabel("sum of log-ratios so far", fontsize=8)
        plain_ticks(ax)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(shown) :]:
        ax.set_visible(False)
    title = (
        "Per-sequence sum of (log p_trainer - log p_rollout) as the response grows\n"
        "(the log of the sequence's importance weight; one line per sequence)"
    )
    save(fig, title, out / "anatomy_cumulative.png")


def save(fig: Any, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # a wide title stays whole on one panel
    plt.close(fig)


# -- main ----------------------------------------------------------------------------------


def with_policy(directory: str, policy: Path, out: Path) -> Path:
    """A model directory at ``out``: ``directory``'s model and tokenizer with the weights of a
    policy an RL run kept (``rl_harness run --keep-policies``: {"step", "master"}), so that
    every path, vLLM's included, loads the trained policy. Written once per policy file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stamp = out / "policy.txt"  # which policy the directory holds
    if stamp.exists():
        if stamp.read_text() == str(policy.resolve()):
            return out
        raise SystemExit(f"--policy: {out} holds {stamp.read_text()}; choose another --out")
    try:
        state = torch.load(policy, weights_only=True)["master"]
    except (OSError, KeyError, RuntimeError) as error:
        raise SystemExit(f"--policy: cannot read a kept policy from {policy} ({error})") from None
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.load_state_dict(state)  # strict: a policy of another model stops here
    model.save_pretrained(out)
    if Path(directory, "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(directory).save_pretrained(out)
    stamp.write_text(str(policy.resolve()))
    return out


def build_setup(args: argparse.Namespace) -> Setup:
    """The model directory and the prompts: chat prompts through the tokenizer's template,
    or random token ids where the directory has no tokenizer (a tiny test model)."""
    from transformers import AutoConfig, AutoTokenizer

    directory = str(models.path(args.model) if args.model in models.MODELS else args.model)
    if args.policy is not None:
        directory = str(with_policy(directory, args.policy, args.out / "policy_model"))
    if Path(directory, "tokenizer_config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(directory)
        texts = (rollouts.PROMPTS * args.prompts)[: args.prompts]
        return Setup(
            directory, rollouts.chat_prompts(tokenizer, texts), tokenizer.pad_token_id, args
        )
    config = AutoConfig.from_pretrained(directory)
    prompts = [torch.tensor(p) for p in sample_prompts(args.seed, args.prompts, config.vocab_size)]
    return Setup(directory, prompts, config.pad_token_id or 0, args)


def machine() -> str:
    return f"{cpu_model()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="smollm2", help="a bik.testing.models name or a directory"
    )
    parser.add_argument("--prompts", type=positive_int, default=4)
    parser.add_argument("--samples", type=positive_int, default=2, help="samples per prompt")
    parser.add_argument(
        "--tokens", type=positive_int, default=1024, help="tokens per response (vLLM; 1024)"
    )
    parser.add_argument(
        "--hf-tokens", type=positive_int, help="tokens per response of HF generate (--tokens)"
    )
    parser.add_argument(
        "--bik-tokens",
        type=positive_int,
        default=128,
        help="tokens per response on bik's sampling paths (asserted 0; 128)",
    )
    parser.add_argument(
        "--trainer-sequences",
        choices=["vllm_fp32", "hf_fp32"],
        default="vllm_fp32",
        help="the fp32 samples the trainer paths score (vllm_fp32; hf_fp32 without vLLM)",
    )
    parser.add_argument("--micro", type=positive_int, default=2, help="rows per bik forward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    parser.add_argument("--out", type=Path, default=Path("results/anatomy"))
    parser.add_argument(
        "--policy",
        type=Path,
        help="a policy an RL run kept (DIR/policies/step<k>.pt, run --keep-policies): its weights "
        "in --model's architecture, the anatomy along training",
    )
    args = parser.parse_args(argv)
    args.hf_tokens = args.hf_tokens or args.tokens
    wanted = [n for n in PATHS if n in args.paths]
    if vllm_engine.vllm_problem() and any(PATHS[n].kind == "vllm" for n in wanted):
        print("vLLM is not installed: its paths are left out", file=sys.stderr)
        wanted = [n for n in wanted if PATHS[n].kind != "vllm"]
        args.trainer_sequences = "hf_fp32"
    if any(PATHS[n].kind == "trainer" for n in wanted):  # they score these sequences
        wanted = [args.trainer_sequences, *(n for n in wanted if n != args.trainer_sequences)]
    setup = build_setup(args)
    steps = progress.Steps(len(wanted))
    records: dict[str, dict[str, Any]] = {}
    for name in wanted:
        with steps.step(f"{name}: {PATHS[name].label}"):
            records[name] = cached(name, setup, records)
    # shown: the plain paths, then bik's; Hugging Face, vLLM, the trainer; fp32, bf16, fp16
    records = dict(sorted(records.items(), key=lambda item: display_key(PATHS[item[0]])))
    rows = [summary(n, r) for n, r in records.items()]
    curves = [
        c
        for n, r in records.items()
        for axis in ("position", "probability", "entropy")
        for c in ({"path": n, **b} for b in bins(r, axis))
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, machine())
    (args.out / "anatomy.md").write_text(text)
    (args.out / "anatomy.json").write_text(
        json.dumps(
            {
                "settings": {k: _plain(v) for k, v in vars(args).items()},
                "machine": machine(),
                "paths": rows,
            },
            indent=1,
        )
        + "\n"
    )
    with (args.out / "anatomy_bins.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(curves[0]))
        writer.writeheader()
        writer.writerows(curves)
    plot(records, curves, args.out)
    print("\n" + text)
    nonzero = [r["label"] for r in rows if PATHS[r["path"]].bik and r["unequal_share"] != 0]
    if nonzero:
        print(f"bik differs on: {', '.join(nonzero)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
