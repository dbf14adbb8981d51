"""Triton attention internals: the in-register and the split-parallel path give the same bits,
GQA-packed decode equals prefill, prefill has no workspace, both paths are accurate."""

import importlib

import pytest

pytest.importorskip("triton")

import torch
from conftest import DEVICE, invariant_backends
from helpers import DTYPES, assert_bitwise, assert_close_to_reference, randn
from hypothesis import given
from hypothesis import strategies as st

from bik.backends import reference
from bik.backends.base import AttentionOptions
from bik.backends.triton.attention import BLOCK_M
from bik.backends.triton.attention_launch import (
    _use_split_parallel,
    attention,
    attention_launches,
)
from bik.testing.attention_candidates import PREFILL_CANDIDATES, rescale_when_max_moved

pytestmark = pytest.mark.skipif(
    "triton" not in invariant_backends(), reason="the triton backend cannot run here"
)
launcher = importlib.import_module("bik.backends.triton.attention_launch")
common = importlib.import_module("bik.backends.triton._common")

SOFTCAPS = st.sampled_from([None, 1.5, 30.0])
WINDOWS = st.sampled_from([None, 1, 5, 17, 40])


def inputs(batch, hkv, groups, tq, tk, dim, dtype, seed):
    q = randn((batch, hkv * groups, tq, dim), dtype, seed)
    k = randn((batch, hkv, tk, dim), dtype, seed + 1)
    v = randn((batch, hkv, tk, dim), dtype, seed + 2)
    return q, k, v


def both_paths(q, k, v, causal, scale, kv_start, split, softcap=None, window=None, sinks=None):
    args = (q, k, v, kv_start, AttentionOptions(causal, scale, split, softcap, window), sinks)
    return attention(*args, split_parallel=False), attention(*args, split_parallel=True)


@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.integers(1, 2),
    hkv=st.integers(1, 2),
    groups=st.sampled_from([1, 2, 3, 4, 8]),
    tq=st.integers(1, 90),
    extra=st.integers(0, 100),
    dim=st.sampled_from([8, 12, 16, 40]),  # 12: bf16 strides not 16-byte multiples (UNIT 1)
    split=st.sampled_from([32, 64]),  # several splits: their merge order shows in the bits
    causal=st.booleans(),
    softcap=SOFTCAPS,
    window=WINDOWS,
    sinks=st.booleans(),
    data=st.data(),
)
def test_in_register_and_split_parallel_paths_give_the_same_bits(
    dtype, batch, hkv, groups, tq, extra, dim, split, causal, softcap, window, sinks, data
):
    # Random shapes: Tq * G rows end anywhere inside a 64-row tile (tile tails), rows of a
    # tile span several query positions and heads, each batch row has its own first key.
    tk = tq + extra
    q, k, v = inputs(batch, hkv, groups, tq, tk, dim, dtype, seed=tq * 7 + extra)
    starts = data.draw(st.lists(st.integers(0, tk - 1), min_size=batch, max_size=batch))
    kv_start = torch.tensor(starts, dtype=torch.int32, device=q.device)
    logits = randn((hkv * groups,), torch.float32, tq, scale=2.0) if sinks else None
    in_registers, split_parallel = both_paths(
        q, k, v, causal, 0.3, kv_start, split, softcap, window if causal else None, logits
    )
    assert_bitwise(split_parallel, in_registers, "split-parallel vs in-register")


@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    tile=st.sampled_from(PREFILL_CANDIDATES),
    groups=st.sampled_from([1, 3, 4]),
    tq=st.integers(1, 90),
    extra=st.integers(0, 100),
    causal=st.booleans(),
    window=WINDOWS,
    sinks=st.booleans(),
    data=st.data(),
)
def test_a_candidate_prefill_tile_gives_the_shipped_tiles_bits(
    dtype, tile, groups, tq, extra, causal, window, sinks, data
):
    # Rows end anywhere inside a 128-row tile and its second warpgroup's 64 rows.
    tk = tq + extra
    q, k, v = inputs(2, 2, groups, tq, tk, 16, dtype, seed=tq * 5 + extra)
    starts = data.draw(st.lists(st.integers(0, tk - 1), min_size=2, max_size=2))
    kv_start = torch.tensor(starts, dtype=torch.int32, device=q.device)
    logits = randn((2 * groups,), torch.float32, tq, scale=2.0) if sinks else None
    options = AttentionOptions(causal, 0.3, 32, None, window if causal else None)
    shipped = attention(q, k, v, kv_start, options, logits, split_parallel=False)
    for split_parallel in (False, True):
        got = attention(
            q, k, v, kv_start, options, logits, split_parallel=split_parallel, tile=tile
        )
        assert_bitwise(got, shipped, f"{tile}, split-parallel {split_parallel}")


