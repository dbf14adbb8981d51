"""paged_attention: packed queries over a paged KV cache give bik.attention's bits for every
sequence, whatever the page order, the mix of prefill, chunked-prefill and decode rows in the
step, and the other sequences in the batch."""

import importlib

import pytest
import torch
from conftest import DEVICE
from helpers import DTYPES, assert_bitwise, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import bik
from bik import backends
from bik.layers import paged_attention as paged_module
from bik.layers.paged_attention import paged_attention, write_kv_cache


def make_step(seq_lens, query_lens, hkv, groups, dim, block_size, dtype, seed):
    """Contiguous keys/values per sequence, the same written into a shuffled paged cache, and
    the packed queries of one engine step (the last ``query_lens[i]`` tokens of sequence i)."""
    pages_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages_per_seq) + 3  # spare pages stay unused
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    key_cache = randn((num_blocks, hkv, block_size, dim), dtype, seed + 1)  # garbage elsewhere
    value_cache = randn((num_blocks, hkv, block_size, dim), dtype, seed + 2)
    table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32)
    keys, values, queries, used = [], [], [], 0
    for i, (n, tq) in enumerate(zip(seq_lens, query_lens)):
        table[i, : pages_per_seq[i]] = order[used : used + pages_per_seq[i]]
        used += pages_per_seq[i]
        k, v = (
            randn((n, hkv, dim), dtype, seed + 10 * i),
            randn((n, hkv, dim), dtype, seed + 10 * i + 1),
        )
        slots = torch.tensor(
            [int(table[i, t // block_size]) * block_size + t % block_size for t in range(n)],
            device=DEVICE,
        )
        write_kv_cache(k, v, key_cache, value_cache, slots)
        keys.append(k)
        values.append(v)
        queries.append(randn((tq, hkv * groups, dim), dtype, seed + 10 * i + 2))
    starts = [0]
    for tq in query_lens:
        starts.append(starts[-1] + tq)
    return keys, values, queries, key_cache, value_cache, table.to(DEVICE), starts


def contiguous_attention(q, k, v, scale, **options):
    """bik.attention of one sequence: q [Tq, H, D] over its keys [n, Hkv, D]."""
    out = bik.attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        causal=True,
        scale=scale,
        **options,
    )
    return out[0].transpose(0, 1)


@settings(max_examples=min(8, settings.default.max_examples), deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    lens=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 100)), min_size=1, max_size=5),
    hkv=st.integers(1, 2),
    groups=st.integers(1, 2),
    block_size=st.sampled_from([16, 32]),
    seed=st.integers(0, 1000),
)
def test_each_sequence_equals_contiguous_attention(
    backend, dtype, lens, hkv, groups, block_size, seed
):
    # query length: 1 (decode), the whole sequence (prefill) or a chunk in between.
    seq_lens = [n for n, _ in lens]
    query_lens = [1 + q % n for n, q in lens]
    dim, scale = 16, 0.25
    keys, values, queries, kc, vc, table, starts = make_step(
        seq_lens, query_lens, hkv, groups, dim, block_size, dtype, seed
    )
    out = paged_attention(torch.cat(queries), kc, vc, table, starts, seq_lens, scale=scale)
    for i in range(len(seq_lens)):
        expected = contiguous_attention(queries[i], keys[i], values[i], scale)
        assert_bitwise(out[starts[i] : starts[i + 1]], expected, f"sequence {i} of {seq_lens}")


@pytest.mark.parametrize(
    "softcap, window, sinks", [(1.5, 5, None), (30.0, 40, None), (None, None, [0.5, -1, 2, 3])]
)
def test_softcap_window_and_sinks_equal_contiguous_attention(backend, softcap, window, sinks):
    if sinks is not None and not backends.load(backend).attention_sinks:
        pytest.skip(f"the {backend} backend has no attention sinks")
    # One step mixing a prefill, a chunk and two decodes of different lengths (a left-padded
    # decode batch): soft-capping, the window and attention sinks are forwarded and keep
    # paged == contiguous.
    seq_lens, query_lens, dtype, scale = [45, 70, 3, 38], [45, 1, 1, 10], torch.bfloat16, 0.3
    keys, values, queries, kc, vc, table, starts = make_step(
        seq_lens, query_lens, 2, 2, 16, 16, dtype, 5
    )
    if sinks is not None:
        sinks = torch.tensor(sinks, device=kc.device)
    options = dict(softcap=softcap, window=window, sinks=sinks)
    out = paged_attention(
        torch.cat(queries), kc, vc, table, starts, seq_lens, scale=scale, **options
    )
    for i in range(len(seq_lens)):
        expected = contiguous_attention(queries[i], keys[i], values[i], scale, **options)
        assert_bitwise(out[starts[i] : starts[i + 1]], expected, f"sequence {i}")
    plain = paged_attention(torch.cat(queries), kc, vc, table, starts, seq_lens, scale=scale)
    assert not torch.equal(out, plain)  # the options did reach the kernel


