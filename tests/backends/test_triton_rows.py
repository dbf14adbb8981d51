"""Triton row kernels: both rms_norm paths at the one-pass cap, log_softmax over several
segments, 1 row vs many bit for bit (tails of rows and of the per-row programs included),
accuracy against float64, non-finite rows.

The widths that decide the paths (``one_pass``, ``segment``) are shrunk here so that the
interpreter covers every path with small rows; production passes the contract's constants.
"""

import importlib

import pytest
import torch
from conftest import invariant_backends
from helpers import DTYPES, assert_bitwise, assert_close_to_reference, embed_row, randn
from hypothesis import given
from hypothesis import strategies as st

from bik import contract
from bik.backends import reference

if "triton" not in invariant_backends():
    pytest.skip("the triton backend cannot run here", allow_module_level=True)

rms = importlib.import_module("bik.backends.triton.rms_norm")
lsm = importlib.import_module("bik.backends.triton.log_softmax")
rows_mod = importlib.import_module("bik.backends.triton._rows")


def _alone_equals_batched(fn, row, others, positions):
    """``fn`` of ``row`` alone equals its row inside ``others`` at each position."""
    alone = fn(row)
    for position in positions:
        batched = fn(embed_row(row, others, position))
        assert_bitwise(batched[position : position + 1], alone, f"row {position}")


# ---- rms_norm ---------------------------------------------------------------------------


def test_rms_norm_path_depends_on_the_row_length_only():
    # One pass (block >= D) up to the cap, chunks above; warps follow the block width.
    for d in (1, 100, 4096, 8192, contract.RMS_NORM_ONE_PASS):
        block, _ = rms.block_and_warps(d)
        assert block >= d
    for d in (contract.RMS_NORM_ONE_PASS + 1, 100_000):
        assert rms.block_and_warps(d) == (contract.ROW_CHUNK_CAP, 8)
    assert rms.block_and_warps(4096) == (4096, 8)
    assert rms.block_and_warps(8192) == (8192, 16)
    assert rms.block_and_warps(65, one_pass=64) == (64, 1)
    assert rows_mod.vector_width(4096, torch.bfloat16) == 8
    assert rows_mod.vector_width(4100, torch.bfloat16) == 4
    assert rows_mod.vector_width(4100, torch.float32) == 4
    assert rows_mod.vector_width(33, torch.float16) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [63, 64, 65, 200])
def test_rms_norm_both_paths_at_the_cap(dtype, d):
    # one_pass=64: 63 and 64 are held in registers, 65 and 200 run in 64-wide chunks.
    x, w = randn((6, d), dtype, 1, scale=3.0), randn((d,), dtype, 2)
    out = rms.rms_norm(x, w, 1e-6, one_pass=64)
    assert_close_to_reference(out, reference.rms_norm(x.double(), w.double(), 1e-6), dtype)
    others = randn((9, d), dtype, 3, scale=7.0)
    _alone_equals_batched(lambda t: rms.rms_norm(t, w, 1e-6, one_pass=64), x[:1], others, (0, 4, 9))


@pytest.mark.parametrize("d", [contract.RMS_NORM_ONE_PASS, contract.RMS_NORM_ONE_PASS + 8])
def test_rms_norm_production_cap(d):
    x, w = randn((3, d), torch.bfloat16, 4, scale=2.0), randn((d,), torch.bfloat16, 5)
    out = rms.rms_norm(x, w, 1e-6)
    assert_close_to_reference(out, reference.rms_norm(x.double(), w.double(), 1e-6), x.dtype)
    _alone_equals_batched(lambda t: rms.rms_norm(t, w, 1e-6), x[1:2], x[[0, 2]], (0, 2))


@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 12),
    d=st.integers(1, 300),
    one_pass=st.sampled_from([16, 128, contract.RMS_NORM_ONE_PASS]),
    data=st.data(),
)
def test_rms_norm_row_is_batch_invariant_on_both_paths(dtype, rows, d, one_pass, data):
    position = data.draw(st.integers(0, rows - 1))
    w = randn((d,), dtype, 6)
    row, others = randn((1, d), dtype, 7), randn((rows - 1, d), dtype, 8, scale=5.0)
    _alone_equals_batched(
        lambda t: rms.rms_norm(t, w, 1e-6, one_pass=one_pass), row, others, (position,)
    )


def test_rms_norm_strided_and_misaligned_rows():
    # A row stride not divisible by the vector width (and an unaligned start) is copied first;
    # the bits are those of the contiguous rows.
    base, w = randn((8, 72), torch.bfloat16, 9), randn((64,), torch.bfloat16, 10)
    for view in (base[:, 1:65], base[::2, 8:], base[1:, :64]):
        assert_bitwise(rms.rms_norm(view, w, 1e-6), rms.rms_norm(view.contiguous(), w, 1e-6))


# ---- log_softmax / token_logprobs -------------------------------------------------------