# Launch choices that must keep the shipped kernel's bits: keys and values by pointer loads
# instead of TMA boxes, every key block masked (the shipped 16-bit kernel skips the mask of a
# block all its rows see whole), and the accumulator rescaled only after a block that gave
# some row of the tile a new maximum.
SAME_BITS_CHOICES = [
    {"tma_kv": False},
    {"mask_every_block": True},
    {"rescale_acc": rescale_when_max_moved},
]


@pytest.mark.parametrize("choice", SAME_BITS_CHOICES, ids=lambda choice: next(iter(choice)))
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    groups=st.sampled_from([1, 4]),
    tq=st.integers(1, 100),
    extra=st.integers(0, 100),
    dim=st.sampled_from([8, 40, 64, 160]),  # 40: dims past D in the box; 160: value chunks
    causal=st.booleans(),
    window=WINDOWS,
    softcap=st.sampled_from([None, 1.5]),
    sinks=st.booleans(),
    split_parallel=st.booleans(),
    flat=st.booleans(),
    data=st.data(),
)
def test_launch_choices_keep_the_shipped_bits(
    choice,
    dtype,
    groups,
    tq,
    extra,
    dim,
    causal,
    window,
    softcap,
    sinks,
    split_parallel,
    flat,
    data,
):
    """Tiles of 64 rows, so with groups 1 and over 64 queries a tile's first row lies past a
    few whole blocks; ``flat`` queries (all scores equal) keep every row's maximum from the
    first block on, so the conditional rescale skips."""
    tk = tq + extra
    q, k, v = inputs(2, 2, groups, tq, tk, dim, dtype, seed=tq * 7 + extra)
    q = q * 0 if flat else q
    starts = data.draw(st.lists(st.integers(0, tk - 1), min_size=2, max_size=2))
    kv_start = torch.tensor(starts, dtype=torch.int32, device=q.device)
    logits = randn((2 * groups,), torch.float32, tq, scale=2.0) if sinks else None
    options = AttentionOptions(causal, 0.3, 64, softcap, window if causal else None)
    args = (q, k, v, kv_start, options, logits)
    shipped = attention(*args, split_parallel=split_parallel, tma_kv=True)
    chosen = attention(*args, split_parallel=split_parallel, **{"tma_kv": True, **choice})
    assert_bitwise(chosen, shipped, choice)


@pytest.mark.parametrize("window", [None, 97])
def test_the_blocks_at_the_edges_of_whole_are_masked(window):
    """The edges of the skipped range, exactly: 100 queries over 130 keys (one kv head, no
    groups), so the second tile's first row sits at key 94 (its last block seen whole ends
    there, the next one at key 95 is partial) and, under a window of 97, its last row at 129
    misses key 32, the first key of a block every other row sees."""
    q, k, v = inputs(1, 1, 1, 100, 130, 16, torch.bfloat16, seed=11)
    kv_start = torch.zeros(1, dtype=torch.int32, device=q.device)
    args = (q, k, v, kv_start, AttentionOptions(True, 0.3, 64, None, window))
    masked = attention(*args, mask_every_block=True)
    assert_bitwise(attention(*args), masked, "whole blocks")


