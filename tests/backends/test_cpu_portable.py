"""The cpu backend built WITHOUT AVX-512 (-march=x86-64-v3, an AVX2 machine) gives the same
bits as the installed build: the AVX-512 code paths are faster forms of the portable lane
arithmetic, not other orders. The one documented exception is bf16 matmul on CPUs with
AVX512-BF16 (vdpbf16ps pair order), which is compared against float64 instead.

Both builds are the cpu backend's kernels: their tensors live on the CPU also on a machine
with a GPU (where the other tests' tensors live on the GPU)."""

import importlib.util
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from helpers import DTYPES, assert_bitwise, assert_close_to_reference
from helpers import randn as device_randn

from bik.backends import load
from bik.backends.base import AttentionOptions
from bik.backends.native import native_backend

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("g++") is None,
    reason="needs g++ on x86_64",
)


def randn(shape, dtype, seed, scale=1.0):
    """helpers.randn's tensor (same values), on the CPU whatever the test device is."""
    return device_randn(shape, dtype, seed, scale).cpu()


def _cpu_flags():
    lines = (ROOT / "csrc/cpu/flags.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    pybind11 = pytest.importorskip("pybind11")
    native = load("cpu")

    out = tmp_path_factory.mktemp("portable") / ("_cpu" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(
        [
            "g++",
            "-shared",
            "-fPIC",
            "-std=c++17",
            *_cpu_flags(),
            "-march=x86-64-v3",
            f"-I{ROOT / 'csrc/include'}",
            f"-I{pybind11.get_include()}",
            f"-I{sysconfig.get_paths()['include']}",
            *map(str, sorted((ROOT / "csrc/cpu").glob("*.cpp"))),
            "-o",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    spec = importlib.util.spec_from_file_location("_cpu", out)
    lib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lib)
    return native, native_backend(
        "cpu-portable",
        "cpu",
        lib,
        order=load("cpu").order,
        attention_sinks=True,
        chunked_matmul=True,
    )


def _has_avx512_bf16():
    return "avx512_bf16" in Path("/proc/cpuinfo").read_text()


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_matches_the_portable_build(backends, dtype):
    native, portable = backends
    # K odd and N past one panel: k-pair tails and column tails.
    a, w, bias = randn((1, 37, 161), dtype, 1), randn((90, 161), dtype, 2), randn((90,), dtype, 3)
    b = w.t().unsqueeze(0)
    if dtype == torch.bfloat16 and _has_avx512_bf16():
        reference = torch.nn.functional.linear(a.double(), w.double(), bias.double())
        assert_close_to_reference(portable.matmul(a, b, bias), reference, dtype, "portable")
        assert_close_to_reference(native.matmul(a, b, bias), reference, dtype, "native")
    else:
        assert_bitwise(native.matmul(a, b, bias), portable.matmul(a, b, bias), "matmul")


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_matmul_matches_the_portable_build(backends, dtype):
    # The TP-invariant order is the fma chain on widened values for every dtype (no pair
    # instruction), so even bf16 matches: row and column tails, chunks of 20 k (a 16-deep
    # packing tile and a tail), a strided A.
    native, portable = backends
    a, w = randn((13, 320), dtype, 7)[:, ::2], randn((70, 160), dtype, 8)
    for chunks in (1, 2, 8):
        assert_bitwise(
            native.chunked_matmul(a, w.t(), chunks),
            portable.chunked_matmul(a, w.t(), chunks),
            f"chunked_matmul, {chunks} chunks",
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_ops_match_the_portable_build(backends, dtype):
    native, portable = backends
    x, w = randn((7, 173), dtype, 4), randn((173,), dtype, 5)
    logits, tokens = randn((5, 1001), dtype, 6, scale=4.0), torch.tensor([0, 5, 999, 1000, 17])
    assert_bitwise(native.rms_norm(x, w, 1e-6), portable.rms_norm(x, w, 1e-6), "rms_norm")
    for temperature in (1.0, 0.7):
        assert_bitwise(
            native.log_softmax(logits, temperature, torch.float32),
            portable.log_softmax(logits, temperature, torch.float32),
            "log_softmax",
        )
        assert_bitwise(
            native.token_logprobs(logits, tokens, temperature),
            portable.token_logprobs(logits, tokens, temperature),
            "token_logprobs",
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap, window, sinks", [(None, None, False), (1.5, 20, True)])
def test_attention_matches_the_portable_build(backends, dtype, softcap, window, sinks):
    native, portable = backends
    q, k, v = (
        randn((2, 4, 9, 40), dtype, 7),
        randn((2, 2, 75, 40), dtype, 8),
        randn((2, 2, 75, 40), dtype, 9),
    )
    kv_start = torch.tensor([0, 11], dtype=torch.int32)
    args = (q, k, v, kv_start, AttentionOptions(True, 40**-0.5, 32, softcap, window))
    if sinks:
        args += (torch.linspace(-2.0, 3.0, 4),)
    assert_bitwise(native.attention(*args), portable.attention(*args), "attention")
