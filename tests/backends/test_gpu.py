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


@pytest.mark.gpu
@gpu
def test_a_decode_step_replayed_from_a_cuda_graph_gives_the_eager_bits():
    # CUDA graphs remove the host work that dominates bik's decode-shaped calls
    # (benchmarks/cuda_graph_probe.py); a replay must run the same kernels on the same data.
    # Split-parallel attention allocates its workspace inside the capture (the graph's pool).
    # (paged_attention is not here: it takes Python lists and copies them to the device on
    # every call, which a capture refuses.)
    device, dtype = torch.device("cuda"), torch.bfloat16
    x, w = (
        torch.randn(4, 512, device=device, dtype=dtype),
        torch.randn(1000, 512, device=device, dtype=dtype),
    )
    norm = torch.randn(512, device=device, dtype=dtype)
    q = torch.randn(4, 8, 1, 64, device=device, dtype=dtype)
    k, v = (torch.randn(4, 2, 700, 64, device=device, dtype=dtype) for _ in range(2))

    def step():
        logits = bik.linear(bik.rms_norm(x, norm), w)
        return (
            logits,
            bik.token_logprobs(logits.float(), torch.arange(4, device=device)),
            bik.attention(q, k, v, split_size=128),
        )

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up (compilation) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("linear", "token_logprobs", "attention"), captured, eager):
        assert torch.equal(a, b), name