def test_segments_depend_on_the_vocabulary_only():
    assert lsm.segment_width(1) == 1
    assert lsm.segment_width(1000) == 1024
    assert lsm.segment_width(151936) == contract.LOG_SOFTMAX_SEGMENT
    assert lsm.segment_width(300, segment=64) == 64


def _both(x, tokens, temperature, segment):
    full = lsm.log_softmax(x, temperature, torch.float32, segment=segment)
    return full, lsm.token_logprobs(x, tokens, temperature, segment=segment)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "vocab, segment",
    [
        (64, 64),  # one full segment
        (65, 64),  # a one-entry tail segment
        (200, 64),  # 4 segments: each write program folds them itself
        (300, 64),  # 5: one fold per row first
        (600, 16),  # 38 segments: the fold's unrolled loop and its remainder
        (4097, contract.LOG_SOFTMAX_SEGMENT),  # production width, one-entry tail
        (20000, contract.LOG_SOFTMAX_SEGMENT),  # production width, 5 segments
    ],
)
def test_segments_accuracy_and_one_formula(dtype, vocab, segment):
    x = randn((3, vocab), dtype, 11, scale=6.0)
    # The row's max sits in a later segment in one row, the first in another.
    x[0, -1], x[1, 0] = 30.0, 30.0
    tokens = torch.tensor([vocab - 1, 0, vocab // 2], device=x.device)
    for temperature in (1.0, 0.7):
        full, picked = _both(x, tokens, temperature, segment)
        expected = torch.log_softmax(x.double() / temperature, -1)
        assert_close_to_reference(full, expected, torch.float32, "log_softmax")
        assert_bitwise(picked, full.gather(1, tokens[:, None])[:, 0], "token vs gathered")
    low = lsm.log_softmax(x, 1.0, dtype, segment=segment)
    assert low.dtype == dtype
    assert_close_to_reference(low, torch.log_softmax(x.double(), -1), dtype, "in x's dtype")


@pytest.mark.parametrize("vocab, segment", [(40, 16), (300, 64)])
def test_one_row_equals_many_including_the_program_tail(vocab, segment):
    # 130 rows: the per-row kernels run 128 rows per program, so rows 128 and 129 sit in a
    # second, partial program; each must equal the row alone.
    x = randn((130, vocab), torch.bfloat16, 12, scale=5.0)
    tokens = torch.randint(vocab, (130,), generator=torch.Generator().manual_seed(13))
    tokens = tokens.to(x.device)
    full, picked = _both(x, tokens, 0.9, segment)
    for r in (0, 57, 127, 128, 129):
        alone_full, alone_picked = _both(x[r : r + 1], tokens[r : r + 1], 0.9, segment)
        assert_bitwise(full[r : r + 1], alone_full, f"log_softmax row {r}")
        assert_bitwise(picked[r : r + 1], alone_picked, f"token_logprobs row {r}")


@given(
    rows=st.integers(1, 8),
    vocab=st.integers(1, 260),
    segment=st.sampled_from([16, 64]),
    temperature=st.sampled_from([1.0, 0.6]),
    data=st.data(),
)
def test_segmented_row_is_batch_invariant(rows, vocab, segment, temperature, data):
    position = data.draw(st.integers(0, rows - 1))
    row = randn((1, vocab), torch.float16, 14, scale=4.0)
    others = randn((rows - 1, vocab), torch.float16, 15, scale=9.0)
    token = torch.tensor([data.draw(st.integers(0, vocab - 1))], device=row.device)
    batch = embed_row(row, others, position)
    tokens = embed_row(token, torch.zeros(rows - 1, dtype=torch.int64, device=row.device), position)
    full, picked = _both(batch, tokens, temperature, segment)
    alone_full, alone_picked = _both(row, token, temperature, segment)
    assert_bitwise(full[position : position + 1], alone_full, "log_softmax")
    assert_bitwise(picked[position : position + 1], alone_picked, "token_logprobs")


def test_non_finite_rows_across_segments():
    # As torch: a NaN or +inf anywhere makes the row NaN, an all -inf row is NaN, -inf
    # entries (a whole segment of them included) give -inf and leave the rest finite.
    x = randn((6, 100), torch.float32, 16)
    x[1, 90] = float("nan")
    x[2, 70] = float("inf")
    x[3] = float("-inf")
    x[4, 16:48] = float("-inf")
    x[5, :99] = float("-inf")
    for segment in (16, 128):
        out = lsm.log_softmax(x, 1.0, torch.float32, segment=segment)
        expected = torch.log_softmax(x, -1)
        assert torch.equal(out.isnan(), expected.isnan()), segment
        finite = expected.isfinite()
        assert torch.equal(out.isfinite(), finite), segment
        assert torch.allclose(out[finite], expected[finite], atol=1e-5)
        picked = lsm.token_logprobs(x, torch.full((6,), 99, device=x.device), 1.0, segment)
        assert torch.equal(picked.isnan(), out[:, 99].isnan())
        kept = ~picked.isnan()
        assert torch.equal(picked[kept], out[kept, 99])
