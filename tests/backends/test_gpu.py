"""CUDA: the sources compile with nvcc on any machine; GPU-only checks run where a GPU is."""

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import bik
from bik import backends

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_kernels_compile_with_nvcc(tmp_path):
    done = subprocess.run(
        [
            "nvcc",
            "-std=c++17",
            "-O3",
            "-gencode=arch=compute_90,code=sm_90",
            f"-I{ROOT / 'csrc/include'}",
            "-c",
            str(ROOT / "csrc/cuda/kernels.cu"),
            "-o",
            str(tmp_path / "kernels.o"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
def test_cuda_bindings_compile_against_the_shared_headers():
    pybind11 = pytest.importorskip("pybind11")
    done = subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-fsyntax-only",
            f"-I{ROOT / 'csrc/include'}",
            f"-I{pybind11.get_include()}",
            f"-I{sysconfig.get_paths()['include']}",
            str(ROOT / "csrc/cuda/bindings.cpp"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["triton", "cuda"])
def test_gpu_backend_is_batch_and_decode_invariant(name):
    backends.load(name).check_device(torch.device("cuda"))
    with bik.use_backend(name):
        x, w = (
            torch.randn(300, 512, device="cuda", dtype=torch.bfloat16),
            torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16),
        )
        assert torch.equal(bik.linear(x, w)[:1], bik.linear(x[:1], w))
        q, k, v = (
            torch.randn(2, 8, 700, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)
        )
        for options in ({}, dict(softcap=30.0, window=200)):  # the window crosses splits
            full = bik.attention(q, k, v, split_size=128, **options)
            last = bik.attention(q[:, :, -1:], k, v, split_size=128, **options)
            assert torch.equal(last, full[:, :, -1:])


@pytest.mark.gpu
@gpu
def test_bad_device_values_stop_the_program_without_host_syncs():
    # Range checks of device tensors are queued on the device (no sync per call); a bad value
    # raises a device-side assert, which poisons the CUDA context: run it in its own process.
    script = (
        "import torch, bik\n"
        "logits = torch.zeros(2, 5, device='cuda')\n"
        "bik.token_logprobs(logits, torch.tensor([1, 7], device='cuda'))\n"
        "torch.cuda.synchronize()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0
    assert "tokens: expected values in [0, 4]" in done.stderr or "device-side assert" in done.stderr
