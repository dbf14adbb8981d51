"""Hopper (sm_90a) proof on a machine with no GPU: the matmul launches bik makes, compiled by
the Triton wheel's own ptxas, use the instructions the design relies on.

- the linear kernel: HGMMA (wgmma) at every token bucket, never HMMA; TMA loads; no
  local-memory spills; shared memory within Hopper's 227 KiB;
- a row count never changes the binary inside a bucket (no specialisation on M);
- the tile and grouped kernels: HGMMA for 16-bit inputs, FMA (IEEE, never TF32) for fp32;
- the grouped linear kernel (experts in the nn.Linear layout): the linear kernel's HGMMA at
  every bucket, TMA loads, no spills;
- the TP-invariant chunked kernel: HGMMA, no spill at up to 8 chunks, one binary for every
  row count; its decode form (a program per chunk, then a plane tree of plain adds) too.
"""

import importlib

import pytest
import torch

sm90 = pytest.importorskip("bik.testing.sm90")
if not (sm90.TOOLS / "ptxas").exists():
    pytest.skip("the triton wheel ships no ptxas", allow_module_level=True)

matmul = importlib.import_module("bik.backends.triton.matmul")
triton_chunked = importlib.import_module("bik.backends.triton.chunked")
triton_grouped = importlib.import_module("bik.backends.triton.grouped")
HOPPER_SHARED_BYTES = 227 * 1024  # the most shared memory one block may use on sm_90


def linear(rows, n, k, dtype=torch.bfloat16, bucket=None):
    x, out = sm90.meta(rows, k, dtype=dtype), sm90.meta(rows, n, dtype=dtype)
    weight, bias = sm90.meta(n, k, dtype=dtype), sm90.meta(n, dtype=dtype)
    return matmul.linear_launch(x, weight, bias, out, bucket or matmul.token_bucket(rows))


def tile_matmul(rows, n, k, dtype):
    a, out = sm90.meta(1, rows, k, dtype=dtype), sm90.meta(1, rows, n, dtype=dtype)
    b = sm90.meta(n, k, dtype=dtype).t().unsqueeze(0)
    return matmul.matmul_launch(a, b, None, out)


def chunked(rows, chunks, planes=False):
    a, out = sm90.meta(rows, 4096), sm90.meta(rows, 4096, dtype=torch.float32)
    return triton_chunked.chunked_launches(a, sm90.meta(4096, 4096).t(), chunks, out, planes)


def grouped():
    a, out = sm90.meta(512, 4096), sm90.meta(512, 1024)
    b = sm90.meta(8, 1024, 4096).transpose(1, 2)
    offsets = torch.zeros(9, dtype=torch.int64, device="meta")
    return triton_grouped.grouped_matmul_launch(a, b, offsets, out)


def grouped_linear(bucket):
    """Qwen3-30B-A3B's expert gate/up projection: 128 experts of [1536, 2048]."""
    x, out = sm90.meta(4096, 2048), sm90.meta(4096, 1536)
    offsets = torch.zeros(129, dtype=torch.int64, device="meta")
    weight = sm90.meta(128, 1536, 2048)
    return triton_grouped.grouped_linear_launch(x, weight, offsets, out, bucket)


LAUNCHES = {
    **{("linear", b): linear(b.max_rows or 4096, 4096, 4096, bucket=b) for b in matmul.ALL_BUCKETS},
    "linear fp16": linear(1, 4096, 4096, torch.float16),
    "linear M=1": linear(1, 4096, 4096),
    "linear M=13": linear(13, 4096, 4096),
    "linear M=600": linear(600, 4096, 4096),
    "linear M=8192": linear(8192, 4096, 4096),
    **{("tile", rows): tile_matmul(rows, 256, 4096, torch.bfloat16) for rows in (1, 17, 4096)},
    "tile fp32": tile_matmul(64, 256, 4096, torch.float32),
    "grouped": grouped(),
    **{("grouped linear", b): grouped_linear(b) for b in matmul.ALL_BUCKETS},
    **{("chunked", rows, c): chunked(rows, c)[0] for rows in (1, 8192) for c in (1, 2, 4, 8)},
    **{("planes", i): launch for i, launch in enumerate(chunked(1, 8, planes=True))},
}


