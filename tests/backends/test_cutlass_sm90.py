"""The CUTLASS sm90 GEMM (csrc/cutlass/gemm_sm90.cu, bik/testing/cutlass_sm90.py): built here
with nvcc and no GPU, its SASS read with the Triton wheel's cuobjdump (the instruction, TMA,
no spills), its host-only entry points called through ctypes; its bits on a Hopper GPU."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from bik.testing import cutlass_sm90

ROOT = Path(__file__).resolve().parents[2]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(scope="module")
def library():
    """The library: built by `make cutlass-sm90` in the dev venv where nvcc is (about a minute
    on 2 cores); elsewhere (a GPU machine, no registry for CUTLASS's headers) a carried one."""
    if shutil.which("nvcc") is not None and (ROOT / ".venv" / "bin" / "python").exists():
        done = subprocess.run(
            ["make", "-s", "cutlass-sm90"], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    if not cutlass_sm90.library_path().is_file():
        pytest.skip("no CUTLASS library: make cutlass-sm90 needs nvcc and the dev venv")
    return cutlass_sm90.library_path()


def test_both_kernels_are_the_one_instruction_with_tma_and_no_spill(library):
    from bik.testing import sm90

    sass, usage = sm90.dump(library)
    mma = sm90.mma_instructions(sass)
    assert mma == {"HGMMA.64x256x16.F32.BF16"}, mma  # one shape whatever M is: a fixed order
    assert "UTMALDG" in sass  # operands arrive by TMA
    kernels = re.findall(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    assert len(kernels) == 2  # without and with bias
    for registers, stack, local in kernels:
        assert int(stack) == int(local) == 0 and int(registers) <= 255


def test_the_host_entry_points_answer_without_a_gpu(library):
    assert cutlass_sm90.config() == "128 features x 256 tokens x 64, HGMMA.64x256x16, cooperative"
    assert cutlass_sm90.can_implement(1, 4096, 4096)
    assert not cutlass_sm90.can_implement(1, 4096, 4100)  # K not a multiple of 8
    for biased in (False, True):
        assert cutlass_sm90.workspace_bytes(8192, 4096, 4096, biased, 132) >= 0


def test_bad_arguments_are_refused_by_name():
    x, weight = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^x: expected a tensor on a Hopper GPU"):
        cutlass_sm90.linear(x, weight)
    with pytest.raises(ValueError, match=r"^x: expected a contiguous bfloat16 tensor"):
        cutlass_sm90.linear(x.float(), weight)


def test_a_missing_library_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("BIK_CUTLASS_SM90", str(tmp_path / "none.so"))
    cutlass_sm90.library.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="make cutlass-sm90"):
            cutlass_sm90.library()
    finally:
        cutlass_sm90.library.cache_clear()


@pytest.mark.skipif(not HOPPER, reason="the kernel runs on Hopper (sm_90) only")
@pytest.mark.parametrize("bias", [False, True])
def test_a_rows_bits_do_not_depend_on_m_and_match_a_float64_reference(library, bias):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048 + 37, 1024, generator=gen).bfloat16().cuda()
    weight = torch.randn(768, 1024, generator=gen).div(32).bfloat16().cuda()
    b = torch.randn(768, generator=gen).bfloat16().cuda() if bias else None
    full = cutlass_sm90.linear(x, weight, b)
    for rows in (slice(0, 1), slice(5, 6), slice(100, 229), slice(2048, 2085)):
        assert torch.equal(cutlass_sm90.linear(x[rows].contiguous(), weight, b), full[rows])
    reference = x.double() @ weight.double().T + (b.double() if bias else 0)
    torch.testing.assert_close(full.double(), reference, atol=2e-2, rtol=1.6e-2)
