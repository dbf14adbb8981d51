"""The Triton linear kernel's token buckets: every bucket gives a row its single-row bits; the
grouped (mixture-of-experts) kernel, which shares its tile product, gives an expert's rows the
bits of the expert's own linear.

``_linear_kernel`` (bf16 / fp16 weights that TMA can describe) changes its token tile, warps
and stages with the row count; these tests run it (in the interpreter, or on a GPU) and check
that no bucket changes a row's bits, that the shape-level self-check and its fallback work,
and that views with unaligned storage are computed like aligned ones.
"""

import importlib

import pytest
import torch
from conftest import DEVICE, invariant_backends
from helpers import assert_bitwise, assert_close_to_reference, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import bik

pytestmark = pytest.mark.skipif(
    "triton" not in invariant_backends(), reason="triton backend not usable"
)

matmul = importlib.import_module("bik.backends.triton.matmul")
grouped = importlib.import_module("bik.backends.triton.grouped")
common = importlib.import_module("bik.backends.triton._common")
HALF = [torch.bfloat16, torch.float16]
PROBE_ROWS = 300  # two tiles of the widest bucket, the second one a tail
# Row counts at every bucket edge, and one past it.
EDGES = sorted({1} | {b.max_rows + d for b in matmul.TOKEN_BUCKETS[:-1] for d in (0, 1)})


@pytest.fixture(autouse=True)
def _triton():
    with bik.use_backend("triton"):
        yield


@pytest.fixture
def bucket_spy(monkeypatch):
    """The token bucket of every linear launch, in order."""
    seen = []
    run = matmul.run_linear

    def spy(x, weight, bias, bucket):
        seen.append(bucket)
        return run(x, weight, bias, bucket)

    monkeypatch.setattr(matmul, "run_linear", spy)
    return seen


@settings(max_examples=6)
@given(
    dtype=st.sampled_from(HALF),
    n=st.integers(1, 17).map(lambda i: 8 * i),
    k=st.integers(1, 20).map(lambda i: 8 * i),
    bias=st.booleans(),
)
def test_every_bucket_gives_the_single_row_bucket_bits(dtype, n, k, bias):
    weight, x = randn((n, k), dtype, seed=1), randn((PROBE_ROWS, k), dtype, seed=2)
    b = randn((n,), dtype, seed=3) if bias else None
    single = matmul.run_linear(x, weight, b, matmul.TOKEN_BUCKETS[0])
    for bucket in matmul.ALL_BUCKETS[1:]:
        rows = bucket.max_rows or x.shape[0]
        got = matmul.run_linear(x[:rows], weight, b, bucket)
        assert_bitwise(got, single[:rows], f"bucket {bucket} vs the first, n={n} k={k}")
    reference = x.double() @ weight.double().t() + (b.double() if bias else 0)
    assert_close_to_reference(single, reference, dtype, "linear vs float64")


@pytest.mark.parametrize("dtype", HALF)
def test_rows_keep_their_bits_across_bucket_edges(dtype, bucket_spy):
    weight, bias = randn((72, 96), dtype, seed=4), randn((72,), dtype, seed=5)
    x = randn((EDGES[-1], 96), dtype, seed=6)
    alone = {i: bik.linear(x[i : i + 1], weight, bias) for i in (0, 15, 16, 63, EDGES[-1] - 1)}
    for rows in EDGES:
        batched = bik.linear(x[:rows], weight, bias)
        for i, row in alone.items():
            if i < rows:
                assert_bitwise(batched[i : i + 1], row, f"row {i} of {rows}")
    assert {b.block_t for b in bucket_spy} == {b.block_t for b in matmul.TOKEN_BUCKETS}


def test_a_wide_weight_takes_the_wide_buckets_with_the_same_bits(bucket_spy, monkeypatch):
    """Wider than one wave of 64-feature tiles (a "GPU" of 4 SMs here, on any device): the
    decode rows get the deeper pipeline, 100 rows the 128-feature tile; each row's bits are
    its bits alone."""
    monkeypatch.setattr(common, "SELF_CHECK_DEVICES", ())  # its runs would show in the spy
    monkeypatch.setattr(matmul, "multiprocessors", lambda device: 4)
    weight = randn((5 * matmul.WIDE_TILE_FEATURES, 64), torch.bfloat16, 13)
    x = randn((100, 64), torch.bfloat16, 14)
    alone = bik.linear(x[99:], weight)
    assert_bitwise(bik.linear(x[90:], weight)[9:], alone, "last of 10 rows")
    assert_bitwise(bik.linear(x, weight)[99:], alone, "last of 100 rows")
    assert bucket_spy == [matmul.WIDE_WEIGHT_BUCKETS[m] for m in (16, 16, 128)]


