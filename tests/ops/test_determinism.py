"""Thread-count invariance and run-to-run determinism across processes; backend registry."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import invariant_backends

import bik
from bik import backends

ROOT = Path(__file__).resolve().parents[2]  # the repository
SUPPORT = ROOT / "tests" / "support"  # the shared helper scripts


def _fingerprints(backend, threads, extra_env=None):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "OPENBLAS_NUM_THREADS": str(threads),
        "PYTHONPATH": str(ROOT),
        **(extra_env or {}),
    }
    done = subprocess.run(
        [sys.executable, str(SUPPORT / "ops_fingerprint.py"), backend],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


# The cpu case checks the thread axis cheaply; the triton case (the interpreter, whose numpy
# BLAS threads it varies) costs twice as much and runs in the full suite only.
@pytest.mark.parametrize(
    "backend_name",
    [
        pytest.param(name, marks=pytest.mark.slow) if name == "triton" else name
        for name in invariant_backends()
    ],
)
def test_thread_count_and_reruns_do_not_change_bits(backend_name):
    one = _fingerprints(backend_name, 1)
    assert len(one.splitlines()) == 8
    assert _fingerprints(backend_name, 2) == one
    assert _fingerprints(backend_name, 2) == one  # a second process, same bits


def test_set_backend_validates_and_restores():
    with pytest.raises(ValueError, match="backend: expected one of"):
        bik.set_backend("no-such-backend")
    assert bik.get_backend() == "auto"
    with bik.use_backend("reference"):
        assert bik.get_backend() == "reference"
    assert bik.get_backend() == "auto"
    assert {"auto", "reference", "triton"} <= set(bik.available_backends())


def test_reference_backend_runs_plain_torch():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with bik.use_backend("reference"):
        assert torch.allclose(bik.linear(x, w), torch.nn.functional.linear(x, w))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cpu_tensors_without_interpreter_get_a_clear_error():
    script = (
        "import os, torch, bik; os.environ.pop('TRITON_INTERPRET', None)\n"
        "bik.set_backend('triton')\n"
        "try:\n    bik.rms_norm(torch.ones(2, 2), torch.ones(2))\n"
        "except RuntimeError as e:\n    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "TRITON_INTERPRET=1" in out


def test_bik_backend_environment_variable_selects_the_backend():
    env = {**os.environ, "BIK_BACKEND": "reference", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", "import bik; print(bik.get_backend())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "reference"


def test_auto_resolves_to_an_invariant_backend():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert backends.resolve(device).invariant


def test_unbuilt_cpu_backend_says_how_to_build_it():
    script = (
        "import sys; sys.modules['bik._cpu'] = None\n"
        "import torch, bik; bik.set_backend('cpu')\n"
        "try:\n    bik.rms_norm(torch.ones(2, 2), torch.ones(2))\n"
        "except ImportError as e:\n    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "cpu backend is not built" in out and "pip install -e ." in out
