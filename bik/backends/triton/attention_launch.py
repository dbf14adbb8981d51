"""The host side of bik's Triton attention (its kernels and their reduction order:
:mod:`bik.backends.triton.attention`): the choices a launch may take, which all give the same
bits (:class:`AttentionChoices`, resolved once a launch by :func:`resolve_choices`, which owns
the device self-check), the launches' arguments, and the entry points :func:`attention` and
:func:`paged_attention`.
"""

from typing import Any, NamedTuple

import torch

from ..base import AttentionOptions
from ._common import (
    ALIGNMENT,
    I32,
    Launch,
    SelfCheck,
    aligned,
    alignments,
    cdiv,
    next_power_of_2,
    tma_descriptor,
    upcast_dot_operands,
)
from .attention import (
    BLOCK_M,
    BLOCK_N,
    COMBINE_BLOCK_DV,
    FP32_BLOCK_M,
    FP32_NUM_WARPS,
    MAX_BLOCK_DV,
    NUM_STAGES,
    NUM_WARPS,
    _attention_kernel,
    _combine_kernel,
    rescale_acc,
)

SPLIT_PARALLEL_MAX_PROGRAMS = 512
"""Split-parallel only while batch x kv heads is below this (otherwise the in-register path
has programs enough to fill a GPU)."""
SPLIT_PARALLEL_MAX_BYTES = 256 * 2**20
"""Split-parallel only while its fp32 workspace stays below this."""


def _kv_takes_tma(k, v, unit: int) -> bool:
    """Whether TMA can read these ``[B, Hkv, Tk, D]`` keys and values, given the stride unit
    of the launch (:func:`_stride_unit`: 16 bytes exactly when every batch, head and position
    stride of q, k, v and out is a multiple of 16 bytes): 16-bit (fp32 keeps its FMA dots'
    register operands), not empty (a descriptor has no zero-size dim), a contiguous last dim
    (the bases are :func:`aligned` already). Read from facts the launch has anyway: it runs
    at every decode step of every layer."""
    return (
        k.element_size() == 2
        and unit * 2 == ALIGNMENT
        and k.stride(3) == 1
        and v.stride(3) == 1
        and k.numel() > 0
    )


FAST_CHOICES_CHECK = SelfCheck(
    "keys and values by TMA and unmasked whole key blocks (pointer loads and every block "
    "masked are the plain launch)"
)


def _fast_choices_checked(dtype, d: int, device: torch.device) -> bool:
    return FAST_CHOICES_CHECK.allows(
        (dtype, d), device, lambda: fast_choices_agree(dtype, d, device)
    )


def fast_choices_agree(dtype, d: int, device: torch.device) -> bool:
    """Whether the 16-bit kernel's fast choices (keys and values by TMA, no mask on the key
    blocks a tile sees whole) give the plain launch's bits (pointer loads, every block
    masked) for this dtype and head dim on ``device``: a causal GQA prefill of two sequences
    with their own first keys (tile tails, several splits, whole and partial blocks) in
    registers, and its last token's split-parallel decode."""
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    q, k, v = randn(2, 4, 70, d), randn(2, 2, 300, d), randn(2, 2, 300, d)
    kv_start = torch.tensor([0, 17], dtype=torch.int32, device=device)
    options = AttentionOptions(True, d**-0.5, 64)
    for query in (q, q[:, :, -1:]):
        args = (query, k, v, kv_start, options)
        fast = attention(*args, tma_kv=True, mask_every_block=False)
        if not torch.equal(fast, attention(*args, tma_kv=False, mask_every_block=True)):
            return False
    return True


def _stride_unit(*tensors):
    """Elements per 16 bytes when every batch / head / position stride is a multiple of it,
    else 1. Strides are passed divided by it (unspecialised) and multiplied back in the
    kernel, so the compiler still knows rows start 16-byte aligned. In the usual layouts each
    of these strides is a multiple of the head dim, so the unit depends on D and the dtype,
    never on the sequence lengths."""
    unit = 16 // tensors[0].element_size()
    if all(s % unit == 0 for t in tensors for s in t.stride()[:3]):
        return unit
    return 1


class AttentionTile(NamedTuple):
    """Query rows a program (``block_m``), its warps and its pipeline stages."""

    block_m: int
    num_warps: int
    num_stages: int


