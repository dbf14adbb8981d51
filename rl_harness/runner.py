"""One RL run: rollout -> trainer -> metrics -> update, with checkpoints, resume and outputs.

:func:`run` starts a run in a new directory, :func:`resume` continues one from its last
checkpoint; the directory's files are described in rl_harness.rundir. In a process group
(torchrun) the ranks share each step's batch as rl_harness.distributed describes; rank 0
alone touches the run directory.
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import collapse, losses, policy, report, rollout, routing, rundir, tasks, trainer, vocab
from .batch import Batch, Rollout
from .config import Config
from .distributed import World
from .engines import ENGINES, Engine
from .engines.vllm import MODEL_DIR as VLLM_MODEL_DIR
from .errors import ConfigError, RunDirError
from .evaluate import Heldout, due
from .metrics import mismatch_metrics
from .tasks.base import Example
from .trainer import Update

read_metrics = rundir.read_metrics


def check_world(cfg: Config, world: World) -> None:
    """Every rank needs at least one prompt of each step's batch; a vLLM rollout and PPO
    mini-batches (train.mini_batches > 1) run in one process."""
    if cfg.rollout.prompts < world.size:
        raise ConfigError(
            f"rollout.prompts: expected at least the number of processes ({world.size}), "
            f"got {cfg.rollout.prompts}"
        )
    ENGINES[cfg.rollout.engine].check(cfg, world)
    if cfg.rollout.shadow != "none" and world.size > 1:
        raise ConfigError(
            f"rollout.shadow={cfg.rollout.shadow}: the shadow meter runs in one process, "
            f"not {world.size}"
        )
    if cfg.train.mini_batches > 1 and world.size > 1:
        raise ConfigError(
            f"train.mini_batches={cfg.train.mini_batches}: PPO mini-batches run in one process, "
            f"not {world.size} (use train.mini_batches=1 for data parallelism)"
        )


# what the shadow meter logs (rl_harness.metrics' names under shadow/)
SHADOW_METRICS = (
    "k3_kl",
    "k1_kl",
    "tokens_unequal_frac",
    "logprob_abs_diff_mean",
    "logprob_abs_diff_max",
    "log_ppl_abs_diff",
)


@dataclass(frozen=True)
class StepRecord:
    """What :meth:`Run.step` returns: the step's metrics (its row of metrics.jsonl, before
    any evaluation) and its whole batch as the loss read it (trainer.Update.batch)."""

    metrics: dict[str, Any]
    batch: Batch


class Run:
    """The state of one run, its director: the fp32 master, the trainer (trainer.Learner: its
    working copy, KL reference, optimiser and LR schedule), the rollout engine
    (rl_harness.engines: rollout.engine's), the collapse detector and the shadow meter;
    ``state`` is a checkpoint to continue from (None: warm up, step 0). ``world``: the
    data-parallel processes (default: the current process group, if any). ``model_dir``:
    where a vLLM engine's policy is saved (default: a temporary directory); :meth:`close`
    shuts the engine down."""

    def __init__(
        self,
        cfg: Config,
        cache_dir: str | Path,
        state: dict[str, Any] | None = None,
        world: World | None = None,
        model_dir: str | Path | None = None,
        progress: bool = False,
    ) -> None:
        self.cfg = cfg
        self.world = world or World.current()
        check_world(cfg, self.world)
        self.master = policy.build_master(cfg.model, policy.warmup_seed(cfg))
        policy.check_positions(cfg, self.master.config.max_position_embeddings)
        engine = ENGINES[cfg.rollout.engine]
        engine.check(cfg, self.world, self.master)  # before the warm-up: what cannot run here
        self.progress = progress and self.world.main
        if state is None:
            self.world.on_main(lambda: policy.warmup(self.master, cfg, cache_dir, progress))
            self.world.broadcast_parameters(self.master)  # rank 0's warm-up (or cache)
        else:
            rundir.restore(self.master.load_state_dict, state, "master")
        self.learner = trainer.Learner(self.master, cfg, self.world, state)
        self.detector = collapse.Detector(cfg.collapse)
        self.start = 0
        if state is not None:
            rundir.restore(self.detector.load_state_dict, state, "detector")
            self.start = state["step"] + 1
        # rollout.shadow: a measurement-only copy with native kernels in the rollout's dtype
        self.shadow = (
            None
            if cfg.rollout.shadow == "none"
            else policy.working_copy(self.master, cfg.precision.rollout_dtype, "native")
        )
        drift_gen = torch.Generator().manual_seed(cfg.seed + 7919)
        self.drift = torch.randn(self.master.config.vocab_size, generator=drift_gen)
        # built from the warmed-up or restored weights
        self.rollout: Engine = engine(self.master, cfg, self.drift, model_dir)

    def close(self) -> None:
        """Release the rollout engine (a vLLM engine and its saved policy); idempotent."""
        engine = self.__dict__.pop("rollout", None)
        if engine is not None:
            engine.close()

    def evaluate(self, heldout: Heldout) -> dict[str, Any]:
        """The held-out evaluation of the policy now (rl_harness.evaluate)."""
        return heldout.evaluate(self.learner.model, self.master, self.drift, self.detector)

    def _phase(self, step: int, what: str) -> None:
        """The step's phase on stderr, where progress is shown (a real model's step takes a
        minute): one line, rewritten in place, as the progress line after it is."""
        if self.progress:
            sys.stderr.write(f"\r{f'[{step + 1}/{self.cfg.steps}] {what} ...':<{PHASE_WIDTH}}")
            sys.stderr.flush()

    def step(self, step: int) -> StepRecord:
        """One RL step: sample, score (the trainer's forward), rewards, advantages, the
        mismatch, update (trainer.Learner), log; returns the step's record."""
        cfg = self.cfg
        prompts, examples = tasks.prompt_batch(cfg, random.Random(f"{cfg.seed}-{step}"))
        share, rows = self._sample(prompts, step)
        self._phase(step, "scoring")
        scored = self.learner.score(share, rows)
        rewards = self.rewards(scored.batch, examples, share.prompt_width)
        adv = losses.advantages(rewards, cfg.rollout.samples_per_prompt, cfg.train.advantage)
        metrics = self._mismatch(scored.batch, step)
        if self.shadow is not None:
            metrics.update(self._shadow(prompts, share, scored.batch))
        self._phase(step, "update")
        update = self.learner.update(scored, adv, rewards, self.rollout.update)
        if update.update_skipped and self.world.main:
            warnings.warn(
                f"step {step}: {update.update_skipped} update(s) skipped, weights unchanged: "
                f"non-finite gradient norm (max {update.grad_norm_max}; metric update_skipped)",
                RuntimeWarning,
                2,
            )
        metrics.update(update.stats)
        metrics.update(self._rollout_metrics(share, update.batch))
        metrics.update(self._step_metrics(step, rewards, update))
        self.learner.schedule_lr(step, metrics["response_length/mean"])
        for flag, raised in self.detector.update(metrics).items():
            metrics[f"collapse/{flag}"] = int(raised)
        return StepRecord(metrics, update.batch)

    def _sample(self, prompts: list[list[int]], step: int) -> tuple[Rollout, slice]:
        """This rank's rows of the step's batch, right-padded to the batch's longest
        response, and their place in the batch."""
        cfg, world = self.cfg, self.world
        rows = world.rows(cfg.rollout.prompts, cfg.rollout.samples_per_prompt)
        self._phase(step, "rollout")
        share = self.rollout.sample(prompts, cfg.seed * 1_000_003 + step, rows)
        return rollout.pad_responses(share, world.max(share.sequences.shape[1])), rows

    def rewards(self, batch: Batch, examples: list[Example], width: int) -> torch.Tensor:
        """The task's reward of each row's response (the tokens from column ``width``)."""
        cfg = self.cfg
        responses = batch.sequences[:, width:].tolist()
        task, words, where = tasks.of(cfg.task), vocab.of(cfg.model), tasks.source(cfg.task)
        return torch.tensor(
            [tasks.score(task, e, r, words, where) for e, r in zip(examples, responses)]
        )

    def _mismatch(self, batch: Batch, step: int) -> dict[str, Any]:
        """The step's mismatch metrics (and routing flips for MoE); a zero-mismatch run that
        measures any mismatch stops here (config.assert_zero_mismatch)."""
        cfg, mask = self.cfg, batch.response_mask
        metrics = mismatch_metrics(batch.train_logp, batch.rollout_logp, mask, cfg.remedy.clip)
        if self.learner.moe:
            assert batch.rollout_routing is not None and batch.train_routing is not None
            metrics.update(
                routing.routing_metrics(batch.rollout_routing, batch.train_routing, mask)
            )
        if (
            cfg.zero_mismatch
            and cfg.assert_zero_mismatch
            and (
                metrics["mismatch/tokens_unequal_count"]
                or metrics["mismatch/logprob_abs_diff_max"]
                or metrics.get("mismatch/routing_flip_count", 0)
            )
        ):
            world = self.world
            where = f" (rank {world.rank} of {world.size})" if world.size > 1 else ""
            raise RuntimeError(
                f"step {step}{where}: a zero-mismatch run measured a mismatch: {metrics}"
            )
        return metrics

    def _shadow(self, prompts: list[list[int]], share: Rollout, batch: Batch) -> dict[str, float]:
        """The shadow meter (rollout.shadow): the native copy's log-probs of the sampled tokens,
        computed the rollout's way, against the trainer's; metrics ``shadow/<name>`` for
        :data:`SHADOW_METRICS`. Nothing here reaches training."""
        assert self.shadow is not None
        policy.refresh(self.shadow, self.master)
        forced = share.sequences[:, share.prompt_width :]
        replay = rollout.sample(
            self.shadow, prompts, self.cfg.rollout, self.drift, torch.Generator(), forced=forced
        )
        measured = mismatch_metrics(
            batch.train_logp, replay.rollout_logp, batch.response_mask, self.cfg.remedy.clip
        )
        return {f"shadow/{name}": measured[f"mismatch/{name}"] for name in SHADOW_METRICS}

    def _rollout_metrics(self, share: Rollout, batch: Batch) -> dict[str, Any]:
        """The sampler's counts of this rank's rows (rollout.speculative: each rank drafts its
        own) and, with rollout.digests, every response's digest."""
        metrics: dict[str, Any] = {}
        if share.speculation is not None:
            metrics["rollout/draft_tokens"] = share.speculation.proposed
            metrics["rollout/draft_accepted"] = share.speculation.accepted
            metrics["rollout/forwards"] = share.speculation.forwards
        if self.cfg.rollout.digests:
            width, mask = share.prompt_width, batch.response_mask
            metrics["rollout/response_digests"] = rollout.response_digests(
                batch.sequences[:, width:], mask[:, width:]
            )
        return metrics

    def _step_metrics(self, step: int, rewards: torch.Tensor, update: Update) -> dict[str, Any]:
        """The step's rewards, response lengths and entropy, and what its update measured."""
        batch = update.batch
        mask = batch.response_mask
        lengths = mask.sum(-1).float()
        return {
            "step": step,
            "reward/mean": float(rewards.mean()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "grad_norm": update.grad_norm,
            "grad_norm_max": update.grad_norm_max,
            "update_applied": update.update_applied,
            "update_skipped": update.update_skipped,
            "entropy": float((batch.entropy * mask).sum() / mask.sum().clamp(min=1)),
            "loss": update.loss,
            "lr": self.learner.lr,
        }

    def state_dict(self, step: int) -> dict[str, Any]:
        """The checkpoint after ``step``: the master, the learner's parts, the detector."""
        return {
            "step": step,
            "master": self.master.state_dict(),
            **self.learner.state_dict(),
            "detector": self.detector.state_dict(),
        }


def _keep_policy(job: Run, out: Path, step: int) -> None:
    """The policy after ``step``, kept beside the checkpoint (rundir.policy_path)."""
    path = rundir.policy_path(out, step)
    path.parent.mkdir(exist_ok=True)
    state = {"step": step, "master": job.master.state_dict()}
    rundir.write_atomic(path, functools.partial(torch.save, state))


PHASE_WIDTH = 110  # a phase line covers the progress line it replaces


def _progress(step: int, total: int, metrics: dict[str, Any], started: float, first: int) -> None:
    rate = (time.time() - started) / max(step + 1 - first, 1)
    flips = metrics.get("mismatch/routing_flip_frac")  # MoE policies only
    held_out = metrics.get("eval/accuracy")  # evaluation steps only (rl_harness.evaluate)
    sys.stderr.write(
        f"\r[{step + 1}/{total}] reward {metrics['reward/mean']:.2f} len "
        f"{metrics['response_length/mean']:.1f} k3 {metrics['mismatch/k3_kl']:.1e} unequal "
        f"{metrics['mismatch/tokens_unequal_frac']:.2f} "
        f"{'' if flips is None else f'flips {flips:.3f} '}"
        f"{'' if held_out is None else f'eval {held_out:.2f} '}lr {metrics['lr']:.1e} "
        f"| {rate:.2f} s/step, eta {rate * (total - step - 1):.0f} s "
    )
    sys.stderr.flush()


def run(
    cfg: Config,
    out_dir: str | Path,
    *,
    cache_dir: str | Path = ".cache/rl_harness",
    progress: bool = True,
    name: str = "run",
    keep_policies: bool = False,
) -> dict[str, Any]:
    """Run ``cfg`` into ``out_dir`` (new or empty); returns the summary dict (on every
    rank of a process group). ``keep_policies``: each checkpoint also keeps the policy's
    weights (rundir.policy_path), for the anatomy of the mismatch along training; an output
    only, like ``progress``: the run's bits do not depend on it."""
    world = World.current()
    check_world(cfg, world)

    def create() -> Path:
        out = rundir.check_new(out_dir)
        rundir.write_atomic(out / rundir.CONFIG, rundir.config_text(cfg, world.size))
        return out

    return _loop(cfg, world.on_main(create), None, cache_dir, progress, name, keep_policies)


def resume(
    run_dir: str | Path,
    *,
    steps: int | None = None,
    cache_dir: str | Path = ".cache/rl_harness",
    progress: bool = True,
    name: str | None = None,
    trust_task_module: str | None = None,
    keep_policies: bool = False,
) -> dict[str, Any]:
    """Continue the run in ``run_dir`` from its last checkpoint (from step 0 without one),
    with its own config.json; ``steps`` sets a new total number of steps. Steps recorded
    after the checkpoint are dropped and run again, so the result equals an uninterrupted
    run: the run continues with the number of processes config.json records (another one
    is refused). A config naming a plug-in task module is loaded only when
    ``trust_task_module`` names it (rundir.load_config). In a process group rank 0 reads the
    directory and hands config and checkpoint to the other ranks."""
    world = World.current()

    def load() -> tuple[Path, Config, dict[str, Any] | None]:
        out = rundir.check_resume(run_dir)
        recorded = rundir.recorded_world_size(out)
        if recorded is not None and recorded != world.size:
            raise RunDirError(
                f"--resume: {out} was run by {recorded} process(es), this is {world.size}; "
                f"resume it with {recorded} (gradients, hence the run, depend on the number)"
            )
        cfg = rundir.load_config(out, trust_task_module)
        state = rundir.load_checkpoint(out)
        done = 0 if state is None else state["step"] + 1
        if steps is not None:
            if steps < done:
                raise RunDirError(
                    f"--steps: {out} already holds {done} checkpointed steps; pass at least {done}"
                )
            cfg = cfg.replace(steps=steps)
        if steps is not None or recorded is None:
            rundir.write_atomic(out / rundir.CONFIG, rundir.config_text(cfg, world.size))
        return out, cfg, state

    out, cfg, state = world.on_main(load)
    check_world(cfg, world)
    return _loop(cfg, out, state, cache_dir, progress, name or out.name, keep_policies)


def _loop(
    cfg: Config,
    out: Path,
    state: dict[str, Any] | None,
    cache_dir: str | Path,
    progress: bool,
    name: str,
    keep_policies: bool,
) -> dict[str, Any]:
    try:
        job = Run(cfg, cache_dir, state, model_dir=out / VLLM_MODEL_DIR, progress=progress)
    except rundir.CheckpointMismatch as error:
        raise RunDirError(
            f"--resume: {out / rundir.CHECKPOINT} does not fit {out / rundir.CONFIG}: {error}; "
            f"delete the checkpoint to rerun {out} from step 0"
        ) from None
    main = job.world.main  # rank 0 alone writes metrics, checkpoints and the report
    heldout = Heldout(cfg) if main and cfg.eval.every else None  # rank 0 evaluates
    metrics_path = out / rundir.METRICS
    if main:
        kept = read_metrics(out) if rundir.has_metrics(out) else []
        kept = [m for m in kept if m["step"] < job.start]
        rundir.write_atomic(metrics_path, rundir.metrics_text(kept))  # drop uncheckpointed steps
        for packed in (rundir.METRICS_PACKED, rundir.METRICS_GZ):  # a compacted run goes on plain
            (out / packed).unlink(missing_ok=True)
    started = time.time()
    with (
        contextlib.closing(job),
        metrics_path.open("a") if main else contextlib.nullcontext() as log,
    ):
        for step in range(job.start, cfg.steps):
            # eval.at_start: the policy before the first update (evaluation changes nothing
            # training reads, so the step runs as it would without it)
            before = job.evaluate(heldout) if heldout and step == 0 and cfg.eval.at_start else {}
            metrics = job.step(step).metrics
            if log is None:  # not rank 0
                continue
            metrics.update(before)
            if heldout is not None and due(cfg, step):
                metrics.update(job.evaluate(heldout))  # before the checkpoint: its detector
            log.write(json.dumps(metrics) + "\n")
            log.flush()
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                save = functools.partial(torch.save, job.state_dict(step))
                rundir.write_atomic(out / rundir.CHECKPOINT, save)
                if keep_policies:
                    _keep_policy(job, out, step)
            if progress:
                _progress(step, cfg.steps, metrics, started, job.start)
    if progress and main:
        sys.stderr.write("\n")
    return job.world.on_main(
        lambda: report.write_run_report(out, read_metrics(out), cfg, name, job.world.size)
    )