def test_tma_reads_keys_and_values_where_their_layout_allows():
    def chosen(k):
        q = randn((1, 2, 3, k.shape[-1]), k.dtype, 1)
        out = torch.empty_like(q)
        kv_start = torch.zeros(1, dtype=torch.int32, device=q.device)
        launch = attention_launches(q, k, k, kv_start, out, AttentionOptions(True, 0.1, 32))[0]
        return launch.args["TMA_KV"]

    assert chosen(randn((1, 1, 40, 64), torch.bfloat16, 2))
    assert chosen(randn((1, 40, 1, 64), torch.float16, 3).transpose(1, 2))  # [B, T, H, D] view
    assert not chosen(randn((1, 1, 40, 64), torch.float32, 4))  # fp32: FMA dots
    assert not chosen(randn((1, 1, 40, 12), torch.bfloat16, 5))  # 24-byte rows
    q, k = randn((1, 1, 3, 12), torch.bfloat16, 6), randn((1, 1, 40, 12), torch.bfloat16, 7)
    kv_start = torch.zeros(1, dtype=torch.int32, device=q.device)
    with pytest.raises(ValueError, match="tma_kv: TMA cannot read"):
        attention(q, k, k, kv_start, AttentionOptions(True, 0.1, 32), tma_kv=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fast_choices_check_passes_here(dtype):  # the interpreter, or the GPU's binaries
    assert launcher.fast_choices_agree(dtype, 64, DEVICE)


def _fast_choices(q, k, v) -> tuple[bool, bool]:
    """(keys and values by TMA, whole blocks unmasked) in the launch of a causal prefill."""
    kv_start = torch.zeros(1, dtype=torch.int32, device=q.device)
    out, options = torch.empty_like(q), AttentionOptions(True, 0.1, 32)
    args = attention_launches(q, k, v, kv_start, out, options)[0].args
    return args["TMA_KV"], args["WHOLE_BLOCKS"]


def test_a_failed_fast_choices_check_keeps_the_plain_launch(monkeypatch):
    monkeypatch.setattr(common, "SELF_CHECK_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(launcher.FAST_CHOICES_CHECK, "results", {})
    calls = []
    monkeypatch.setattr(launcher, "fast_choices_agree", lambda *key: calls.append(key) or False)
    q, k, v = inputs(1, 1, 2, 3, 40, 64, torch.bfloat16, seed=8)
    with pytest.warns(UserWarning, match="keys and values by TMA .* changed bits"):
        first = _fast_choices(q, k, v)
    assert first == _fast_choices(q, k, v) == (False, False)
    assert calls == [(torch.bfloat16, 64, q.device)]  # checked once per (dtype, head dim)


def test_unchecked_fast_choices_take_the_plain_launch_while_a_graph_records(monkeypatch):
    monkeypatch.setattr(common, "SELF_CHECK_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(launcher.FAST_CHOICES_CHECK, "results", {})
    monkeypatch.setattr(common, "capturing", lambda device: True)
    q, k, v = inputs(1, 1, 2, 3, 40, 64, torch.bfloat16, seed=8)
    assert _fast_choices(q, k, v) == (False, False)
    assert launcher.FAST_CHOICES_CHECK.results == {}


def test_the_fast_choices_where_nothing_is_checked():
    """On the CPU (the interpreter: no device check) a 16-bit launch takes both; fp32 neither
    (its FMA dots keep their operands in registers, and spill with the mask's branch)."""
    assert _fast_choices(*inputs(1, 1, 2, 3, 40, 64, torch.bfloat16, seed=8)) == (True, True)
    assert _fast_choices(*inputs(1, 1, 2, 3, 40, 64, torch.float32, seed=8)) == (False, False)


@pytest.mark.parametrize("dim", [160, 256])
def test_wide_heads_run_in_value_chunks_on_both_paths(dim):
    # D > 128 is cut into 128-wide chunks of output dims (160: a masked tail chunk).
    q, k, v = inputs(1, 1, 2, 20, 70, dim, torch.bfloat16, seed=3)
    kv_start = torch.tensor([5], dtype=torch.int32, device=q.device)
    in_registers, split_parallel = both_paths(q, k, v, True, 0.1, kv_start, 32, 30.0, 40)
    assert_bitwise(split_parallel, in_registers, "split-parallel vs in-register")
    wide = [t.double() for t in (q, k, v)]
    expected = reference.attention(*wide, kv_start, AttentionOptions(True, 0.1, 32, 30.0, 40))
    assert_close_to_reference(in_registers, expected, torch.bfloat16, "wide head")


@pytest.mark.parametrize("groups", [4, 8])
def test_gqa_packed_decode_equals_prefill_and_each_head_alone(groups):
    batch, hkv, length, split = 2, 2, 75, 32
    q, k, v = inputs(batch, hkv, groups, length, length, 16, torch.bfloat16, seed=groups)
    kv_start = torch.tensor([0, 11], dtype=torch.int32, device=q.device)
    options = (kv_start, AttentionOptions(True, 0.25, split))
    full = attention(q, k, v, *options)
    for t in range(length - 12, length):
        qt, kt, vt = q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1]
        out = torch.empty_like(qt)
        launches = attention_launches(qt, kt, vt, kv_start, out, options[1])
        # Split-parallel decode: one 64-row tile holds a kv head's whole query group, so a
        # program per (batch, kv head, split) reads each key block once for G query heads.
        assert len(launches) == 2 and launches[0].grid == (1, batch * hkv, t // split + 1)
        assert_bitwise(attention(qt, kt, vt, *options), full[:, :, t : t + 1], f"decode {t}")
    # A few-token decode step (speculative decoding): positions x heads packed in one tile.
    assert_bitwise(attention(q[:, :, -3:], k, v, *options), full[:, :, -3:], "three-token decode")
    # A query head alone (not packed with the rest of its group) gets the same bits.
    head = groups + 1  # second head of kv head 1
    alone = attention(q[:, head : head + 1], k[:, 1:2], v[:, 1:2], *options)
    assert_bitwise(alone, full[:, head : head + 1], "head alone")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [12, 16])
def test_strided_views_give_the_bits_of_contiguous_tensors(dtype, dim):
    # Queries as a transposed [B, T, H, D] tensor, keys and values as the first Tk positions
    # of a bigger [B, T, Hkv, D] cache (its capacity in every stride), one view starting at
    # an odd element (copied to aligned storage): the kernel sees other strides and stride
    # units, the rows the same numbers.
    batch, hkv, groups, tq, tk, capacity = 2, 2, 2, 9, 70, 100
    q = randn((batch, tq, hkv * groups, dim), dtype, 1).transpose(1, 2)
    cache_k = randn((batch, capacity, hkv, dim), dtype, 2).transpose(1, 2)
    flat_v = randn((batch * capacity * hkv * dim + 1,), dtype, 3)
    cache_v = flat_v[1:].view(batch, capacity, hkv, dim).transpose(1, 2)
    k, v = cache_k[:, :, :tk], cache_v[:, :, :tk]
    kv_start = torch.tensor([0, 7], dtype=torch.int32, device=q.device)
    for split_parallel in (False, True):
        args = (kv_start, AttentionOptions(True, 0.3, 32))
        strided = attention(q, k, v, *args, split_parallel=split_parallel)
        dense = attention(
            *(t.contiguous() for t in (q, k, v)), *args, split_parallel=split_parallel
        )
        assert_bitwise(strided, dense, f"strided views, split_parallel={split_parallel}")


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("length", [4096, 32768])
def test_prefill_has_no_workspace(length):
    # The old split kernel kept an fp32 partial per (query, split): O(T^2), out of memory
    # near 32k tokens. The in-register path allocates nothing beyond its output.
    q, out = _meta(1, 32, length, 128), _meta(1, 32, length, 128)
    k, v = _meta(1, 8, length, 128), _meta(1, 8, length, 128)
    kv_start = _meta(1, dtype=torch.int32)
    (launch,) = attention_launches(q, k, v, kv_start, out, AttentionOptions(True, 0.088, 256))
    tensors = [a for a in launch.args.values() if isinstance(a, torch.Tensor)]
    assert all(any(t is x for x in (q, k, v, kv_start, out)) for t in tensors)


def test_decode_workspace_is_one_state_per_split_and_query_row():
    batch, hq, hkv, tq, tk, dim = 3, 32, 8, 2, 8192, 128
    q, out = _meta(batch, hq, tq, dim), _meta(batch, hq, tq, dim)
    k, v = _meta(batch, hkv, tk, dim), _meta(batch, hkv, tk, dim)
    kv_start = _meta(batch, dtype=torch.int32)
    launches = attention_launches(q, k, v, kv_start, out, AttentionOptions(True, 0.1, 256))
    assert len(launches) == 2  # split-parallel, then the combine
    args = launches[0].args
    rows, splits = tq * hq // hkv, tk // 256
    assert args["ws_acc_ptr"].shape == (batch * hkv, splits, rows, dim)
    assert args["ws_max_ptr"].shape == args["ws_sum_ptr"].shape == (batch * hkv, splits, rows)


def test_path_choice():
    assert _use_split_parallel(1, 8, 4, 32, 128)  # decode over 8k keys
    assert not _use_split_parallel(1, 8, 4, 1, 128)  # one split: nothing to parallelise
    assert not _use_split_parallel(1, 8, BLOCK_M + 1, 32, 128)  # more than one tile
    assert not _use_split_parallel(4096, 8, 4, 32, 128)  # programs enough without splits
    assert not _use_split_parallel(64, 8, 64, 2048, 128)  # workspace too large


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_prefill_in_registers_equals_split_parallel_and_float64(dtype):
    length = 600  # 10 query tiles of 64 rows, 19 splits of 32 keys
    q, k, v = inputs(1, 1, 1, length, length, 16, dtype, seed=5)
    kv_start = torch.zeros(1, dtype=torch.int32, device=q.device)
    assert not _use_split_parallel(1, 1, length, length // 32 + 1, 16)
    in_registers, split_parallel = both_paths(q, k, v, True, 0.25, kv_start, 32)
    assert_bitwise(split_parallel, in_registers, "split-parallel vs in-register")
    wide = [t.double() for t in (q, k, v)]
    expected = reference.attention(*wide, kv_start, AttentionOptions(True, 0.25, 32))
    assert_close_to_reference(in_registers, expected, dtype, "long prefill")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_parallel", [False, True])
@pytest.mark.parametrize(
    "causal, softcap, window", [(True, None, None), (False, None, None), (True, 1.5, 17)]
)
def test_both_paths_accurate_against_float64(dtype, split_parallel, causal, softcap, window):
    q, k, v = inputs(2, 2, 3, 50, 90, 40, dtype, seed=9)
    kv_start = torch.tensor([0, 13], dtype=torch.int32, device=q.device)
    args = (kv_start, AttentionOptions(causal, 0.3, 32, softcap, window))
    out = attention(q, k, v, *args, split_parallel=split_parallel)
    wide = [t.double() for t in (q, k, v)]
    expected = reference.attention(*wide, *args)
    assert_close_to_reference(out, expected, dtype, "attention")
