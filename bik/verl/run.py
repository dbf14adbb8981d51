"""A verl GRPO run on this machine's cores with bik's plug-ins, and its mismatch metrics.

    python -m bik.verl.run --out runs/verl                 # bik: every mismatch metric 0
    python -m bik.verl.run --out runs/verl-native --native # the control: verl's own numerics
    python -m bik.verl.run --out runs/verl-bypass --bypass --audit-every 2

It writes the policy (``tiny``: the tiny Llama preset with SmolLM2's tokenizer, random weights;
``smollm2``: SmolLM2-135M-Instruct), the task's parquet files and verl's metrics
(``metrics.jsonl``, verl's file logger) under ``--out``, runs ``verl.trainer.main_ppo`` with 2
FSDP2 workers on gloo under a local Ray, prints the mismatch metrics of every step, and exits
1 when a bik run logged any that is not exactly zero (the native control never fails).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from . import task
from .settings import AUDIT_ENV, NATIVE_ENV

# verl's own metrics of the rollout / trainer disagreement: each exactly 0 when they agree.
ZERO_METRICS = (
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_mean",
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/log_ppl_diff_max",
    "rollout_corr/log_ppl_diff_min",
    "rollout_corr/log_ppl_abs_diff",
    "rollout_corr/chi2_token",
    "rollout_corr/chi2_seq",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "audit/differing_tokens",
)
SHOWN = (
    "training/rollout_probs_diff_max",
    "rollout_corr/k3_kl",
    "rollout_corr/log_ppl_abs_diff",
    "actor/ppo_kl",
    "audit/differing_tokens",
    "actor/grad_norm",
    "critic/score/mean",
)
WORKERS = 2


def prepare(out: Path, model: str) -> Path:
    """The policy's directory, and the task's train / validation parquet files, under ``out``."""
    import pandas as pd

    from ..testing.models import path as model_path

    out.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(task.rows(32))
    frame.to_parquet(out / "train.parquet")
    frame[:8].to_parquet(out / "val.parquet")
    if model == "smollm2":
        return model_path("smollm2")
    return _tiny_policy(out / "tiny", model_path("smollm2"))


def _tiny_policy(target: Path, tokenizer_source: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..families import FAMILIES

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = FAMILIES["llama"].tiny_config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def overrides(out: Path, policy: Path, steps: int, bypass: bool) -> list[str]:
    """verl's Hydra overrides for a small GRPO run on ``WORKERS`` CPU workers."""
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"algorithm.rollout_correction.bypass_mode={str(bypass).lower()}",
        f"data.train_files={out / 'train.parquet'}",
        f"data.val_files={out / 'val.parquet'}",
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        f"actor_rollout_ref.model.path={policy}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.rollout.name=bik",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"reward.custom_reward_function.path={task.__file__}",
        f"trainer.n_gpus_per_node={WORKERS}",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[console,file]",
        "trainer.val_before_train=False",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={out / 'checkpoints'}",
        f"+ray_kwargs.ray_init.num_gpus={WORKERS}",
        "ray_kwargs.ray_init.num_cpus=8",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


def launch(out: Path, args: list[str], native: bool, audit_every: int) -> int:
    """verl's ``main_ppo`` in a child process, its output in ``out/verl.log``."""
    env = dict(
        os.environ,
        VERL_USE_EXTERNAL_MODULES="bik.verl.plugin",
        VERL_PLATFORM="cpu",
        VERL_DISABLE_FLASH_ATTN_CE="1",
        VERL_FILE_LOGGER_PATH=str(out / "metrics.jsonl"),
        TOKENIZERS_PARALLELISM="false",
        **{NATIVE_ENV: "1" if native else "0", AUDIT_ENV: str(audit_every)},
    )
    with open(out / "verl.log", "w") as log:
        command = [sys.executable, "-m", "verl.trainer.main_ppo", *args]
        return subprocess.run(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out
        ).returncode


def read_metrics(path: Path) -> list[dict[str, float]]:
    """verl's file logger's rows, one a step, each with its ``step``."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"step": row["step"], **row["data"]} for row in rows]


def nonzero(rows: list[dict[str, float]]) -> list[str]:
    """Every (step, metric) of :data:`ZERO_METRICS` logged with a value other than 0."""
    return [
        f"step {row['step']}: {name} = {row[name]}"
        for row in rows
        for name in ZERO_METRICS
        if row.get(name, 0) != 0
    ]


def table(rows: list[dict[str, float]]) -> str:
    """The shown metrics by step, each column headed by the metric without its group."""
    shown = [name for name in SHOWN if any(name in row for row in rows)]
    heads = [name.split("/", 1)[-1] for name in shown]
    lines = ["step  " + "  ".join(heads)]
    for row in rows:
        cells = [f"{row[name]:.3g}" if name in row else "-" for name in shown]
        lines.append(
            f"{row['step']:>4}  " + "  ".join(f"{c:>{len(h)}}" for c, h in zip(cells, heads))
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bik.verl.run", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="the run's directory (made if absent)"
    )
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--native", action="store_true", help="the control: no bik patch on either side"
    )
    parser.add_argument("--bypass", action="store_true", help="pi_old = the rollout's log-probs")
    parser.add_argument(
        "--audit-every", type=int, default=0, help="with --bypass: recompute every Nth step"
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: expected at least 1, got {args.steps}")
    out = args.out.resolve()
    policy = prepare(out, args.model)
    code = launch(
        out, overrides(out, policy, args.steps, args.bypass), args.native, args.audit_every
    )
    if code != 0:
        print(f"verl exited with {code}: see {out / 'verl.log'}", file=sys.stderr)
        return code
    rows = read_metrics(out / "metrics.jsonl")
    print(table(rows))
    differing = nonzero(rows)
    label = "native control" if args.native else "bik"
    print(f"{label}: {len(differing)} non-zero mismatch metric values over {len(rows)} steps")
    if differing and not args.native:
        print("\n".join(differing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
