"""One RL run: rollout -> trainer -> metrics -> update, with checkpoints, resume and outputs.

Outputs in the run directory: config.json (resolved), metrics.jsonl (one object per step,
flushed every step), checkpoint.pt (latest), metrics.png and summary.md.
"""

import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

from . import collapse, plots, policy, remedies, rollout, tasks, trainer
from . import config as config_lib
from .metrics import mismatch_metrics

FP16_LOSS_SCALE = 1024.0  # static loss scale of the fp16 trainer copy


def _dtypes(cfg):
    if cfg["remedy"]["name"] == "fp16":  # the FP16 remedy: both sides in float16
        return "float16", "float16"
    return cfg["train"]["dtype"], cfg["rollout"]["dtype"]


def _prompts(cfg, rng):
    rows, answers = [], []
    for _ in range(cfg["rollout"]["prompts"]):
        prompt, answer = tasks.sample(
            cfg["task"]["name"], rng, cfg["task"]["min_digits"], cfg["task"]["max_digits"]
        )
        for _ in range(cfg["rollout"]["samples_per_prompt"]):
            rows.append([tasks.BOS] + tasks.encode(prompt))
            answers.append(answer)
    return rows, answers


class Run:
    def __init__(self, cfg, out_dir, cache_dir, resume=False):
        self.cfg, self.out = cfg, Path(out_dir)
        self.master = policy.build_master(cfg["model"], cfg["seed"])
        checkpoint = self.out / "checkpoint.pt"
        state = torch.load(checkpoint, weights_only=False) if resume else None
        if state is None:
            policy.warmup(self.master, cfg, cache_dir)
        else:
            self.master.load_state_dict(state["master"])
        train_dtype, rollout_dtype = _dtypes(cfg)
        self.train_dtype = train_dtype
        self.train_model = policy.working_copy(self.master, train_dtype, cfg["train"]["kernels"])
        self.rollout_model = policy.working_copy(
            self.master, rollout_dtype, cfg["rollout"]["kernels"], cfg["rollout"]["split_size"]
        )
        self.optimizer = torch.optim.AdamW(
            self.master.parameters(),
            lr=cfg["train"]["lr"],
            weight_decay=cfg["train"]["weight_decay"],
        )
        self.schedule = remedies.LengthSurgeLR(cfg["lr_schedule"], cfg["train"]["lr"])
        self.detector = collapse.Detector(cfg["collapse"])
        self.start = 0
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.schedule.load_state_dict(state["schedule"])
            self.detector.load_state_dict(state["detector"])
            self.start = state["step"] + 1
        drift_gen = torch.Generator().manual_seed(cfg["seed"] + 7919)
        self.drift = torch.randn(self.master.config.vocab_size, generator=drift_gen)
        self.zero_mismatch = config_lib.is_zero_mismatch(cfg) and train_dtype == rollout_dtype

    def step(self, step):
        cfg = self.cfg
        generator = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step)
        prompts, answers = _prompts(cfg, random.Random(f"{cfg['seed']}-{step}"))
        policy.refresh(self.rollout_model, self.master)
        policy.refresh(self.train_model, self.master)
        batch = rollout.sample(self.rollout_model, prompts, cfg["rollout"], self.drift, generator)
        width = batch["prompt_width"]
        responses = batch["sequences"][:, width:].tolist()
        rewards = torch.tensor([tasks.reward(a, r) for a, r in zip(answers, responses)])
        adv = trainer.advantages(
            rewards, cfg["rollout"]["samples_per_prompt"], cfg["train"]["advantage"]
        )
        train_logp, entropy = trainer.token_logprobs_and_entropy(
            self.train_model, batch, cfg["rollout"], cfg["train"]["micro_batch_size"]
        )
        mask = batch["response_mask"]
        metrics = mismatch_metrics(
            train_logp.detach(), batch["rollout_logp"], mask, cfg["remedy"]["clip"]
        )
        if (
            self.zero_mismatch
            and cfg["assert_zero_mismatch"]
            and (
                metrics["mismatch/tokens_unequal_count"] or metrics["mismatch/logprob_abs_diff_max"]
            )
        ):
            raise RuntimeError(f"step {step}: a zero-mismatch run measured a mismatch: {metrics}")
        loss, stats = trainer.policy_loss(train_logp, batch, adv, cfg)
        grad_norm, applied = self._update(loss)
        lengths = mask.sum(-1).float()
        metrics.update(stats)
        metrics.update(
            {
                "step": step,
                "reward/mean": float(rewards.mean()),
                "response_length/mean": float(lengths.mean()),
                "response_length/max": float(lengths.max()),
                "grad_norm": grad_norm,
                "update_applied": applied,
                "entropy": float((entropy * mask).sum() / mask.sum().clamp(min=1)),
                "loss": float(loss.detach()),
                "lr": self.optimizer.param_groups[0]["lr"],
            }
        )
        next_lr = self.schedule.step(step, metrics["response_length/mean"])
        for group in self.optimizer.param_groups:
            group["lr"] = next_lr
        for flag, raised in self.detector.update(step, metrics).items():
            metrics[f"collapse/{flag}"] = int(raised)
        return metrics

    def _update(self, loss):
        """Backward on the trainer copy, fp32 grads into the master, clip, AdamW step."""
        scale = FP16_LOSS_SCALE if self.train_dtype == "float16" else 1.0
        self.train_model.zero_grad(set_to_none=True)
        (loss * scale).backward()
        for m, w in zip(self.master.parameters(), self.train_model.parameters()):
            m.grad = None if w.grad is None else w.grad.float() / scale
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.cfg["train"]["grad_clip"])
        )
        if not torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)  # fp16 overflow: skip, say so in metrics
            return grad_norm, 0
        self.optimizer.step()
        return grad_norm, 1

    def checkpoint(self, step):
        state = {
            "step": step,
            "master": self.master.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "detector": self.detector.state_dict(),
        }
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.out / "checkpoint.pt")  # atomic: a crash never leaves half a file