def test_decode_equals_the_prefill_row(backend):
    # The last token decoded alone over the cache == the last row of a full prefill.
    n, dtype, scale = 45, torch.bfloat16, 0.3
    *_, queries, kc, vc, table, _ = make_step([n], [n], 2, 2, 16, 16, dtype, 7)
    prefill = paged_attention(queries[0], kc, vc, table, [0, n], [n], scale=scale)
    decode = paged_attention(queries[0][-1:], kc, vc, table, [0, 1], [n], scale=scale)
    assert_bitwise(decode, prefill[-1:], "decode vs prefill")


@pytest.fixture(params=["cpu", "triton"])
def paged_backend(request):
    """The backends whose paged kernel reads the block table itself (skipped when unbuilt)."""
    try:
        backends.load(request.param).check_device(DEVICE)
    except (ImportError, RuntimeError) as error:
        pytest.skip(f"{request.param} backend unavailable: {error}")
    with bik.use_backend(request.param):
        yield request.param


def vllm_cache(cache):
    """``cache [blocks, Hkv, block_size, D]`` copied into vLLM's CPU layout (each block its
    keys, then its values) and returned as the strided key view engines pass."""
    blocks, heads, block_size, dim = cache.shape
    pages = cache.new_zeros(blocks, heads, 2 * block_size, dim)
    pages[:, :, :block_size] = cache
    return pages[:, :, :block_size]


