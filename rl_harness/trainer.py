"""The :class:`Learner` that owns the update: the trainer's copy, the KL reference, the
optimiser, the LR schedule and the loss scale; its objective is :mod:`rl_harness.losses`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import policy, routing
from .batch import Batch, Rollout, Tokens
from .logits import LogitsProcessor
from .losses import (
    Prepared,
    kept_rows,
    mean_kl,
    policy_loss,
    prepare,
    token_logprobs_and_entropy,
)
from .rundir import restore
from .schedule import LRSchedule

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .config import Config
    from .distributed import World


@dataclass(frozen=True)
class Scored:
    """The trainer's forward of a rank's rows (:meth:`Learner.score`)."""

    share: Rollout  # this rank's rows
    rows: slice  # their place in the step's batch
    logp: torch.Tensor  # [b, L] their log-probs, with grad
    entropy: torch.Tensor  # [b, L] their entropy (with grad when the loss has an entropy term)
    batch: Batch  # every rank's rows, gathered and detached: the single-process batch


@dataclass(frozen=True)
class Update:
    """What a step's update measured (:meth:`Learner.update`) over its train.ppo_epochs x
    train.mini_batches optimiser steps, and the batch its loss read."""

    loss: float  # the policy-gradient term, averaged over the updates
    grad_norm: float  # averaged over the updates
    grad_norm_max: float
    update_applied: int  # how many updates were applied
    update_skipped: int  # how many a non-finite gradient norm skipped (train.grad_clip)
    stats: dict[str, float]  # the remedy's, PPO's (policy_loss) and the optional terms' metrics
    batch: Batch  # Scored.batch with ``kept`` and ``ref_logp`` where the loss's terms need them


class Learner:
    """The trainer's side of a run: its working copy of the fp32 ``master`` (the trainer's
    kernels and dtype), the KL reference, AdamW on the master's parameters, the LR schedule
    and the loss scale. :meth:`score` is the trainer's forward of a step's rows,
    :meth:`update` the step's optimiser steps. ``state``: a checkpoint to continue from
    (:meth:`state_dict`'s parts; None: a new run)."""

    def __init__(
        self,
        master: PreTrainedModel,
        cfg: Config,
        world: World,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.master, self.cfg, self.world = master, cfg, world
        self.loss_scale = cfg.precision.loss_scale
        self.model = self._working_copy()
        self.reference = self._reference(state)
        # A mixture-of-experts policy: both sides record their routing (rl_harness.routing)
        self.moe = bool(routing.routers(self.model))
        self.processor = LogitsProcessor.of(cfg.rollout)
        self.optimizer = torch.optim.AdamW(
            master.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
        )
        self.schedule = LRSchedule(cfg.lr_schedule, cfg.train.lr)
        if state is not None:
            restore(self.optimizer.load_state_dict, state, "optimizer")
            restore(self.schedule.load_state_dict, state, "schedule")
        self._stale = False  # the trainer copy lags the master (an update moved it)

    def _working_copy(self) -> PreTrainedModel:
        cfg = self.cfg
        return policy.working_copy(
            self.master, cfg.precision.train_dtype, cfg.train.kernels, tp_invariant=cfg.tp_invariant
        )

    def _reference(self, state: dict[str, Any] | None) -> torch.nn.Module | None:
        """The KL reference of train.kl_coef > 0 (None otherwise: no cost): the warmed-up
        policy, frozen, run as a working copy like the trainer's (its dtype and kernels), so
        under bik its log-probs equal the trainer's bit for bit at the first update. A
        resumed run restores it from the checkpoint (:meth:`state_dict` saves it)."""
        if not self.cfg.train.kl_coef:
            return None
        reference = self._working_copy()
        if state is not None:
            restore(reference.load_state_dict, state, "reference")
        return reference.requires_grad_(False)

    @property
    def lr(self) -> float:
        """The learning rate of the next optimiser step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def schedule_lr(self, step: int, mean_length: float) -> None:
        """Set the next step's learning rate (rl_harness.schedule: from ``step`` and its mean
        response length)."""
        lr = self.schedule.step(step, mean_length)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's parts this restores from; with train.kl_coef > 0 the reference too."""
        state = {"optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict()}
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        return state

    def _refresh(self) -> None:
        """The trainer copy at the master's weights."""
        policy.refresh(self.model, self.master)
        self._stale = False

    def _forward(self, model: torch.nn.Module, rows: Tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer's forward of ``model`` (the trainer copy or the reference) over the
        batch rows ``rows``: log-probs and entropy (:func:`token_logprobs_and_entropy`) with
        train.micro_batch_size and train.autocast, the entropy with grad when it is in the
        loss (train.entropy_coef > 0; default runs keep the no-grad path)."""
        t = self.cfg.train
        return token_logprobs_and_entropy(
            model, rows, self.processor, t.micro_batch_size, t.autocast, t.entropy_coef > 0
        )

    def score(self, share: Rollout, rows: slice) -> Scored:
        """The trainer's forward, at the master's weights, of this rank's rows ``share`` (the
        rows ``rows`` of the step's batch), and the step's whole :class:`Batch`: every rank's
        rows in order, the single-process batch. Everything after but the backward of this
        rank's share is computed from it, identically on every rank."""
        self._refresh()
        recorder = routing.Recorder(self.model)
        with recorder if self.moe else contextlib.nullcontext():
            logp, entropy = self._forward(self.model, share)
        gathered = Batch(
            share.sequences,
            share.attention_mask,
            share.response_mask,
            share.rollout_logp,
            train_logp=logp.detach(),
            entropy=entropy.detach(),
        )
        if self.moe:
            gathered.rollout_routing = share.routing
            rows_here = share.sequences.shape[0]
            gathered.train_routing = recorder.pop(rows_here, calls_along="rows")
        batch = Batch(**self.world.gather_rows(gathered.tensors()))
        return Scored(share, rows, logp, entropy, batch)

    def update(
        self,
        scored: Scored,
        adv: torch.Tensor,
        rewards: torch.Tensor,
        publish: Callable[[torch.nn.Module], None],
    ) -> Update:
        """train.ppo_epochs passes over train.mini_batches mini-batches (whole prompt groups,
        a fixed order), one update each, against pi_old = ``scored.batch.train_logp``, with
        the advantages ``adv``; ``rewards`` (the whole batch's) pick the groups
        train.filter_groups keeps. ``publish(master)`` follows every applied optimiser step
        (the rollout engine's update). The stats: the policy_loss stats averaged over the
        updates (``ppo/ratio_max`` / ``ppo/ratio_min``: over them), the remedy's and the
        optional terms' (:meth:`_terms`)."""
        t = self.cfg.train
        batch, terms = self._terms(scored, rewards)
        prepared = prepare(batch, adv, self.cfg)
        size = batch.sequences.shape[0] // t.mini_batches
        parts = (
            [None]
            if t.mini_batches == 1
            else [slice(k * size, (k + 1) * size) for k in range(t.mini_batches)]
        )
        updates = []  # each update's stats
        for epoch in range(t.ppo_epochs):
            for select in parts:
                first = epoch == 0 and select is None
                updates.append(self._update_part(scored, batch, prepared, select, first, publish))
        summary = _summarise(updates)
        return Update(
            loss=summary.pop("loss"),
            grad_norm=summary.pop("grad_norm"),
            grad_norm_max=summary.pop("grad_norm_max"),
            update_applied=summary.pop("update_applied"),
            update_skipped=summary.pop("update_skipped"),
            stats={**prepared.remedy_stats, **summary, **terms},
            batch=batch,
        )

    def _terms(self, scored: Scored, rewards: torch.Tensor) -> tuple[Batch, dict[str, float]]:
        """``scored.batch`` with what the loss's optional terms need (:func:`prepare`), and
        their step metrics: with train.filter_groups, ``kept`` (:func:`kept_rows`) and
        ``train/groups_kept_frac``; with train.kl_coef > 0, ``ref_logp`` (the reference's
        forward of this rank's rows, gathered) and ``train/kl`` (:func:`mean_kl`, at
        pi_old)."""
        t, stats, terms = self.cfg.train, {}, {}
        if t.filter_groups:
            terms["kept"] = kept_rows(rewards, self.cfg.rollout.samples_per_prompt)
            stats["train/groups_kept_frac"] = float(terms["kept"].mean())
        if self.reference is not None:
            with torch.no_grad():
                ref_logp, _ = self._forward(self.reference, scored.share)
            terms["ref_logp"] = self.world.gather_rows({"ref": ref_logp})["ref"]
        batch = dataclasses.replace(scored.batch, **terms)
        if self.reference is not None:
            stats["train/kl"] = mean_kl(batch, t.kl_estimator)
        return batch, stats

    def _update_part(
        self,
        scored: Scored,
        batch: Batch,
        prepared: Prepared,
        select: slice | None,
        first: bool,
        publish: Callable[[torch.nn.Module], None],
    ) -> dict[str, Any]:
        """One update on the mini-batch ``select`` (None: the whole batch) and its stats. The
        ``first`` update of a single mini-batch reuses the score's forward (``scored``: this
        rank's rows, with grad); every other refreshes the trainer copy if the master moved
        and runs its own forward. A mini-batch whose groups train.filter_groups all dropped
        gets no forward and no update (:meth:`_filtered_out`)."""
        rows = select or slice(None)
        if not bool(prepared.kept[rows].any()):
            return self._filtered_out(prepared.take(select), batch.entropy[rows])
        if first:
            logp, entropy, part, here = scored.logp, scored.entropy, prepared, scored.rows
        else:
            if self._stale:
                self._refresh()
            # one process holds the whole batch whenever a mini-batch is not all of it
            sub: Tokens = scored.share if select is None else batch.take(select)
            logp, entropy = self._forward(self.model, sub)
            current = self.world.gather_rows({"logp": logp.detach()})["logp"]
            part = prepared.take(select, current)
            here = scored.rows if select is None else slice(None)
        loss, stats = policy_loss(logp, part, self.cfg, here, entropy)
        stats["grad_norm"], stats["update_applied"] = self._step(loss, publish)
        stats["update_skipped"] = 1 - stats["update_applied"]
        return stats

    def _filtered_out(self, part: Prepared, entropy: torch.Tensor) -> dict[str, Any]:
        """The stats of an update whose mini-batch ``part`` train.filter_groups emptied:
        policy_loss's at pi_old over no token (loss 0, ratio 1, no clipping), grad norm 0,
        not applied (an AdamW step on zero gradients would still move the weights)."""
        with torch.no_grad():
            _, stats = policy_loss(part.current, part, self.cfg, entropy=entropy)
        return {**stats, "grad_norm": 0.0, "update_applied": 0, "update_skipped": 0}

    def _step(
        self, loss: torch.Tensor, publish: Callable[[torch.nn.Module], None]
    ) -> tuple[float, int]:
        """Backward on the trainer copy, fp32 grads into the master, summed over the ranks,
        clip, AdamW step (every rank steps on the same gradients), ``publish(master)``;
        returns the gradient norm and 1 (applied) or 0.

        A non-finite gradient norm (an fp16 overflow, a NaN loss) is never applied: the
        update is skipped (weights and optimiser state unchanged) and counted in
        ``update_skipped`` (train.grad_clip's docs)."""
        scale = self.loss_scale
        self.model.zero_grad(set_to_none=True)
        (loss * scale).backward()
        for m, w in zip(self.master.parameters(), self.model.parameters()):
            m.grad = None if w.grad is None else w.grad.float() / scale
        self.world.sum_gradients(self.master.parameters())
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.master.parameters(), self.cfg.train.grad_clip)
        )
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, 0
        self.optimizer.step()
        self._stale = True
        publish(self.master)
        return grad_norm, 1


def _summarise(updates: list[dict[str, Any]]) -> dict[str, Any]:
    """A step's stats from its updates' (:meth:`Learner.update`): the first update's, then the
    loss, clip fraction and grad norm averaged (one update: its value, bit for bit), the grad
    norm's maximum, the ratio's extremes, and the updates applied and skipped counted."""
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