def shipped_tile(dtype) -> AttentionTile:
    """The tile of both paths: a function of the dtype only (so the same dot layout and
    reduction trees for prefill and decode)."""
    if dtype == torch.float32:
        return AttentionTile(FP32_BLOCK_M, FP32_NUM_WARPS, NUM_STAGES)
    return AttentionTile(BLOCK_M, NUM_WARPS, NUM_STAGES)


def _use_split_parallel(batch, hkv, rows, n_splits, d, block_m=BLOCK_M):
    """The split-parallel path for few query rows (one tile per batch x kv head: decode,
    short chunks) while the in-register path would leave a GPU idle and the workspace is
    small. Either path gives the same bits; this only chooses the faster."""
    workspace = batch * hkv * n_splits * rows * (d + 2) * 4
    return (
        rows <= block_m
        and n_splits > 1
        and batch * hkv < SPLIT_PARALLEL_MAX_PROGRAMS
        and workspace <= SPLIT_PARALLEL_MAX_BYTES
    )


class AttentionChoices(NamedTuple):
    """How one launch computes: every combination gives the same bits (the tests force each).

    tile: query rows a program, warps, stages (:func:`shipped_tile`, or a
    candidate of :mod:`bik.testing.attention_candidates`); split_parallel: the split
    states in a workspace folded by a second kernel (else in registers); tma_kv: keys and
    values by TMA (else pointer loads); mask_every_block: no key block skips its mask (else a
    block every row of the tile sees whole does); rescale_acc: the accumulator's rescale after
    a key block (the kernel's :func:`~.attention.rescale_acc`, or a candidate)."""

    tile: AttentionTile
    split_parallel: bool
    tma_kv: bool
    mask_every_block: bool
    rescale_acc: Any


def resolve_choices(
    q,
    k,
    v,
    unit: int,
    batch: int,
    rows: int,
    n_splits: int,
    paged: bool,
    *,
    split_parallel: bool | None = None,
    tile: AttentionTile | None = None,
    tma_kv: bool | None = None,
    mask_every_block: bool | None = None,
    rescale_acc: Any = rescale_acc,
) -> AttentionChoices:
    """The choices of a launch over ``batch`` sequences (k's kv heads each) of ``rows`` query
    rows and ``n_splits`` splits: those given, the others (None) chosen here. ``split_parallel``:
    :func:`_use_split_parallel`. The 16-bit fast choices, TMA keys and values (where
    :func:`_kv_takes_tma` allows and the cache is not ``paged``) and unmasked whole blocks,
    once :func:`fast_choices_agree` has passed for the dtype and head dim on the device (asked
    only when one of them is left to choose); fp32 takes neither (its FMA dots keep their
    operands in registers, and spill with the mask's branch)."""
    d = q.shape[3]
    tile = tile or shipped_tile(q.dtype)
    if split_parallel is None:
        split_parallel = _use_split_parallel(batch, k.shape[1], rows, n_splits, d, tile.block_m)
    fast = (
        q.dtype != torch.float32
        and (tma_kv is None or mask_every_block is None)
        and _fast_choices_checked(q.dtype, d, q.device)
    )
    if tma_kv is None:
        tma_kv = fast and not paged and _kv_takes_tma(k, v, unit)
    elif tma_kv and (paged or not _kv_takes_tma(k, v, unit)):
        raise ValueError("tma_kv: TMA cannot read these keys and values (see _kv_takes_tma)")
    if mask_every_block is None:
        mask_every_block = not fast
    return AttentionChoices(tile, split_parallel, tma_kv, mask_every_block, rescale_acc)


def _strides(q, k, v, out, unit: int) -> dict[str, int]:
    """Every tensor's strides by name (``sqb``, ``skh``, ...): the batch, head and position
    strides in units of ``unit`` elements (:func:`_stride_unit`), the head dim's as it is."""
    strides = {}
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        for axis, s in zip("bhtd", t.stride()):
            strides[f"s{name}{axis}"] = s if axis == "d" else s // unit
    return strides


def _paging(pages, out, strides: dict[str, int]) -> tuple[dict[str, Any], Any]:
    """The paged cache's kernel arguments and the sequence lengths' pointer (unused pointers
    point at the output); a packed step's sequences share q and out: no batch stride."""
    if pages is None:
        return dict(block_table_ptr=out, query_start_ptr=out, stable=0, VARLEN=False), out
    table, query_start, seq_lens = pages
    paging = dict(block_table_ptr=table, query_start_ptr=out, stable=table.stride(0))
    paging.update(VARLEN=query_start is not None)
    if query_start is not None:
        strides.update(sqb=0, sob=0)
        paging.update(query_start_ptr=query_start)
    return paging, seq_lens


