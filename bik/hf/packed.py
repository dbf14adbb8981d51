"""Packed sequences (several sequences in one row, positions restarting: TRL's
``padding_free``, verl's ``use_remove_padding``) through bik's attention, each sequence with
the bits it gets alone.

A packed forward reaches the attention function in one of two forms: transformers' mask,
block-diagonal and causal within each block (built from position ids that restart, when no
cache is passed), or flash-attention's varlen keywords (``cu_seq_lens_q`` / ``_k``: the
sequences' boundaries in a single row). :func:`segments` reads the sequences off either (the
two must agree when both come). :func:`stack` then gives each sequence a row of its own,
starting at its first token and right-padded to the longest: bik's attention of a row depends
on its own keys only and a query never sees the padding after it, so every sequence gets the
bits of a forward of it alone. :func:`unstack` puts the outputs back in place.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

Segment = tuple[int, int, int]  # (row, first token, one past the last)

# (weakrefs to the mask and the varlen bounds, their versions and the shape, the segments):
# every layer of a forward gets the same tensors, so the sequences are read once a forward
_last: list[tuple[tuple[Any, ...], tuple[Any, ...], list[Segment] | None] | None] = [None]


def segments(
    mask: torch.Tensor | None, kwargs: dict[str, Any], batch: int, tq: int, tk: int
) -> list[Segment] | None:
    """The packed sequences of a forward (None: not packed), read once a forward. Raises
    where packing is not whole rows of whole sequences without a cache, or where the mask
    and the varlen keywords disagree."""
    tensors = (mask, kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"))
    key = (batch, tq, tk, *(None if t is None else t._version for t in tensors))
    cached = _last[0]  # one read: the entry is replaced whole, never edited
    if (
        cached is not None
        and cached[1] == key
        and all((t is None) if r is None else (r() is t) for r, t in zip(cached[0], tensors))
    ):
        return cached[2]
    found = _segments(*tensors, batch, tq, tk)
    _last[0] = (tuple(None if t is None else weakref.ref(t) for t in tensors), key, found)
    return found


def _segments(
    mask: torch.Tensor | None,
    bounds: torch.Tensor | None,
    key_bounds: torch.Tensor | None,
    batch: int,
    tq: int,
    tk: int,
) -> list[Segment] | None:
    from_mask = mask_segments(mask, batch, tq, tk) if mask is not None else None
    if bounds is None:
        return from_mask
    if key_bounds is not None and not torch.equal(key_bounds.cpu(), bounds.cpu()):
        raise NotImplementedError(
            "bik attention: cu_seq_lens_k differs from cu_seq_lens_q (queries packed apart "
            "from their keys); bik packs whole sequences only"
        )
    cuts = [int(c) for c in bounds.tolist()]
    if batch != 1 or tq != tk or cuts[0] != 0 or cuts[-1] != tq or cuts != sorted(set(cuts)):
        raise NotImplementedError(
            f"bik attention: cu_seq_lens_q={cuts} does not cut one row of {tq} tokens (batch "
            f"{batch}, {tk} keys) into whole sequences; pack without a cache, one row"
        )
    found = [(0, a, b) for a, b in itertools.pairwise(cuts)]
    if from_mask is not None and from_mask != found:
        raise NotImplementedError(
            "bik attention: the attention mask and cu_seq_lens_q pack different sequences"
        )
    return found


def mask_segments(mask: torch.Tensor, batch: int, tq: int, tk: int) -> list[Segment] | None:
    """The sequences of a block-diagonal causal mask (a bool [B, 1, Tq, Tk] of keys to attend,
    or an additive one), None where no row holds two sequences: a plain causal or padding
    mask, which bik's attention reads as it is."""
    if tq != tk:
        return None  # a cache: decode steps and later chunks are never packed
    allowed = mask if mask.dtype == torch.bool else mask == 0
    allowed = allowed[:, 0].expand(batch, tq, tk)
    first = allowed.int().argmax(-1)  # [B, Tq]: each query's first visible key
    queries = torch.arange(tq, device=first.device)
    starts = first == queries  # a query that sees nothing before itself begins a sequence
    if int(starts.sum()) <= batch or not bool(allowed.any(-1).all()):
        return None  # one sequence a row, or rows of padding: not a packed forward
    block = torch.cummax(torch.where(starts, queries, 0), dim=-1).values  # each query's start
    expected = (queries[None, None, :] >= block[..., None]) & (
        queries[None, None, :] <= queries[None, :, None]
    )
    if not torch.equal(allowed, expected):
        raise NotImplementedError(
            "bik attention: a packed mask (a query that sees no key before itself inside a "
            "row) that is not causal within whole sequences; pack whole sequences, each "
            "starting at position 0"
        )
    found = []
    for row in range(batch):
        cuts = [int(q) for q in queries[starts[row]].tolist()] + [tq]
        found += [(row, a, b) for a, b in itertools.pairwise(cuts)]
    return found


def stack(tensor: torch.Tensor, found: list[Segment]) -> torch.Tensor:
    """``tensor`` [B, H, T, D] as one row per sequence [S, H, L, D], each from its first
    token, right-padded with zeros to the longest L."""
    longest = max(b - a for _, a, b in found)
    rows = [
        torch.nn.functional.pad(tensor[row, :, a:b], (0, 0, 0, longest - (b - a)))
        for row, a, b in found
    ]
    return torch.stack(rows)


def unstack(stacked: torch.Tensor, found: list[Segment], batch: int, length: int) -> torch.Tensor:
    """The inverse of :func:`stack` on an output [S, H, L, D]: [B, H, T, D]."""
    out = stacked.new_zeros(batch, stacked.shape[1], length, stacked.shape[3])
    for i, (row, a, b) in enumerate(found):
        out[row, :, a:b] = stacked[i, :, : b - a]
    return out