@pytest.fixture(scope="module")
def binary():
    """Every launch above compiled for sm_90a, in one go."""
    return dict(zip(LAUNCHES, sm90.compile_launches(list(LAUNCHES.values()))))


def assert_hopper_grade(binary):
    assert binary.mma and all(m.startswith("HGMMA.64x") for m in binary.mma), binary.mma
    assert binary.count("HMMA") == 0
    assert binary.local_bytes == 0, f"spills: {binary.local_bytes} bytes of local memory"
    assert binary.shared_bytes <= HOPPER_SHARED_BYTES


@pytest.mark.parametrize(
    "bucket", matmul.ALL_BUCKETS, ids=lambda b: f"W{b.block_w}xT{b.block_t}s{b.num_stages}"
)
def test_linear_uses_wgmma_and_tma_at_every_bucket(binary, bucket):
    compiled = binary["linear", bucket]
    assert_hopper_grade(compiled)
    assert compiled.count("UTMALDG") > 0, "operands should arrive by TMA"
    assert (compiled.num_warps, compiled.num_stages) == (bucket.num_warps, bucket.num_stages)


def test_the_prefill_bucket_is_a_128x256_tile_on_64x256_wgmma(binary):
    compiled = binary["linear", matmul.TOKEN_BUCKETS[-1]]
    assert compiled.mma == {"HGMMA.64x256x16.F32.BF16"}


def test_linear_fp16_uses_wgmma(binary):
    assert_hopper_grade(binary["linear fp16"])


def test_the_row_count_never_changes_the_binary_inside_a_bucket(binary):
    # M = 1 would be a constant, M = 16 "divisible by 16", if M were specialised on.
    first_bucket = ("linear", matmul.TOKEN_BUCKETS[0])
    for group in (["linear M=1", "linear M=13", first_bucket], ["linear M=600", "linear M=8192"]):
        first = binary[group[0]]
        for other in group[1:]:
            assert binary[other].specialization == first.specialization, other
            assert binary[other].code() == first.code(), other


def test_tile_kernel_is_one_binary_for_every_row_count_and_uses_wgmma(binary):
    assert_hopper_grade(binary["tile", 1])
    tiles = [binary["tile", rows] for rows in (1, 17, 4096)]
    assert len({(b.specialization, b.code()) for b in tiles}) == 1


def test_fp32_matmul_is_ieee_fma_not_tf32(binary):
    assert not binary["tile fp32"].mma, "fp32 must not run on tensor cores (TF32)"
    assert binary["tile fp32"].count("FFMA") > 0


def test_grouped_kernel_uses_wgmma(binary):
    assert_hopper_grade(binary["grouped"])


@pytest.mark.parametrize(
    "bucket", matmul.ALL_BUCKETS, ids=lambda b: f"W{b.block_w}xT{b.block_t}s{b.num_stages}"
)
def test_grouped_linear_uses_wgmma_and_tma_at_every_bucket(binary, bucket):
    compiled = binary["grouped linear", bucket]
    assert_hopper_grade(compiled)
    assert compiled.count("UTMALDG") > 0, "operands should arrive by TMA"
    assert compiled.mma == binary["linear", bucket].mma, "the linear kernel's instruction"


@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_chunked_kernel_runs_on_tensor_cores_without_spills(binary, chunks):
    assert_hopper_grade(binary["chunked", 1, chunks])
    rows = [binary["chunked", r, chunks] for r in (1, 8192)]
    assert len({(b.specialization, b.code()) for b in rows}) == 1


def test_decode_planes_run_the_same_instruction_and_an_fma_free_tree(binary):
    """The per-chunk programs issue the in-register tree's MMA; the plane tree only adds."""
    assert_hopper_grade(binary["planes", 0])
    assert binary["planes", 0].mma == binary["chunked", 1, 8].mma
    tree = binary["planes", 1]
    assert tree.local_bytes == 0 and not tree.mma and tree.count("FFMA") == 0
    assert tree.count("FADD") > 0
