"""Trainer: full forward over finished sequences, advantages, policy loss with remedies, and
the :class:`Learner` that owns the update (the trainer's copy, reference and optimiser)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import bik
from bik.contract import DTYPE_NAMES
from bik.hf import generation_position_ids

from . import policy, remedies, routing
from .batch import Batch, Rollout, Tokens
from .logits import LogitsProcessor
from .metrics import masked_mean
from .rundir import restore
from .schedule import LRSchedule

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .config import Config
    from .distributed import World


def advantages(rewards: torch.Tensor, group_size: int, kind: str) -> torch.Tensor:
    """Per-sequence advantages; sequences of one prompt are ``group_size`` consecutive rows.

    grpo: (r - group mean) / (group std + 1e-6); rloo: r - mean of the other samples.
    """
    groups = rewards.view(-1, group_size)
    mean = groups.mean(-1, keepdim=True)
    if kind == "grpo":
        adv = (groups - mean) / (groups.std(-1, keepdim=True) + 1e-6)
    else:
        adv = (groups - mean) * group_size / (group_size - 1)
    return adv.reshape(-1)


def _autocast(device_type: str, autocast: str) -> contextlib.AbstractContextManager[Any]:
    """train.autocast's context: torch.autocast in that dtype, or nothing ("none")."""
    if autocast == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPE_NAMES[autocast])


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    batch: Tokens,
    processor: LogitsProcessor,
    micro_batch_size: int,
    autocast: str = "none",
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer log-probs of the sampled tokens ``[B, L]``, with grad, plus the policy entropy
    per position. The logits go through the rollout's ``processor``. Off the response the
    log-probs are 0, as the rollout's are: a finished row's PAD tokens may lie outside the
    top-k / top-p set (log-prob -inf), and -inf there would make the masked loss NaN.

    ``autocast`` (train.autocast): the model's forward under ``torch.autocast`` in that dtype
    ("none": off); the processing stays fp32. ``entropy_grad``: the entropy with grad (an
    entropy bonus in the loss); otherwise it is computed under no_grad."""
    ids, attention = batch.sequences, batch.attention_mask
    size = micro_batch_size or ids.shape[0]
    logps, entropies = [], []
    for start in range(0, ids.shape[0], size):
        part = slice(start, start + size)
        with _autocast(ids.device.type, autocast):
            logits = model(
                input_ids=ids[part],
                attention_mask=attention[part],
                position_ids=generation_position_ids(attention[part]),
            ).logits[:, :-1]
        logits = processor.filter(logits)
        logps.append(processor.token_logprobs(logits, ids[part, 1:]))
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            logp_all = processor.log_probs(logits)
            entropies.append(-vocabulary_sums(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)))
    logp = torch.cat(logps)
    zeros = torch.zeros_like(logp[:, :1])
    logp = torch.where(batch.response_mask.bool(), torch.cat([zeros, logp], 1), 0.0)
    return logp, torch.cat([zeros, torch.cat(entropies)], 1)


def vocabulary_sums(values: torch.Tensor) -> torch.Tensor:
    """``values [..., V]`` summed over the vocabulary in bik.linear's fixed order (ascending
    entries, one fp32 chain): a token's sum has the same bits in any batch shape and on any
    thread count, which torch's sum, whose order follows the tensor's shape, does not give."""
    ones = values.new_ones(1, values.shape[-1])
    return bik.linear(values, ones)[..., 0]


def kept_rows(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """train.filter_groups: 1.0 for the rows of the prompt groups (``group_size``
    consecutive rows) whose rewards are not all equal, 0.0 for the others (zero GRPO / RLOO
    advantage: DAPO's dynamic-sampling filter, without resampling)."""
    groups = rewards.view(-1, group_size)
    varied = (groups != groups[:, :1]).any(-1)
    return varied.float().repeat_interleave(group_size)


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs, d = logp -
    ref_logp (train.kl_estimator): ``k1`` d, ``k2`` d^2 / 2, ``k3`` exp(-d) - 1 + d
    (unbiased and >= 0; unclamped, unlike verl's low_var_kl, as the mismatch metrics are).
    0 where both log-probs are 0 (off the response)."""
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"train.kl_estimator: unknown estimator {estimator!r}")


def mean_kl(batch: Batch, estimator: str) -> float:
    """``train/kl``: the mean over the batch's response tokens of the KL estimate between
    pi_old (``batch.train_logp``) and the reference (``batch.ref_logp``)."""
    kl = kl_per_token(batch.train_logp, _ref_logp(batch), estimator)
    return float(masked_mean(kl, batch.response_mask.float()))


def _ref_logp(batch: Batch) -> torch.Tensor:
    """``batch.ref_logp``, which train.kl_coef > 0 needs."""
    if batch.ref_logp is None:
        raise ValueError("batch.ref_logp: train.kl_coef > 0 needs the reference's log-probs")
    return batch.ref_logp


def _per_token(
    logp: torch.Tensor, old: torch.Tensor, a: torch.Tensor, cfg: Config
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-token loss before weighting, and PPO's clipped-or-not mask (None: REINFORCE)."""
    t = cfg.train
    if t.loss == "ppo":
        ratio = torch.exp(logp - old)
        clipped = ratio.clamp(1 - t.clip_low, 1 + t.clip_high)
        return -torch.minimum(ratio * a, clipped * a), ratio != clipped
    return -a * logp, None


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, how: str, sequences: int, horizon: int
) -> torch.Tensor:
    """One number from per-token losses ``loss [b, T]`` (0/1 ``mask``: the response tokens)
    of ``b`` of a mini-batch's ``sequences`` rows (all of them, or a rank's share: the shares'
    results add up to the mini-batch's). ``how`` (train.loss_agg): ``token_mean``, the mean
    over all the mini-batch's response tokens (``mask`` must then be all its rows);
    ``seq_mean_token_mean``, the mean over the sequences of each one's token mean;
    ``seq_mean_token_sum_norm`` (Dr. GRPO), the sum over ``sequences`` x ``horizon``
    (rollout.max_new_tokens)."""
    if how == "token_mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1)
    if how == "seq_mean_token_mean":
        per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / sequences
    if how == "seq_mean_token_sum_norm":
        return (loss * mask).sum() / (sequences * horizon)
    raise ValueError(f"unknown loss aggregation {how!r}")


@dataclass(frozen=True)
class Prepared:
    """What every update of a step reads, computed once from the whole batch (:func:`prepare`),
    or the rows of one mini-batch of it (:meth:`take`). All ``[B, L]`` but ``kept``."""

    old: torch.Tensor  # pi_old: the trainer's log-probs before any update (remedy.bypass: the
    # rollout's)
    adv: torch.Tensor  # each row's advantage, at every position
    weights: torch.Tensor  # the remedy's token weights (over the whole batch)
    mask: torch.Tensor  # float: the response tokens of the rows train.filter_groups keeps
    kept: torch.Tensor  # [B] float: 1 for a kept row
    ref: torch.Tensor | None  # the reference's log-probs (train.kl_coef > 0), else None
    current: torch.Tensor  # the policy's log-probs now, detached (before any update: pi_old)
    remedy_stats: dict[str, float]  # the remedy's metrics, the whole batch's

    def take(self, select: slice | None, current: torch.Tensor | None = None) -> Prepared:
        """The rows ``select`` (None: all), at the current policy's log-probs of those rows
        (None: no update yet, pi_old)."""
        rows = select or slice(None)
        cut = {
            name: getattr(self, name)[rows]
            for name in ("old", "adv", "weights", "mask", "kept", "current")
        }
        if current is not None:
            cut["current"] = current
        ref = None if self.ref is None else self.ref[rows]
        return Prepared(**cut, ref=ref, remedy_stats=self.remedy_stats)


def prepare(batch: Batch, adv: torch.Tensor, cfg: Config) -> Prepared:
    """The step's :class:`Prepared` record: pi_old, the advantages, the remedy's weights and
    stats (a whole-batch quantity: once per step, not once per update), the mask of the kept
    rows (``batch.kept``, train.filter_groups) and the reference's log-probs
    (``batch.ref_logp``, needed when train.kl_coef > 0)."""
    mask = batch.response_mask.float()
    pi_old = batch.train_logp
    weights, _, stats = remedies.weights(cfg.remedy, pi_old, batch.rollout_logp, mask)
    kept = torch.ones(mask.shape[0]) if batch.kept is None else batch.kept
    return Prepared(
        old=batch.rollout_logp if cfg.remedy.bypass else pi_old,
        adv=adv[:, None].expand_as(pi_old),
        weights=weights,
        mask=mask * kept[:, None],
        kept=kept,
        ref=_ref_logp(batch) if cfg.train.kl_coef else None,
        current=pi_old,
        remedy_stats=stats,
    )


def policy_loss(
    train_logp: torch.Tensor,
    part: Prepared,
    cfg: Config,
    rows: slice | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one update over the mini-batch ``part`` (:meth:`Prepared.take`) and its
    stats. PPO-clip (asymmetric) or REINFORCE, weighted by the remedy, plus train.kl_coef x
    the KL to the reference and minus train.entropy_coef x the entropy (each term only when
    its coefficient is > 0), each aggregated by train.loss_agg (:func:`aggregate`) over the
    kept rows' tokens.

    ``train_logp`` and ``entropy`` (the per-position entropy, needed when
    train.entropy_coef > 0) are the rows ``rows`` of the mini-batch (default all) with grad:
    a data-parallel rank's share; the loss returned is that share's part of the mini-batch's
    loss (the shares' losses add up to the mini-batch's). The stats (``loss``: the
    mini-batch's policy-gradient term; ``ppo/clip_frac``, ``ppo/ratio_max``,
    ``ppo/ratio_min``: over its kept response tokens, at ``part.current``) are the
    mini-batch's."""
    t = cfg.train
    rows = rows or slice(None)
    mask, old, a, w = part.mask, part.old, part.adv, part.weights
    how, horizon = t.loss_agg, cfg.rollout.max_new_tokens
    sequences = max(int(part.kept.sum()), 1)  # the mini-batch's kept sequences
    tokens = mask.sum().clamp(min=1)  # token_mean: the mini-batch's, whichever rows a rank holds

    def share_of(per_token: torch.Tensor) -> torch.Tensor:
        """This share's part of the mini-batch's aggregate of ``per_token`` (rows ``rows``)."""
        if how == "token_mean":
            return (per_token * mask[rows]).sum() / tokens
        return aggregate(per_token, mask[rows], how, sequences, horizon)

    stats: dict[str, float] = {}
    with torch.no_grad():
        per_token, clipped = _per_token(part.current, old, a, cfg)
        stats["ppo/clip_frac"] = (
            0.0
            if clipped is None
            else float((clipped.float() * mask).sum() / mask.sum().clamp(min=1))
        )
        valid = mask.bool()
        ratio = torch.exp(part.current - old)[valid]
        stats["ppo/ratio_max"] = float(ratio.max()) if valid.any() else 1.0
        stats["ppo/ratio_min"] = float(ratio.min()) if valid.any() else 1.0
        stats["loss"] = float(aggregate(per_token * w, mask, how, sequences, horizon))
    share, _ = _per_token(train_logp, old[rows], a[rows], cfg)
    loss = share_of(share * w[rows])
    if t.kl_coef:
        assert part.ref is not None  # prepare() refuses a KL term without the reference
        loss = loss + t.kl_coef * share_of(kl_per_token(train_logp, part.ref[rows], t.kl_estimator))
    if t.entropy_coef:
        assert entropy is not None, "train.entropy_coef > 0 needs the entropy with grad"
        loss = loss - t.entropy_coef * share_of(entropy)
    return loss, stats


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