def test_fp32_and_untma_able_shapes_take_the_tile_kernel(bucket_spy, monkeypatch):
    monkeypatch.setattr(common, "SELF_CHECK_DEVICES", ())  # its runs would show in the spy
    bik.linear(randn((3, 64), torch.float32, 7), randn((32, 64), torch.float32, 8))
    bik.linear(randn((3, 60), torch.bfloat16, 7), randn((32, 60), torch.bfloat16, 8))  # K*2 % 16
    assert bucket_spy == []
    bik.linear(randn((3, 64), torch.bfloat16, 7), randn((32, 64), torch.bfloat16, 8))
    assert bucket_spy == [matmul.TOKEN_BUCKETS[0]]


def test_buckets_agree():  # in the interpreter, or HGMMA on a Hopper GPU
    assert matmul.buckets_agree(randn((40, 48), torch.bfloat16, 9))


def test_a_failed_bucket_check_falls_back_to_the_single_row_bucket(monkeypatch, bucket_spy):
    monkeypatch.setattr(common, "SELF_CHECK_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(matmul.BUCKETS_CHECK, "results", {})
    monkeypatch.setattr(matmul, "buckets_agree", lambda weight, bias: False)
    weight, x = randn((24, 32), torch.bfloat16, 10), randn((100, 32), torch.bfloat16, 11)
    with pytest.warns(UserWarning, match=r"token buckets .* changed bits for \(24, 32, "):
        batched = bik.linear(x, weight)
    bik.linear(x, weight)  # checked once per shape: no second warning, same bucket
    assert bucket_spy == [matmul.TOKEN_BUCKETS[0]] * 2
    assert_bitwise(batched[99:], bik.linear(x[99:], weight), "last row")


def test_a_passed_bucket_check_runs_once_per_shape(monkeypatch, bucket_spy):
    calls = []
    monkeypatch.setattr(common, "SELF_CHECK_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(matmul.BUCKETS_CHECK, "results", {})
    monkeypatch.setattr(matmul, "buckets_agree", lambda weight, bias: calls.append(1) or True)
    weight = randn((24, 32), torch.bfloat16, 10)
    for rows in (1, 100, 300, 600):
        bik.linear(randn((rows, 32), torch.bfloat16, 12), weight)
    assert calls == [1]
    assert [b.block_t for b in bucket_spy] == [16, 128, 128, 256]


def test_an_unchecked_shape_uses_the_single_row_bucket_while_a_graph_records(
    monkeypatch, bucket_spy
):
    monkeypatch.setattr(common, "SELF_CHECK_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(matmul.BUCKETS_CHECK, "results", {})
    monkeypatch.setattr(common, "capturing", lambda device: True)
    bik.linear(randn((100, 32), torch.bfloat16, 12), randn((24, 32), torch.bfloat16, 10))
    assert bucket_spy == [matmul.TOKEN_BUCKETS[0]] and matmul.BUCKETS_CHECK.results == {}


def test_an_unaligned_view_gives_the_aligned_bits():
    storage = randn((1 + 5 * 64,), torch.bfloat16, 13)
    view = storage[1:].view(5, 64)  # 2 bytes past a 16-byte boundary
    assert view.data_ptr() % 16 != 0
    weight = randn((32, 64), torch.bfloat16, 14)
    assert_bitwise(bik.linear(view, weight), bik.linear(view.clone(), weight), "unaligned view")
    common = importlib.import_module("bik.backends.triton._common")
    assert common.aligned(view).data_ptr() % 16 == 0
    assert common.aligned(storage) is storage


@pytest.mark.parametrize("rows", [1, 40])
def test_a_fused_projection_gives_the_separate_projections_bits(rows):
    # vLLM keeps q/k/v (and gate/up) as one weight; transformers as separate ones.
    parts = [randn((n, 64), torch.bfloat16, 20 + n) for n in (128, 32, 32)]
    x = randn((rows, 64), torch.bfloat16, 15)
    fused = bik.linear(x, torch.cat(parts))
    separate = torch.cat([bik.linear(x, w) for w in parts], dim=-1)
    assert_bitwise(fused, separate, "fused q/k/v vs separate")


@pytest.fixture
def grouped_spy(monkeypatch):
    """The token bucket of every grouped TMA launch, in order."""
    seen = []
    launch = grouped.grouped_linear_launch

    def spy(x, weight, offsets, out, bucket):
        seen.append(bucket)
        return launch(x, weight, offsets, out, bucket)

    monkeypatch.setattr(grouped, "grouped_linear_launch", spy)
    return seen


@settings(max_examples=6)
@given(
    dtype=st.sampled_from(HALF),
    rows=st.integers(1, 300),
    groups=st.integers(1, 6),
    n=st.integers(1, 20).map(lambda i: 8 * i),
    k=st.integers(1, 12).map(lambda i: 8 * i),
    seed=st.integers(0, 50),
)
def test_an_expert_gets_the_bits_of_its_own_linear(grouped_spy, dtype, rows, groups, n, k, seed):
    """MoE experts in the nn.Linear layout run the linear kernel's tile product: every row of
    every group (tiles that end inside a group, groups left empty) has the bits bik.linear
    gives it through its group's weight alone."""
    grouped_spy.clear()  # the fixture outlives one example
    x, weight = randn((rows, k), dtype, seed), randn((groups, n, k), dtype, seed + 1)
    chosen = torch.randint(0, groups, (rows,), generator=torch.Generator().manual_seed(seed))
    out = bik.grouped_linear(x, weight, chosen.to(DEVICE))
    for group in range(groups):
        mine = (chosen == group).to(DEVICE)
        if mine.any():
            assert_bitwise(out[mine], bik.linear(x[mine], weight[group]), f"group {group}")
    assert grouped_spy == [matmul.bucket_for(-(-rows // groups), weight[0], None)]


def test_the_grouped_bucket_follows_the_mean_rows_per_group(grouped_spy, monkeypatch):
    monkeypatch.setattr(common, "SELF_CHECK_DEVICES", ())
    weight = randn((4, 24, 32), torch.bfloat16, 16)
    x = randn((600, 32), torch.bfloat16, 17)
    chosen = (torch.arange(600) % 4).to(DEVICE)
    decode = bik.grouped_linear(x[:8], weight, chosen[:8])
    prefill = bik.grouped_linear(x, weight, chosen)
    assert [b.block_t for b in grouped_spy] == [16, 128]
    assert_bitwise(prefill[:8], decode, "8 rows alone vs among 600")


def test_other_expert_layouts_and_fp32_take_the_tile_kernel(grouped_spy):
    chosen = torch.tensor([0, 1, 1], device=DEVICE)
    stacked = randn((2, 48, 32), torch.bfloat16, 18)  # gate and up halves of [G, 2N, K]
    for weight in (stacked[:, :24], stacked.float()):
        x = randn((3, 32), weight.dtype, 19)
        expected = torch.einsum("rk,rnk->rn", x.double(), weight.double()[chosen])
        got = bik.grouped_linear(x, weight, chosen)
        assert_close_to_reference(got, expected, weight.dtype, "grouped tile kernel")
    assert grouped_spy == []


def test_the_grouped_check_passes_here():  # the interpreter, or the GPU's own binaries
    assert grouped.grouped_agrees(randn((4, 24, 32), torch.bfloat16, 20))


def test_a_failed_grouped_check_runs_one_linear_per_group(monkeypatch, grouped_spy):
    monkeypatch.setattr(common, "SELF_CHECK_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(grouped.GROUPED_CHECK, "results", {})
    monkeypatch.setattr(grouped, "grouped_agrees", lambda weight: False)
    weight, x = randn((3, 24, 32), torch.bfloat16, 21), randn((50, 32), torch.bfloat16, 22)
    chosen = (torch.arange(50) % 3).to(DEVICE)
    with pytest.warns(UserWarning, match="grouped linear kernel changed bits for"):
        out = bik.grouped_linear(x, weight, chosen)
    assert grouped_spy == []
    for group in range(3):
        mine = chosen == group
        assert_bitwise(out[mine], bik.linear(x[mine], weight[group]), f"group {group}")


def test_an_unchecked_grouped_shape_is_refused_while_a_graph_records(monkeypatch):
    monkeypatch.setattr(common, "SELF_CHECK_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(grouped.GROUPED_CHECK, "results", {})
    monkeypatch.setattr(common, "capturing", lambda device: True)
    weight, x = randn((3, 24, 32), torch.bfloat16, 21), randn((5, 32), torch.bfloat16, 22)
    with pytest.raises(RuntimeError, match="run one eager call first"):
        bik.grouped_linear(x, weight, torch.zeros(5, dtype=torch.int64, device=DEVICE))