def _workspace(split_parallel: bool, programs: int, n_splits: int, rows: int, d: int, out):
    """The split-parallel path's fp32 split states (accumulators, maxima, sums) on out's
    device; the in-register path has none (the unused pointers point at the output)."""
    if not split_parallel:
        return out, out, out
    f32 = dict(dtype=torch.float32, device=out.device)
    return (
        torch.empty(programs, n_splits, rows, d, **f32),
        torch.empty(programs, n_splits, rows, **f32),
        torch.empty(programs, n_splits, rows, **f32),
    )


def attention_launches(
    q,
    k,
    v,
    kv_start,
    out,
    options: AttentionOptions,
    sinks=None,
    *,
    pages=None,
    **choices: Any,
) -> list[Launch]:
    """The launches computing ``out = attention(q, k, v)`` (arguments as :func:`attention`;
    tensors already :func:`aligned`). ``choices``: any of :class:`AttentionChoices`' fields
    (``split_parallel``, ``tile``, ``tma_kv``, ``mask_every_block``,
    ``rescale_acc``), the others chosen by :func:`resolve_choices`. The
    split-parallel workspace is allocated here, on q's device (meta tensors give meta
    launches for bik.testing.sm90).

    ``pages`` = (block_table, query_start, seq_lens): a step over a paged cache (see
    :func:`paged_attention`): k and v are the caches ``[num_blocks, Hkv, block_size, D]``;
    q and out are ``[S, Hq, 1, D]`` views of a decode step's tokens (``query_start`` None),
    or ``[1, Hq, T, D]`` views of a packed step's (a program per sequence and kv head, tiles
    for the longest query possible, the in-register path)."""
    batch, hq, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    groups = hq // hkv
    rows = tq * groups
    split_size, window, softcap = options.split_size, options.window, options.softcap
    n_splits = cdiv(tk, split_size)  # enough for a row whose first key is 0
    if pages is not None:
        n_splits = cdiv(pages[0].shape[1] * tk, split_size)  # the longest sequence's
        if pages[1] is not None:
            batch, choices["split_parallel"] = pages[2].shape[0], False
    unit = _stride_unit(q, k, v, out)
    paged = pages is not None
    chosen = resolve_choices(q, k, v, unit, batch, rows, n_splits, paged, **choices)
    tile, split_parallel = chosen.tile, chosen.split_parallel
    tiles = cdiv(rows, tile.block_m)
    block_d = max(16, next_power_of_2(d))
    block_dv = min(block_d, MAX_BLOCK_DV)
    programs = batch * hkv * (block_d // block_dv)  # (batch, kv head, chunk of value dims)
    common = dict(
        kv_start_ptr=kv_start,
        out_ptr=out,
        PAGE_SIZE=0 if pages is None else tk,
        Hkv=hkv,
        GROUPS=groups,
        Tq=tq,
        Tk=tk,
        n_splits=n_splits,
        split_size=split_size,
        window=0 if window is None else window,
        CAUSAL=options.causal,
        WINDOW=window is not None,
        sinks_ptr=out if sinks is None else sinks,  # (unused without sinks)
        SINKS=sinks is not None,
        UNIT=unit,
        BLOCK_M=tile.block_m,
        BLOCK_N=BLOCK_N,
        D=d,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
    )
    strides = _strides(q, k, v, out, unit)
    paging, seq_lens_ptr = _paging(pages, out, strides)
    ws_acc, ws_max, ws_sum = _workspace(split_parallel, batch * hkv, n_splits, rows, d, out)
    pointers = [q, k, v, kv_start, out, common["sinks_ptr"], ws_acc, ws_max, ws_sum]
    pointers += [paging["block_table_ptr"], paging["query_start_ptr"], seq_lens_ptr]
    unspecialised = [tq, tk, n_splits, paging["stable"]]
    unspecialised += [strides[f"s{t}{axis}"] for t in "qkvo" for axis in "bht"]
    # What decides both kernels' binaries (LaunchPlans: cheaper than a walk over 50 arguments)
    plan_key = (
        options,  # causal, scale, split size, softcap, window
        tuple(t.dtype for t in pointers),
        alignments(*pointers),
        (
            hkv,
            groups,
            d,
            unit,
            split_parallel,
            sinks is None,
            paging["VARLEN"],
            common["PAGE_SIZE"],
            chosen.tma_kv,
            chosen.mask_every_block,
            chosen.rescale_acc,
        ),
        tuple(strides[f"s{t}d"] for t in "qkvo"),  # specialised on (1 in the usual layouts)
        all(value in I32 for value in unspecialised),
    )
    pinned: dict[str, Any] = dict(
        num_warps=tile.num_warps, num_stages=tile.num_stages, plan_key=(tile, plan_key)
    )
    launches = [
        Launch(
            _attention_kernel,
            (tiles, programs, n_splits if split_parallel else 1),
            dict(
                q_ptr=q,
                k_ptr=k,
                v_ptr=v,
                k_desc=tma_descriptor(k, [1, 1, BLOCK_N, block_d]) if chosen.tma_kv else k,
                v_desc=tma_descriptor(v, [1, 1, BLOCK_N, block_dv]) if chosen.tma_kv else v,
                TMA_KV=chosen.tma_kv,
                WHOLE_BLOCKS=not chosen.mask_every_block,
                RESCALE_ACC=chosen.rescale_acc,
                ws_acc_ptr=ws_acc,
                ws_max_ptr=ws_max,
                ws_sum_ptr=ws_sum,
                scale=options.scale,
                softcap=1.0 if softcap is None else softcap,
                **strides,
                SOFTCAP=softcap is not None,
                UPCAST=upcast_dot_operands(q.dtype),
                SPLIT_PARALLEL=split_parallel,
                seq_lens_ptr=seq_lens_ptr,
                **paging,
                **common,
            ),
            **pinned,
        )
    ]
    if split_parallel:
        combine_dv = min(block_d, COMBINE_BLOCK_DV)
        launches.append(
            Launch(
                _combine_kernel,
                (tiles, batch * hkv * (block_d // combine_dv)),
                dict(
                    ws_acc_ptr=ws_acc,
                    ws_max_ptr=ws_max,
                    ws_sum_ptr=ws_sum,
                    seq_lens_ptr=seq_lens_ptr,
                    **{f"so{axis}": strides[f"so{axis}"] for axis in "bhtd"},
                    **{**common, "BLOCK_DV": combine_dv},
                ),
                **pinned,
            )
        )
    return launches


def attention(q, k, v, kv_start, options: AttentionOptions, sinks=None, **choices):
    """See bik.ops.attention: ``q [B, Hq, Tq, D]``, ``k, v [B, Hkv, Tk, D]``
    -> ``[B, Hq, Tq, D]``; ``sinks`` (fp32 ``[Hq]``) None: off. ``choices``
    (``split_parallel``, ``tile``, ``tma_kv``, ``mask_every_block``,
    ``rescale_acc``): see
    :func:`attention_launches` (the bits are the same either way)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q, k, v, kv_start = (aligned(t) for t in (q, k, v, kv_start))
    sinks = None if sinks is None else aligned(sinks)
    for launch in attention_launches(q, k, v, kv_start, out, options, sinks, **choices):
        launch()
    return out


def paged_attention(
    query,
    key_cache,
    value_cache,
    block_table,
    query_start,
    seq_lens,
    options: AttentionOptions,
    sinks=None,
):
    """See bik.layers.paged_attention: packed queries ``[T, Hq, D]`` of the sequences
    ``query_start`` (int32 ``[S + 1]``) over the caches ``[num_blocks, Hkv, block_size, D]``
    through ``block_table`` (int32 ``[S, pages]``), ``seq_lens`` (int32 ``[S]``) keys each.
    Every sequence runs :func:`attention`'s tiles, key blocks and splits from its first key,
    so its rows get the bits of attention over its keys made contiguous. A decode step (one
    token per sequence, T == S: known from the shapes, no host sync) runs as a batch of S
    one-token queries and may take the split-parallel path; any other step is one launch of
    the in-register path over the packed queries."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    block_table, seq_lens = aligned(block_table), aligned(seq_lens)
    if query.shape[0] == seq_lens.shape[0]:  # [S, Hq, 1, D]
        starts, (q, o) = None, (aligned(t).unsqueeze(2) for t in (query, out))
    else:  # [1, Hq, T, D]
        starts, (q, o) = (
            aligned(query_start),
            (aligned(t).transpose(0, 1)[None] for t in (query, out)),
        )
    for launch in attention_launches(
        q,
        aligned(key_cache),
        aligned(value_cache),
        torch.zeros_like(seq_lens),  # every sequence's keys start at 0
        o,
        options,
        None if sinks is None else aligned(sinks),
        pages=(block_table, starts, seq_lens),
    ):
        launch()
    return out