@settings(max_examples=min(12, settings.default.max_examples), deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    lens=st.lists(st.tuples(st.integers(1, 150), st.integers(0, 200)), min_size=1, max_size=6),
    hkv=st.integers(1, 3),
    groups=st.integers(1, 3),
    dim=st.sampled_from([8, 20, 64]),
    block_size=st.sampled_from([5, 16, 48]),
    split_size=st.sampled_from([32, 64, None]),
    softcap=st.sampled_from([None, 2.0]),
    window=st.sampled_from([None, 7, 70]),
    strided=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_paged_kernel_equals_the_gathered_path(
    paged_backend,
    dtype,
    lens,
    hkv,
    groups,
    dim,
    block_size,
    split_size,
    softcap,
    window,
    strided,
    seed,
):
    # The one-call kernel against the path it replaced (keys gathered per sequence, decode
    # rows as a left-padded batch): decode, chunk and prefill rows mixed in one step, shuffled
    # pages, pages that do not divide a key block (5, 48), head sizes with lane tails, several
    # splits per row, the options, and engine-shaped strided views of queries and caches.
    seq_lens = [n for n, _ in lens]
    query_lens = [1 + q % n for n, q in lens]
    *_, queries, kc, vc, table, starts = make_step(
        seq_lens, query_lens, hkv, groups, dim, block_size, dtype, seed
    )
    query = torch.cat(queries)
    if strided:  # a [T, H, D] slice of a fused qkv output; caches in vLLM's layout
        fused = torch.cat((query, torch.zeros_like(query)), dim=1)
        query, kc, vc = fused[:, : query.shape[1]], vllm_cache(kc), vllm_cache(vc)
    sinks = torch.linspace(-1, 1, hkv * groups, device=query.device) if seed % 2 else None
    options = dict(scale=0.3, split_size=split_size, softcap=softcap, window=window)
    out = paged_attention(query, kc, vc, table, starts, seq_lens, **options, sinks=sinks)
    checked = paged_module.validate_options(query, True, **options, sinks=sinks)
    gathered = paged_module._gathered(query, kc, vc, table, starts, seq_lens, checked, sinks)
    assert_bitwise(out, gathered, f"{seq_lens=} {query_lens=}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_step_over_several_splits_equals_contiguous_attention(
    paged_backend, dtype, monkeypatch
):
    # One token per sequence: the triton kernel runs it as a batch of one-token queries on
    # its split-parallel path (checked below), whose bits must be the in-register path's.
    seq_lens = [70, 150, 33, 1]
    keys, values, queries, kc, vc, table, starts = make_step(
        seq_lens, [1] * 4, 2, 2, 16, 16, dtype, 3
    )
    launches = []
    if paged_backend == "triton":
        triton_attention = importlib.import_module("bik.backends.triton.attention_launch")
        plan = triton_attention.attention_launches
        monkeypatch.setattr(
            triton_attention,
            "attention_launches",
            lambda *a, **k: launches.extend(plan(*a, **k)) or launches,
        )
    out = paged_attention(
        torch.cat(queries), kc, vc, table, starts, seq_lens, scale=0.3, split_size=32
    )
    for i in range(len(seq_lens)):
        expected = contiguous_attention(queries[i], keys[i], values[i], 0.3, split_size=32)
        assert_bitwise(out[i : i + 1], expected, f"sequence {i}")
    if paged_backend == "triton":
        assert [launch.args["SPLIT_PARALLEL"] for launch in launches[:1]] == [True]


def test_paged_kernel_is_one_call(paged_backend, monkeypatch):
    # Inference on a backend with a paged kernel never gathers; a graph to record does (the
    # path with bik.attention's autograd), with the same bits.
    q, kc, vc, table, starts, lens = _two_sequences()
    gathered = paged_module._gathered
    monkeypatch.setattr(paged_module, "_gathered", None)
    out = paged_attention(q, kc, vc, table, starts, lens, scale=0.5)
    monkeypatch.setattr(paged_module, "_gathered", gathered)
    graph = paged_attention(q.requires_grad_(), kc, vc, table, starts, lens, scale=0.5)
    assert graph.requires_grad
    assert_bitwise(graph.detach(), out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_column_strided_block_table_reads_its_own_columns(paged_backend, dtype):
    # Issue 42, item 3: the triton kernel stepped one id at a time through the table's
    # storage, so a table[:, ::2] view read the skipped columns' blocks.
    seq_lens, query_lens = [40, 23, 9], [1, 5, 9]
    *_, queries, kc, vc, table, starts = make_step(seq_lens, query_lens, 2, 2, 16, 16, dtype, 3)
    query = torch.cat(queries)
    wide = torch.empty(table.shape[0], 2 * table.shape[1], dtype=table.dtype, device=DEVICE)
    wide[:, ::2] = table
    wide[:, 1::2] = table.flip(1)  # real blocks, the wrong ones
    strided = wide[:, ::2]
    assert strided.stride(-1) == 2
    for step in ((query, starts, seq_lens), (query[[0, 1, 6]], [0, 1, 2, 3], seq_lens)):
        expected = paged_attention(step[0], kc, vc, table, step[1], step[2], scale=0.25)
        got = paged_attention(step[0], kc, vc, strided, step[1], step[2], scale=0.25)
        assert_bitwise(got, expected, f"{len(step[1]) - 1} sequences, {step[0].shape[0]} rows")


def test_a_steps_sequences_are_checked_and_copied_once_for_all_its_layers(monkeypatch):
    """An engine calls every layer of a step with the same lists: one check and one device
    copy serve them all; new lists, or a block table written in place, are checked again."""
    q, kc, vc, table, starts, lens = _two_sequences()
    copies = []
    on_device = paged_module._on_device
    monkeypatch.setattr(paged_module, "_on_device", lambda *a: copies.append(a) or on_device(*a))
    first = paged_attention(q, kc, vc, table, starts, lens, scale=0.5)
    for _ in range(3):  # the step's other layers
        assert_bitwise(
            paged_attention(q, kc, vc, table, list(starts), list(lens), scale=0.5), first
        )
    assert len(copies) == 1
    paged_attention(q[:41], kc, vc, table, [0, 40, 41], [40, 6], scale=0.5)  # the next step
    assert len(copies) == 2
    table[1, 0] = kc.shape[0]  # a block the cache does not have, written in place
    with pytest.raises(ValueError, match="block_table"):
        paged_attention(q[:41], kc, vc, table, [0, 40, 41], [40, 6], scale=0.5)


def test_padding_slots_are_skipped():
    k, v = torch.ones(3, 1, 4), torch.ones(3, 1, 4)
    kc, vc = torch.zeros(2, 1, 16, 4), torch.zeros(2, 1, 16, 4)
    write_kv_cache(k, v, kc, vc, torch.tensor([0, -1, 17]))
    assert kc[0, 0, 0].eq(1).all() and kc[1, 0, 1].eq(1).all() and kc.sum() == 8


def test_errors():
    q, kc = torch.zeros(3, 2, 4), torch.zeros(2, 1, 16, 4)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="query_start"):
        paged_attention(q, kc, kc, table, [0], [3], scale=1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(q, kc, kc, table, [0, 3], [2], scale=1.0)
    with pytest.raises(TypeError, match="key_cache"):
        paged_attention(q, kc.half(), kc, table, [0, 3], [3], scale=1.0)
    with pytest.raises(ValueError, match="value_cache"):
        paged_attention(q, kc, kc[0], table, [0, 3], [3], scale=1.0)
    with pytest.raises(ValueError, match="value_cache: expected the shape of key_cache"):
        paged_attention(q, kc, kc[:1], table, [0, 3], [3], scale=1.0)
    with pytest.raises(ValueError, match="key_cache: expected size 2 in dim 3"):
        paged_attention(q[..., :2], kc, kc, table, [0, 3], [3], scale=1.0)
    with pytest.raises(ValueError, match="key_cache: expected a head count"):
        paged_attention(
            q, kc.expand(2, 3, 16, 4), kc.expand(2, 3, 16, 4), table, [0, 3], [3], scale=1.0
        )
    with pytest.raises(ValueError, match="split_size"):
        paged_attention(q, kc, kc, table, [0, 3], [3], scale=1.0, split_size=33)


def _two_sequences():
    """A prefill of 40 tokens (3 pages of 16) and a decode row of a 5-token sequence."""
    *_, queries, kc, vc, table, _ = make_step([40, 5], [40, 1], 1, 1, 8, 16, torch.float32, 3)
    return torch.cat(queries), kc, vc, table, [0, 40, 41], [40, 5]


def test_layout_errors_name_the_argument():
    """Issue 25, items 3, 4 and 10: a block table too narrow for seq_lens attended over the
    keys its pages held; a query_start not running from 0 to the token count returned rows
    of zeros; a short table, a bad block id or slot raised a raw IndexError or RuntimeError;
    a float table was truncated. Each is now refused, naming the argument."""
    q, kc, vc, table, starts, lens = _two_sequences()
    expected = paged_attention(q, kc, vc, table, starts, lens, scale=1.0)
    unused_columns = torch.full((2, 2), -7, dtype=table.dtype, device=table.device)
    unset = torch.cat((table, unused_columns), 1)
    assert_bitwise(paged_attention(q, kc, vc, unset, starts, lens, scale=1.0), expected)
    narrow = "block_table: seq_lens.0. = 40 tokens fill 3 pages of 16, but the table has 2 col"
    blocks = kc.shape[0]
    bad_ids = [table.clone(), table.clone()]
    bad_ids[0][0, 2], bad_ids[1][1, 0] = blocks, -1
    cases = [
        ((q, table[:, :2], starts, lens), ValueError, narrow),
        ((q[-1:], table[:1, :2], [0, 1], [40]), ValueError, narrow),  # a decode row
        ((q, table, [1, 40, 41], lens), ValueError, "query_start: expected to run from 0 to 41"),
        ((q, table, [0, 40, 40], lens), ValueError, "got 0 to 40"),
        ((torch.cat((q, q[:1])), table, starts, lens), ValueError, "from 0 to 42"),
        ((q, table, [0, 41, 41], [41, 5]), ValueError, r"query_start\[1:3\] = \[41, 41\]"),
        ((q, table[:1], starts, lens), ValueError, "block_table: expected a row for each of"),
        ((q, table.float(), starts, lens), TypeError, "block_table: expected an integer dtype"),
        ((q, table[0], starts, lens), ValueError, "block_table: expected 2 dims"),
        ((q, table.to("meta"), starts, lens), ValueError, "block_table: expected device"),
    ]
    if table.device.type == "cpu":  # on a GPU a bad id is a device-side assert, which would
        # leave the CUDA context unusable for every later test of this process
        cases += [
            (
                (q, bad_ids[0], starts, lens),
                ValueError,
                rf"block_table: expected values in \[0, {blocks - 1}\]",
            ),
            ((q, bad_ids[1], starts, lens), ValueError, "got min -1"),
        ]
    for (query, block_table, query_start, seq_lens), error, message in cases:
        with pytest.raises(error, match=message):
            paged_attention(query, kc, vc, block_table, query_start, seq_lens, scale=1.0)


def test_write_kv_cache_errors_name_the_argument():
    """Issue 25, item 10: a slot past the cache raised a raw IndexError."""
    k, kc = torch.ones(3, 1, 4), torch.zeros(2, 1, 16, 4)
    cases = [
        (torch.tensor([0, 1, 32]), ValueError, r"slot_mapping: expected values in \[.*, 31\]"),
        (torch.tensor([0.0, 1.0, 2.0]), TypeError, "slot_mapping: expected an integer dtype"),
        (torch.tensor([0, 1]), ValueError, "key: expected size 2 in dim 0"),
        (torch.tensor([0, 1, 2], device="meta"), ValueError, "slot_mapping: expected device"),
    ]
    for slots, error, message in cases:
        with pytest.raises(error, match=message):
            write_kv_cache(k, k, kc, kc.clone(), slots)
    with pytest.raises(ValueError, match="value: expected size 4 in dim 2"):
        write_kv_cache(k, k[..., :2], kc, kc[..., :2].clone(), torch.tensor([0, 1, 2]))
