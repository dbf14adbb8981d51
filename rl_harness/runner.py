"""One RL run: rollout -> trainer -> metrics -> update, with checkpoints, resume and outputs.

:func:`run` starts a run in a new directory, :func:`resume` continues one from its last
checkpoint; the directory's files are described in rl_harness.rundir. In a process group
(torchrun) the ranks share each step's batch as rl_harness.distributed describes; rank 0
alone touches the run directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import random
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import (
    collapse,
    policy,
    report,
    rollout,
    routing,
    rundir,
    tasks,
    trainer,
    vllm_rollout,
    vocab,
)
from .batch import Batch, Rollout, Tokens
from .config import Config
from .distributed import World
from .engines import ENGINES, Engine
from .errors import ConfigError, RunDirError
from .evaluate import Heldout, due
from .logits import LogitsProcessor
from .metrics import mismatch_metrics
from .schedule import LRSchedule
from .tasks.base import Example

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


class Run:
    """The state of one run: fp32 master, the trainer's working copy, the rollout engine
    (rl_harness.engines: rollout.engine's), optimiser, LR schedule and collapse detector;
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
        self.batch: Batch | None = None  # the last step's whole batch, for inspection
        if state is None:
            self.world.on_main(lambda: policy.warmup(self.master, cfg, cache_dir, progress))
            self.world.broadcast_parameters(self.master)  # rank 0's warm-up (or cache)
        else:
            _restore(self.master.load_state_dict, state, "master")
        self.precision = cfg.precision
        self.train_model = policy.working_copy(
            self.master,
            self.precision.train_dtype,
            cfg.train.kernels,
            tp_invariant=cfg.tp_invariant,
        )
        self.reference = self._reference(state)
        # A mixture-of-experts policy: both sides record their routing (rl_harness.routing)
        self.moe = bool(routing.routers(self.train_model))
        self.processor = LogitsProcessor.of(cfg.rollout)
        self.optimizer = torch.optim.AdamW(
            self.master.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
        )
        self.schedule = LRSchedule(cfg.lr_schedule, cfg.train.lr)
        self.detector = collapse.Detector(cfg.collapse)
        self.start = 0
        if state is not None:
            for part, target in (
                ("optimizer", self.optimizer),
                ("schedule", self.schedule),
                ("detector", self.detector),
            ):
                _restore(target.load_state_dict, state, part)
            self.start = state["step"] + 1
        # rollout.shadow: a measurement-only copy with native kernels in the rollout's dtype
        self.shadow = (
            None
            if cfg.rollout.shadow == "none"
            else policy.working_copy(self.master, self.precision.rollout_dtype, "native")
        )
        drift_gen = torch.Generator().manual_seed(cfg.seed + 7919)
        self.drift = torch.randn(self.master.config.vocab_size, generator=drift_gen)
        # built from the warmed-up or restored weights
        self.rollout: Engine = engine(self.master, cfg, self.drift, model_dir)

    def _reference(self, state: dict[str, Any] | None) -> torch.nn.Module | None:
        """The KL reference of train.kl_coef > 0 (None otherwise: no cost): the warmed-up
        policy, frozen, run as a working copy like the trainer's (its dtype and kernels), so
        under bik its log-probs equal the trainer's bit for bit at the first update. A
        resumed run restores it from the checkpoint (:meth:`state_dict` saves it)."""
        if not self.cfg.train.kl_coef:
            return None
        reference = policy.working_copy(
            self.master,
            self.precision.train_dtype,
            self.cfg.train.kernels,
            tp_invariant=self.cfg.tp_invariant,
        )
        if state is not None:
            _restore(reference.load_state_dict, state, "reference")
        return reference.requires_grad_(False)

    def close(self) -> None:
        """Release the rollout engine (a vLLM engine and its saved policy); idempotent."""
        engine = self.__dict__.pop("rollout", None)
        if engine is not None:
            engine.close()

    def evaluate(self, heldout: Heldout) -> dict[str, Any]:
        """The held-out evaluation of the policy now (rl_harness.evaluate)."""
        return heldout.evaluate(self.train_model, self.master, self.drift, self.detector)

    def _phase(self, step: int, what: str) -> None:
        """The step's phase on stderr, where progress is shown (a real model's step takes a
        minute): one line, rewritten in place, as the progress line after it is."""
        if self.progress:
            sys.stderr.write(f"\r{f'[{step + 1}/{self.cfg.steps}] {what} ...':<{PHASE_WIDTH}}")
            sys.stderr.flush()

    def step(self, step: int) -> dict[str, Any]:
        """One RL step: sample, score the trainer's side, measure the mismatch, update
        (rl_harness.trainer.prepare, then :meth:`_ppo`), log; returns the step's metrics."""
        cfg, world = self.cfg, self.world
        prompts, examples = tasks.prompt_batch(cfg, random.Random(f"{cfg.seed}-{step}"))
        rows = world.rows(cfg.rollout.prompts, cfg.rollout.samples_per_prompt)
        policy.refresh(self.train_model, self.master)
        self._phase(step, "rollout")
        share = self.rollout.sample(prompts, cfg.seed * 1_000_003 + step, rows)
        share = rollout.pad_responses(share, world.max(share.sequences.shape[1]))
        self._phase(step, "scoring")
        forward, batch = self._score(share)
        self.batch = batch
        rewards = self._rewards(batch, examples, share.prompt_width)
        adv = trainer.advantages(rewards, cfg.rollout.samples_per_prompt, cfg.train.advantage)
        metrics = self._mismatch(batch, step)
        if self.shadow is not None:
            metrics.update(self._shadow(prompts, share, batch))
        self._phase(step, "update")
        stats = self._ppo(share, forward, batch, adv, rewards, rows)
        counts = ("grad_norm", "grad_norm_max", "update_applied", "update_skipped")
        updates = {k: stats.pop(k) for k in counts}
        batch_loss = stats.pop("loss")
        if updates["update_skipped"] and world.main:
            warnings.warn(
                f"step {step}: {updates['update_skipped']} update(s) skipped, weights unchanged: "
                f"non-finite gradient norm (max {updates['grad_norm_max']}; metric update_skipped)",
                RuntimeWarning,
                2,
            )
        mask = batch.response_mask
        lengths = mask.sum(-1).float()
        metrics.update(stats)
        if share.speculation is not None:  # this rank's rows (each rank drafts its own)
            metrics.update(
                {
                    "rollout/draft_tokens": share.speculation.proposed,
                    "rollout/draft_accepted": share.speculation.accepted,
                    "rollout/forwards": share.speculation.forwards,
                }
            )
        if cfg.rollout.digests:
            metrics["rollout/response_digests"] = rollout.response_digests(
                batch.sequences[:, share.prompt_width :], mask[:, share.prompt_width :]
            )
        metrics.update(
            {
                "step": step,
                "reward/mean": float(rewards.mean()),
                "response_length/mean": float(lengths.mean()),
                "response_length/max": float(lengths.max()),
                **updates,
                "entropy": float((batch.entropy * mask).sum() / mask.sum().clamp(min=1)),
                "loss": batch_loss,
                "lr": self.optimizer.param_groups[0]["lr"],
            }
        )
        next_lr = self.schedule.step(step, metrics["response_length/mean"])
        for group in self.optimizer.param_groups:
            group["lr"] = next_lr
        for flag, raised in self.detector.update(metrics).items():
            metrics[f"collapse/{flag}"] = int(raised)
        return metrics

    def _score(self, share: Rollout) -> tuple[tuple[torch.Tensor, torch.Tensor], Batch]:
        """The trainer's forward of this rank's rows ``share`` (log-probs and entropy, with
        grad where the loss needs it) and the step's whole :class:`Batch`: every rank's rows
        in order, the single-process batch. Everything after but the backward of this rank's
        share is computed from it, identically on every rank."""
        recorder = routing.Recorder(self.train_model)
        with recorder if self.moe else contextlib.nullcontext():
            train_logp, entropy = self._forward(self.train_model, share)
        gathered = Batch(
            share.sequences,
            share.attention_mask,
            share.response_mask,
            share.rollout_logp,
            train_logp=train_logp.detach(),
            entropy=entropy.detach(),
        )
        if self.moe:
            gathered.rollout_routing = share.routing
            rows_here = share.sequences.shape[0]
            gathered.train_routing = recorder.pop(rows_here, calls_along="rows")
        return (train_logp, entropy), Batch(**self.world.gather_rows(gathered.tensors()))

    def _rewards(self, batch: Batch, examples: list[Example], width: int) -> torch.Tensor:
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
        if self.moe:
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

    def _forward(self, model: torch.nn.Module, rows: Tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer's forward of ``model`` (the trainer copy or the reference) over the
        batch rows ``rows``: log-probs and entropy (trainer.token_logprobs_and_entropy) with
        train.micro_batch_size and train.autocast, the entropy with grad when it is in the
        loss (train.entropy_coef > 0; default runs keep the no-grad path)."""
        t = self.cfg.train
        return trainer.token_logprobs_and_entropy(
            model, rows, self.processor, t.micro_batch_size, t.autocast, t.entropy_coef > 0
        )

    def _terms(
        self, share: Rollout, batch: Batch, rewards: torch.Tensor
    ) -> tuple[Batch, dict[str, float]]:
        """``batch`` with what the loss's optional terms need (trainer.prepare), and their
        step metrics: with train.filter_groups, ``kept`` (trainer.kept_rows) and
        ``train/groups_kept_frac``; with train.kl_coef > 0, ``ref_logp`` (the reference's
        forward of this rank's rows ``share``, gathered) and ``train/kl`` (trainer.mean_kl,
        at pi_old)."""
        t, stats, terms = self.cfg.train, {}, {}
        if t.filter_groups:
            terms["kept"] = trainer.kept_rows(rewards, self.cfg.rollout.samples_per_prompt)
            stats["train/groups_kept_frac"] = float(terms["kept"].mean())
        if self.reference is not None:
            with torch.no_grad():
                ref_logp, _ = self._forward(self.reference, share)
            terms["ref_logp"] = self.world.gather_rows({"ref": ref_logp})["ref"]
        batch = dataclasses.replace(batch, **terms)
        if self.reference is not None:
            stats["train/kl"] = trainer.mean_kl(batch, t.kl_estimator)
        return batch, stats

    def _ppo(
        self,
        share: Rollout,
        forward: tuple[torch.Tensor, torch.Tensor],
        batch: Batch,
        adv: torch.Tensor,
        rewards: torch.Tensor,
        rows: slice,
    ) -> dict[str, Any]:
        """train.ppo_epochs passes over train.mini_batches mini-batches (whole prompt groups, a
        fixed order), one update each, against pi_old = ``batch.train_logp``. The first
        update of a single mini-batch reuses the batch forward ``forward`` (this rank's
        rows' log-probs and entropy, with grad); every other update refreshes the trainer
        copy if the master changed and runs its own forward. A mini-batch whose groups
        train.filter_groups all dropped (by the whole batch's ``rewards``) gets no forward
        and no update (grad norm 0, not applied). Returns the step's stats: the policy_loss
        stats averaged over the updates (``ppo/ratio_max`` / ``ppo/ratio_min``: over them),
        ``grad_norm`` (mean), ``grad_norm_max``, ``update_applied`` (how many were applied),
        ``update_skipped`` (how many a non-finite gradient skipped: :meth:`_update`)
        and the optional terms' metrics (:meth:`_terms`)."""
        t = self.cfg.train
        batch, terms = self._terms(share, batch, rewards)
        self.batch = batch
        prepared = trainer.prepare(batch, adv, self.cfg)
        size = batch.sequences.shape[0] // t.mini_batches
        parts = (
            [None]
            if t.mini_batches == 1
            else [slice(k * size, (k + 1) * size) for k in range(t.mini_batches)]
        )
        updates: list[dict[str, Any]] = []  # each update's stats
        stale = False  # the trainer copy lags the master
        for epoch in range(t.ppo_epochs):
            for select in parts:
                rows_of = select or slice(None)
                if not bool(prepared.kept[rows_of].any()):
                    part = prepared.take(select)
                    updates.append(self._filtered_out(part, batch.entropy[rows_of]))
                    continue
                if epoch == 0 and select is None:
                    (logp, entropy), part, here = forward, prepared, rows
                else:
                    if stale:
                        policy.refresh(self.train_model, self.master)
                        stale = False
                    # one process holds the whole batch whenever a mini-batch is not all of it
                    sub: Tokens = share if select is None else batch.take(select)
                    logp, entropy = self._forward(self.train_model, sub)
                    current = self.world.gather_rows({"logp": logp.detach()})["logp"]
                    part = prepared.take(select, current)
                    here = rows if select is None else slice(None)
                loss, stats = trainer.policy_loss(logp, part, self.cfg, here, entropy)
                stats["grad_norm"], stats["update_applied"] = self._update(loss)
                stats["update_skipped"] = 1 - stats["update_applied"]
                stale = stale or bool(stats["update_applied"])
                updates.append(stats)
        return {**prepared.remedy_stats, **_summarise(updates), **terms}

    def _filtered_out(self, part: trainer.Prepared, entropy: torch.Tensor) -> dict[str, Any]:
        """The stats of an update whose mini-batch ``part`` train.filter_groups emptied:
        policy_loss's at pi_old over no token (loss 0, ratio 1, no clipping), grad norm 0,
        not applied (an AdamW step on zero gradients would still move the weights)."""
        with torch.no_grad():
            _, stats = trainer.policy_loss(part.current, part, self.cfg, entropy=entropy)
        return {**stats, "grad_norm": 0.0, "update_applied": 0, "update_skipped": 0}

    def _update(self, loss: torch.Tensor) -> tuple[float, int]:
        """Backward on the trainer copy, fp32 grads into the master, summed over the ranks,
        clip, AdamW step (every rank steps on the same gradients); returns the gradient norm
        and 1 (applied) or 0.

        A non-finite gradient norm (an fp16 overflow, a NaN loss) is never applied: the
        update is skipped (weights and optimiser state unchanged); :meth:`step` counts it
        in ``update_skipped`` and warns (train.grad_clip's docs)."""
        scale = self.precision.loss_scale
        self.train_model.zero_grad(set_to_none=True)
        (loss * scale).backward()
        for m, w in zip(self.master.parameters(), self.train_model.parameters()):
            m.grad = None if w.grad is None else w.grad.float() / scale
        self.world.sum_gradients(self.master.parameters())
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.cfg.train.grad_clip)
        )
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, 0
        self.optimizer.step()
        self.rollout.update(self.master)
        return grad_norm, 1

    def state_dict(self, step: int) -> dict[str, Any]:
        """The checkpoint after ``step``; with train.kl_coef > 0 it holds the reference too."""
        state = {
            "step": step,
            "master": self.master.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "detector": self.detector.state_dict(),
        }
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        return state


def _keep_policy(job: Run, out: Path, step: int) -> None:
    """The policy after ``step``, kept beside the checkpoint (rundir.policy_path)."""
    path = rundir.policy_path(out, step)
    path.parent.mkdir(exist_ok=True)
    state = {"step": step, "master": job.master.state_dict()}
    rundir.write_atomic(path, functools.partial(torch.save, state))


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the run's config (resume names the files)."""


def _restore(load: Callable[[Any], Any], state: dict[str, Any], part: str) -> None:
    """``load(state[part])``, any failure a :class:`CheckpointMismatch` naming ``part``."""
    if part not in state:
        raise CheckpointMismatch(f"it has no {part} state")
    try:
        load(state[part])
    except Exception as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CheckpointMismatch(f"its {part} state does not fit ({reason})") from None


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


def _summarise(updates: list[dict[str, Any]]) -> dict[str, Any]:
    """A step's stats from its updates' (Run._ppo): the first update's, then the loss, clip
    fraction and grad norm averaged (one update: its value, bit for bit), the grad norm's
    maximum, the ratio's extremes, and the updates applied and skipped counted."""
    out = dict(updates[0])
    for key in ("loss", "ppo/clip_frac", "grad_norm"):
        first, *rest = (u[key] for u in updates)
        out[key] = sum(rest, first) / len(updates)
    out["grad_norm_max"] = max(u["grad_norm"] for u in updates)
    out["ppo/ratio_max"] = max(u["ppo/ratio_max"] for u in updates)
    out["ppo/ratio_min"] = min(u["ppo/ratio_min"] for u in updates)
    out["update_applied"] = sum(u["update_applied"] for u in updates)
    out["update_skipped"] = sum(u["update_skipped"] for u in updates)
    return out


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
        job = Run(cfg, cache_dir, state, model_dir=out / vllm_rollout.MODEL_DIR, progress=progress)
    except CheckpointMismatch as error:
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
            metrics = job.step(step)
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
