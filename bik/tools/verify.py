"""``python -m bik verify``: the invariance checks on a causal LM, unpatched and patched.

Checks (each compares token log-probs bit for bit):
  batch_1_vs_n      a sequence alone vs the same sequence in a left-padded batch of N
  needle            one prompt at random positions in random batches (several trials)
  decode_vs_prefill generate() with the KV cache vs one full forward of the finished batch
  chunked_prefill   the sequence fed in random chunks through the KV cache vs one forward
  left_padding      the sequence behind P pad tokens vs unpadded
On a mismatch the first module whose output differs (batch 1 vs batch N) is named.

``--engine vllm MODEL_DIR`` checks a vLLM engine instead: native vLLM and vLLM with bik
sample the same prompts, and each one's log-probs are compared with the bik-patched trainer's
(see :mod:`bik.tools.verify_vllm`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .. import hf
from ..contract import DTYPE_NAMES, TP_CHUNKS
from ..testing import PRESETS, load_model, models
from ..testing.arguments import positive_int
from ..testing.arguments import seed as seed_type
from ..testing.checks import CHECKS, first_divergent_module, run_checks
from .cli import UsageError, check_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def verify(
    model: PreTrainedModel,
    seed: int = 0,
    unpatched: bool = True,
    echo: Callable[[str], object] = print,
) -> bool:
    """Run every check patched and (optionally) unpatched; returns True if bik passes them all.

    The patched checks run first, so a model bik cannot patch raises before any check runs.
    """
    report = hf.patch_model(model)
    try:
        after = run_checks(model, seed)
        culprit = (
            None if all(ok for ok, _ in after.values()) else first_divergent_module(model, seed)
        )
    finally:
        hf.unpatch_model(model)
    before = run_checks(model, seed) if unpatched else None
    culprit_before = (
        first_divergent_module(model, seed)
        if before and not all(ok for ok, _ in before.values())
        else None
    )
    echo(str(report))
    echo("| check | plain torch | bik |\n|---|---|---|")
    for name in CHECKS:
        plain = _cell(*before[name]) if before else "-"
        echo(f"| {name} | {plain} | {_cell(*after[name])} |")
    if culprit_before:
        echo(f"plain torch: first module whose output depends on the batch: {culprit_before}")
    passed = all(ok for ok, _ in after.values())
    if not passed:
        echo(
            "bik: MISMATCH; first module whose output depends on the batch: "
            f"{culprit or 'none found'}"
        )
    return passed


def _cell(ok, diff):
    return "bit-identical" if ok else f"DIFFERS (max {diff:.2e})"


def model_name(text: str) -> str:
    """argparse type of ``--model``: 'all', a preset, a real model of
    :mod:`bik.testing.models`, or a directory holding a saved model of a family bik patches
    (read from its config.json; nothing is loaded)."""
    if text == "all" or text in PRESETS or text in models.MODELS:
        return text
    families = ", ".join(hf.SUPPORTED_FAMILIES)
    path = Path(text)
    if not text:
        problem = "got ''"
    elif not path.exists():
        problem = f"{text!r} does not exist"
    elif not path.is_dir():
        problem = f"{text!r} is a file, not a directory"
    elif not (path / "config.json").is_file():
        problem = f"{text!r} has no config.json (write one with model.save_pretrained(directory))"
    else:
        try:
            family = json.loads((path / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError) as error:
            problem = f"{str(path / 'config.json')!r} is not a readable model config ({error})"
        else:
            if family in hf.SUPPORTED_FAMILIES:
                return text
            what = (
                f"holds a {family!r} model"
                if isinstance(family, str)
                else "has a config.json without model_type"
            )
            raise argparse.ArgumentTypeError(
                f"{text!r} {what}; verify supports the {families} families"
            )
    raise argparse.ArgumentTypeError(  # the cause first: the list of choices is long
        f"{problem}; expected 'all', a preset ({', '.join(PRESETS)}), a real model "
        f"({', '.join(models.MODELS)}) or a directory holding a saved model of a supported "
        f"family ({families})"
    )


def unpatchable(model: PreTrainedModel) -> str | None:
    """Why bik cannot patch ``model`` (its family, or the modules it would leave unpatched),
    or None; the model is left as it was."""
    try:
        hf.patch_model(model)
    except ValueError:
        report = hf.patch_model(model, strict=False)  # what strict patching refused, as data
        hf.unpatch_model(model)
        families = ", ".join(hf.SUPPORTED_FAMILIES)
        if report.family not in hf.SUPPORTED_FAMILIES:
            return f"is a {report.family!r} model; verify supports the {families} families"
        if report.unpatched:
            return (
                f"({report.family}) has modules bik cannot make invariant: "
                f"{', '.join(report.unpatched)}; verify checks models bik patches completely"
            )
        raise
    hf.unpatch_model(model)
    return None


def _load(name, device, dtype, seed):
    """load_model for the command line: a model bik cannot load or patch is a bad --model."""
    try:
        model = load_model(name, device, dtype, seed)
    except (OSError, ValueError) as error:
        if name in PRESETS:
            raise
        raise UsageError("--model", f"cannot load {name!r}: {error}") from None
    problem = unpatchable(model)
    if problem:
        raise UsageError("--model", f"{name!r} {problem}")
    return model


ENGINES = ("hf", "vllm")
VLLM_DEFAULTS = {"prompts": 16, "tokens": 16}  # --engine vllm only
VLLM_ONLY = (*VLLM_DEFAULTS, "tp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=model_name,
        default=None,
        help=f"a preset ({', '.join(PRESETS)}), 'all' (default: every preset), a real model "
        f"({', '.join(models.MODELS)}: prepared on first use, see `python -m bik model`) or a "
        f"local directory holding a saved model of the {', '.join(hf.SUPPORTED_FAMILIES)} "
        "families",
    )
    parser.add_argument(
        "model_dir",
        nargs="?",
        type=model_name,
        metavar="MODEL",
        help="the same as --model (give one of the two)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="hf",
        help="hf (default): the checks on the Hugging Face model; vllm: native vLLM and vLLM "
        "with bik against the bik-patched trainer, on a local model directory",
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where it runs (default cpu)"
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPE_NAMES),
        default="float32",
        help="the model's dtype (default float32)",
    )
    parser.add_argument(
        "--seed", type=seed_type, default=0, help="the prompts' and samples' seed (default 0)"
    )
    parser.add_argument(
        "--prompts",
        type=positive_int,
        help=f"--engine vllm: prompts to sample (default {VLLM_DEFAULTS['prompts']}, "
        "2 samples each)",
    )
    parser.add_argument(
        "--tokens",
        type=positive_int,
        help=f"--engine vllm: tokens generated per sample (default {VLLM_DEFAULTS['tokens']})",
    )
    parser.add_argument(
        "--tp",
        type=positive_int,
        help="--engine vllm: both engines at this tensor-parallel degree (a power of two "
        f"dividing {TP_CHUNKS}), bik's and the trainer in the TP-invariant order",
    )
    parser.add_argument(
        "--skip-unpatched",
        action="store_true",
        help="do not run the checks on the unpatched model (with --engine vllm: native vLLM) first",
    )


def check(args: argparse.Namespace) -> None:
    """The device, one model, and what --engine vllm needs; ``--model`` was checked by
    argparse, and is checked again once loaded."""
    if args.model is not None and args.model_dir is not None and args.model != args.model_dir:
        raise UsageError("--model", f"got {args.model!r} and MODEL {args.model_dir!r}; give one")
    args.model = args.model or args.model_dir or "all"
    check_device(args.device)
    if args.engine == "hf":
        for option in VLLM_ONLY:
            if getattr(args, option) is not None:
                raise UsageError(f"--{option}", "applies to --engine vllm only")
        return
    from ..vllm import engine as vllm_engine

    problem = vllm_engine.vllm_problem()
    if problem:
        raise UsageError("--engine", problem)
    if args.model == "all" or args.model in PRESETS:
        raise UsageError(
            "--model",
            f"--engine vllm needs a real model ({', '.join(models.MODELS)}) or a local model "
            f"directory (write one with model.save_pretrained(directory)), got {args.model!r}",
        )
    if args.model in models.MODELS:
        try:
            args.model = str(models.path(args.model))
        except models.ModelUnavailableError as error:
            raise UsageError("--model", str(error)) from None
    if args.tp is not None and (args.tp & (args.tp - 1) or TP_CHUNKS % args.tp):
        raise UsageError("--tp", f"expected a power of two dividing {TP_CHUNKS}, got {args.tp}")
    problem = vllm_engine.model_problem(args.model, args.tp or 1)
    if problem:
        raise UsageError("--tp", problem)
    if args.tp is not None and args.device == "cpu":
        try:
            vllm_engine.cpu_binding(args.tp)
        except ValueError as error:
            raise UsageError("--tp", str(error)) from None
    for option, default in VLLM_DEFAULTS.items():
        if getattr(args, option) is None:
            setattr(args, option, default)


def main(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return _main_vllm(args)
    names = list(PRESETS) if args.model == "all" else [args.model]
    failed = []
    for name in names:
        model = _load(name, args.device, DTYPE_NAMES[args.dtype], args.seed)
        print(f"\n## {name} ({args.dtype}, {args.device})")
        if not verify(model, args.seed, unpatched=not args.skip_unpatched):
            failed.append(name)
    verdict = "FAILED: " + ", ".join(failed) if failed else "all checks bit-identical under bik"
    print(f"\nverify: {verdict}")
    return 1 if failed else 0


def _main_vllm(args: argparse.Namespace) -> int:
    from ..testing.vllm_compare import load_trainer
    from .verify_vllm import verify_vllm

    try:
        model = load_trainer(args.model, args.device, DTYPE_NAMES[args.dtype])
    except (OSError, ValueError) as error:
        raise UsageError("--model", f"cannot load {args.model!r}: {error}") from None
    problem = unpatchable(model)
    if problem:
        raise UsageError("--model", f"{args.model!r} {problem}")
    print(f"\n## {args.model} (vLLM, {args.dtype}, {args.device})")
    try:
        passed = verify_vllm(
            model,
            args.model,
            dtype=args.dtype,
            device=args.device,
            prompts=args.prompts,
            tokens=args.tokens,
            seed=args.seed,
            native=not args.skip_unpatched,
            tensor_parallel=args.tp,
        )
    except RuntimeError as error:  # an engine failed; its log's end is in the message
        print(f"\nverify: FAILED: {error}")
        return 1
    verdict = "vLLM with bik is bit-identical to the trainer" if passed else "FAILED"
    print(f"\nverify: {verdict}")
    return 0 if passed else 1
