"""backends.resolve on a CUDA device, checked on any machine with stand-in backends: "auto"
gives the Triton backend (the performance path), the "cuda" backend (the portable reference
kernels) only when Triton cannot run or when it is asked for by name."""

import pytest
import torch

import bik
from bik import backends
from bik.backends.base import Backend

CUDA = torch.device("cuda")  # a device descriptor only: nothing runs on it here


def _kernel(*args):
    raise AssertionError("a stand-in backend's kernel ran")


def _stand_in(name):
    return Backend(name, ("cuda",), _kernel, _kernel, _kernel, _kernel, _kernel)


@pytest.fixture
def stand_ins(monkeypatch):
    """Replace the triton and cuda backends by stand-ins that accept CUDA devices; returns a
    function that makes one of them unavailable (as a missing package or build would)."""
    for name in ("triton", "cuda"):
        monkeypatch.setitem(backends._SOURCES, name, _stand_in(name))
        monkeypatch.delitem(backends._LOADED, name, raising=False)

    def unavailable(name):
        monkeypatch.setitem(backends._SOURCES, name, f"bik.backends._no_such_{name}_module")
        monkeypatch.delitem(backends._LOADED, name, raising=False)

    yield unavailable
    for name in ("triton", "cuda"):  # drop the stand-ins' loaded objects with them
        backends._LOADED.pop(name, None)


def test_auto_gives_a_cuda_device_the_triton_backend(stand_ins):
    with bik.use_backend("auto"):
        assert backends.resolve(CUDA).name == "triton"
    assert backends._AUTO_ORDER["cuda"][0] == "triton"


def test_the_cuda_backend_runs_only_when_asked_or_when_triton_cannot(stand_ins):
    with bik.use_backend("cuda"):
        assert backends.resolve(CUDA).name == "cuda"
    stand_ins("triton")
    with bik.use_backend("auto"):
        assert backends.resolve(CUDA).name == "cuda"


def test_auto_without_any_cuda_backend_names_what_it_tried(stand_ins):
    stand_ins("triton")
    stand_ins("cuda")
    with bik.use_backend("auto"), pytest.raises(RuntimeError, match=r"Tried \['triton', 'cuda'\]"):
        backends.resolve(CUDA)
