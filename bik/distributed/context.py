"""Context parallelism for a bik-patched model's forward: one sequence split across ranks, each
rank's positions with the bits one process gives them.

Rank r of C holds positions r·S/C .. (r+1)·S/C − 1 of every row (:func:`context_shard`). Every
layer but attention computes each position alone (bik's linears, norms and experts are
row-wise), so only attention needs the other ranks: in each attention layer the ranks' keys
and values are all-gathered, in rank order, and rank r attends over the keys of ranks 0 .. r,
its queries the last of them (a chunked prefill whose cache is the earlier ranks' keys).
bik.attention counts its key blocks and splits from the row's first key, whoever holds the
queries, so each query reduces the same blocks in the same order as in one process: the
logits of a rank's positions are the one-process logits of those positions, bit for bit.
(A ring of partial softmaxes merged by their log-sum-exp, torch's context parallelism, adds
roundings one process does not have.)

Backward: each rank's keys and values get the gradients every rank's queries sent them,
gathered and summed in rank order: deterministic, equal at every rerun; not the one-process
bits (those sums run in other pieces).

Rows are unpadded and of equal length, a multiple of C; recurrent layers (linear attention,
state spaces), whose state runs through the whole sequence, and sliding windows are refused.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..contract import tp_tree_sum
from ..families import FAMILIES
from .chunked import _all_gather

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class _Active(threading.local):
    """The group of the context-parallel forward running in this thread (a rank per thread
    under torch's in-process process group), or None."""

    group: ProcessGroup | None = None


_ACTIVE = _Active()


class _GatherKeys(torch.autograd.Function):
    """The ranks' key (or value) chunks ``[B, H, S/C, D]`` along the sequence, ranks 0 .. r.
    Backward: every rank's gradient of the gathered keys, this rank's chunk summed over the
    ranks in rank order by the pairwise tree."""

    @staticmethod
    def forward(ctx: Any, chunk: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.length = group, dist.get_rank(group), chunk.shape[2]
        ctx.world = dist.get_world_size(group)
        return torch.cat(_all_gather(chunk, group)[: ctx.rank + 1], dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        missing = (ctx.world - ctx.rank - 1) * ctx.length  # keys this rank's queries never saw
        whole = torch.nn.functional.pad(grad, (0, 0, 0, missing))
        mine = slice(ctx.rank * ctx.length, (ctx.rank + 1) * ctx.length)
        parts = [g[:, :, mine].float() for g in _all_gather(whole, ctx.group)]
        return tp_tree_sum(parts).to(grad.dtype), None


def active_group() -> ProcessGroup | None:
    """The process group of the context-parallel forward running, or None."""
    return _ACTIVE.group


def gather_keys(
    key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention layer's keys and values of ranks 0 .. r (see the module doc), after
    checking that ``position_ids`` number this rank's positions."""
    group = _ACTIVE.group
    assert group is not None  # called by bik's attention under context_parallel only
    length, rank = key.shape[2], dist.get_rank(group)
    first = rank * length
    expected = torch.arange(first, first + length, device=key.device)
    if position_ids is None or not torch.equal(
        position_ids.to(key.device), expected.expand_as(position_ids)
    ):
        raise ValueError(
            f"bik context parallelism: rank {rank} holds positions {first} .. "
            f"{first + length - 1}; pass them as position_ids (bik.distributed.context_shard)"
        )
    return _GatherKeys.apply(key, group), _GatherKeys.apply(value, group)


def _check_model(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if getattr(model, "_bik_patch", None) is None or family is None:
        raise ValueError(
            "model: expected a Hugging Face causal LM patched with bik.patch_model, got "
            f"{type(model).__name__}"
        )
    if family.recurrent is not None:
        raise ValueError(
            f"model: {model_type!r} has recurrent layers, whose state runs through the whole "
            "sequence: context parallelism splits attention only"
        )
    windows = [getattr(config, key, None) for key in ("sliding_window", "attention_chunk_size")]
    if any(isinstance(w, int) and w > 0 for w in windows):
        raise ValueError(
            f"model: {model_type!r} has a sliding window, which bik's context "
            "parallelism does not take"
        )


@contextlib.contextmanager
def context_parallel(model: nn.Module, group: ProcessGroup | None = None) -> Iterator[None]:
    """Run ``model``'s forwards inside as one context-parallel forward over ``group`` (None:
    the default group): each rank passes its positions (:func:`context_shard`) and gets their
    logits, the one-process bits (see the module doc). ValueError for a model bik cannot
    split (unpatched, recurrent layers, a sliding window)."""
    _check_model(model)
    group = group if group is not None else dist.group.WORLD
    if _ACTIVE.group is not None:
        raise RuntimeError("bik.distributed.context_parallel: already inside one")
    _ACTIVE.group = group
    try:
        yield
    finally:
        _ACTIVE.group = None


def context_shard(
    input_ids: torch.Tensor, group: ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's positions of ``input_ids [B, S]`` (unpadded rows, S a multiple of the
    group's size): ``(input_ids[:, chunk], position_ids)``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if input_ids.ndim != 2 or input_ids.shape[1] % world:
        raise ValueError(
            f"input_ids: expected [B, S] with S a multiple of the {world} ranks, got shape "
            f"{tuple(input_ids.shape)}"
        )
    length = input_ids.shape[1] // world
    positions = torch.arange(rank * length, (rank + 1) * length, device=input_ids.device)
    return input_ids[:, rank * length : (rank + 1) * length], positions.expand(
        input_ids.shape[0], length
    )