def _progress(step, total, metrics, started, first):
    rate = (time.time() - started) / max(step + 1 - first, 1)
    sys.stderr.write(
        f"\r[{step + 1}/{total}] reward {metrics['reward/mean']:.2f} len "
        f"{metrics['response_length/mean']:.1f} k3 {metrics['mismatch/k3_kl']:.1e} unequal "
        f"{metrics['mismatch/tokens_unequal_frac']:.2f} lr {metrics['lr']:.1e} "
        f"| {rate:.2f} s/step, eta {rate * (total - step - 1):.0f} s "
    )
    sys.stderr.flush()


def read_metrics(out_dir):
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(cfg, out_dir, *, resume=False, cache_dir=".cache/rl_harness", progress=True, name="run"):
    """Run (or resume) ``cfg`` into ``out_dir``; returns the summary dict."""
    out = Path(out_dir)
    metrics_path = out / "metrics.jsonl"
    if resume:
        cfg = config_lib.load(out / "config.json")
    elif metrics_path.exists():
        raise FileExistsError(
            f"--out: {out} already holds a run; pass --resume {out} to continue it"
        )
    out.mkdir(parents=True, exist_ok=True)
    config_lib.save(cfg, out / "config.json")
    job = Run(cfg, out, cache_dir, resume=resume and (out / "checkpoint.pt").exists())
    kept = [m for m in read_metrics(out) if m["step"] < job.start] if metrics_path.exists() else []
    metrics_path.write_text(
        "".join(json.dumps(m) + "\n" for m in kept)
    )  # drop uncheckpointed steps
    started = time.time()
    with metrics_path.open("a") as log:
        for step in range(job.start, cfg["steps"]):
            metrics = job.step(step)
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            if (step + 1) % cfg["checkpoint_every"] == 0 or step + 1 == cfg["steps"]:
                job.checkpoint(step)
            if progress:
                _progress(step, cfg["steps"], metrics, started, job.start)
    if progress:
        sys.stderr.write("\n")
    summary = summarize(read_metrics(out), job.detector, cfg, name)
    (out / "summary.md").write_text(summary_markdown(summary))
    plots.plot_runs({name: read_metrics(out)}, out / "metrics.png")
    return summary


def summarize(history, detector, cfg, name):
    last = history[-5:]
    mean = lambda key, rows: sum(r[key] for r in rows) / max(len(rows), 1)
    return {
        "name": name,
        "steps": len(history),
        "reward_first5": mean("reward/mean", history[:5]),
        "reward_last5": mean("reward/mean", last),
        "k3_max": max((r["mismatch/k3_kl"] for r in history), default=0.0),
        "tokens_unequal_frac_mean": mean("mismatch/tokens_unequal_frac", history),
        "logprob_abs_diff_max": max(
            (r["mismatch/logprob_abs_diff_max"] for r in history), default=0.0
        ),
        "collapse_step": detector.collapse_step(),
        "first_flags": dict(detector.first),
        "overrides": {
            k: v for k, v in config_lib.flatten(cfg).items() if config_lib.DEFAULTS_FLAT.get(k) != v
        },
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
    }


def summary_markdown(s):
    overrides = json.dumps(s["overrides"], sort_keys=True) if s["overrides"] else "none (defaults)"
    collapse = s["collapse_step"] if s["collapse_step"] is not None else "none"
    lines = [
        f"# {s['name']}",
        "",
        f"- steps: {s['steps']}",
        f"- overrides: {overrides}",
        f"- reward: first 5 steps {s['reward_first5']:.3f}, last 5 steps {s['reward_last5']:.3f}",
        f"- mismatch: k3 max {s['k3_max']:.3e}, mean fraction of unequal tokens "
        f"{s['tokens_unequal_frac_mean']:.3f}, "
        f"max abs log-prob diff {s['logprob_abs_diff_max']:.3e}",
        f"- first collapse step: {collapse}",
        f"- first step of each flag: {json.dumps(s['first_flags'], sort_keys=True) or 'none'}",
        f"- machine: {s['machine']}",
        "",
        "![metrics](metrics.png)",
        "",
    ]
    return "\n".join(lines)
