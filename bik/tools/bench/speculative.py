"""``python -m bik bench --vllm --speculative K``: generated tokens/s of bik's vLLM engine with
n-gram speculation (K draft tokens a step, prompt lookup of 1 to 3 tokens) against the same
engine without it, on a task whose answers repeat their prompt and on one whose answers do
not, greedy, each engine in a process of its own (:mod:`bik.vllm.engine`).

Both engines must return the same tokens and log-probs, bit for bit (bik's verify forward
gives each draft position a decode step's bits; a difference raises). ``ratio = plain ms /
speculative ms``: above 1 speculation pays. ``kept`` is the share of generated tokens that
were drafts the engine kept; where few are kept (the open task) the ratio is the price of
scoring drafts that are then thrown away. Greedy, so that the two engines' bits can be
compared (sampled, speculation draws other random numbers and so other tokens).
"""

import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ...testing import sample_prompts
from ...vllm import engine as vllm_engine
from .vllm_throughput import MODEL, QUICK_MODEL, describe, result, save_model, time_engine

OP = "vllm_speculative"
DEFAULTS = {"prompts": 8, "tokens": 96, "runs": 3}
QUICK = {"prompts": 2, "tokens": 24, "runs": 1}
LOOKUP = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}

# The repetitive task: a list, then a cue to write it again (a copy the n-gram drafts find
# in the prompt); the open task: a prompt whose continuation repeats nothing of it.
COPY_TEXTS = [
    "Inventory: {items}.\nThe same inventory, written again: ",
    "Shopping list: {items}.\nRepeat the shopping list exactly: ",
]
OPEN_TEXTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in a few paragraphs why the sky is blue and sunsets are red.",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
ITEMS = "apples, copper wire, seven candles, a blue kettle, twine, two maps, salt, a lantern"


def task_prompts(model_dir: str, count: int, seed: int) -> dict[str, list[list[int]]]:
    """``count`` prompts of each task as token ids: text through the model's tokenizer where
    it has one, else (a random-init model) a random 12-token segment written 3 times
    against random tokens."""
    from transformers import AutoConfig, AutoTokenizer

    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        generator = torch.Generator().manual_seed(seed)
        segments = [torch.randint(3, vocab, (12,), generator=generator) for _ in range(count)]
        return {
            "copy": [segment.repeat(3).tolist() for segment in segments],
            "open": [list(p) for p in sample_prompts(seed, count, vocab)],
        }
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = {
        "copy": [COPY_TEXTS[i % len(COPY_TEXTS)].format(items=ITEMS) for i in range(count)],
        "open": [OPEN_TEXTS[i % len(OPEN_TEXTS)] for i in range(count)],
    }
    return {task: [tokenizer(t)["input_ids"] for t in batch] for task, batch in texts.items()}


def time_bik(
    model_dir: str,
    prompts: Sequence[Sequence[int]],
    dtype: str,
    backend: str,
    tokens: int,
    runs: int,
    draft_tokens: int,
) -> dict:
    """bik's engine, greedy, with ``draft_tokens`` n-gram drafts a step (0: none)."""
    speculative = {"method": "ngram", "num_speculative_tokens": draft_tokens, **LOOKUP}
    return time_engine(
        "bik",
        model_dir,
        prompts,
        dtype,
        backend,
        tokens,
        runs,
        temperature=0.0,
        engine_args={"speculative_config": speculative, "disable_log_stats": False}
        if draft_tokens
        else None,
    )


def record(shape: str, dtype: str, backend: str, fast: dict, plain: dict, runs: int) -> dict:
    """One bench record; raises where the two engines' outputs differ in any bit."""
    if fast["outputs"] != plain["outputs"]:
        raise RuntimeError(
            f"{shape} {dtype}: speculative decoding changed the tokens or log-probs; bik's "
            "verify forward must give each position a decode step's bits"
        )
    fast_s, plain_s = statistics.median(fast["seconds"]), statistics.median(plain["seconds"])
    generated = fast["generated_tokens"]
    kept = (fast["speculation"] or {}).get("accepted", 0) / (runs + 1)  # and the warm-up call
    return {
        "op": OP,
        "shape": f"{shape}, {kept / generated:.0%} of tokens kept drafts",
        "dtype": dtype,
        "backend": backend,
        "bik_ms": fast_s * 1e3,
        "baseline_ms": plain_s * 1e3,
        "ratio": plain_s / fast_s,
        "bik_tokens_per_s": generated / fast_s,
        "baseline_tokens_per_s": generated / plain_s,
        "baseline": "bik vLLM, no speculation",
        "generated_tokens": generated,
        "kept_draft_share": kept / generated,
        "bik_runs_s": fast["seconds"],
        "baseline_runs_s": plain["seconds"],
        "engine_threads": fast["threads"],
    }


def run(
    draft_tokens: int,
    model: str | None = None,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    prompts: int | None = None,
    tokens: int | None = None,
    runs: int | None = None,
    quick: bool = False,
    device: str = "cpu",
    seed: int = 0,
    echo: Callable[..., object] = print,
    row: Callable[[dict], str] = str,
) -> dict:
    """Time bik's engine with and without ``draft_tokens`` n-gram drafts on ``model`` (a
    local directory; None: the random-init Qwen3 of the --vllm bench) for each task and
    dtype; the bench's result dict."""
    from ... import backends

    problem = vllm_engine.vllm_problem()
    if problem:
        raise ImportError(problem)
    backend = backends.resolve(torch.device(device)).name
    load_before = os.getloadavg()[0]  # other work on the machine skews the timings
    given = {"prompts": prompts, "tokens": tokens, "runs": runs}
    counts = {k: given[k] or v for k, v in (QUICK if quick else DEFAULTS).items()}
    records, version = [], None
    with tempfile.TemporaryDirectory(prefix="bik-bench-speculative-") as scratch:
        size = QUICK_MODEL if quick else MODEL
        model_dir = model or save_model(scratch, **size, seed=seed, family="qwen3")
        from transformers import AutoConfig

        name = describe(AutoConfig.from_pretrained(model_dir))
        for task, batch in task_prompts(model_dir, counts["prompts"], seed).items():
            shape = f"{name} {task}: {counts['prompts']} prompts x {counts['tokens']} tokens"
            shape += f", k {draft_tokens}"
            for dtype in dtypes:
                timed = {
                    k: time_bik(
                        model_dir, batch, dtype, backend, counts["tokens"], counts["runs"], k
                    )
                    for k in (0, draft_tokens)
                }
                version = timed[0]["vllm"]
                records.append(
                    record(shape, dtype, backend, timed[draft_tokens], timed[0], counts["runs"])
                )
                echo(row(records[-1]))
    return result(device, backend, version, load_before, records)
