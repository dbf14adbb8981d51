"""backends.resolve on a CUDA device, checked on any machine with stand-in backends: "auto"
gives the Triton backend (the performance path), the "cuda" backend (the portable reference
kernels) only when Triton cannot run or when it is asked for by name. Backends declare their
kernels by keyword: an op a backend lacks is refused by name, or skipped by "auto"."""

import pytest
import torch

import bik
from bik import backends
from bik.backends.base import ACCELERATORS, Backend

CUDA = torch.device("cuda")  # a device descriptor only: nothing runs on it here


def _kernel(*args):
    raise AssertionError("a stand-in backend's kernel ran")


def _stand_in(name, **kernels):
    every = {op: _kernel for op in backends.OPS}
    return Backend(name=name, device_types=("cuda",), order="stand-in", **{**every, **kernels})


@pytest.fixture
def stand_ins(monkeypatch):
    """Replace the triton and cuda backends by stand-ins that accept CUDA devices (triton's
    without attention); returns a function that makes one of them unavailable (as a missing
    package or build would)."""
    for name in ("triton", "cuda"):
        kernels = {"attention": None} if name == "triton" else {}
        monkeypatch.setitem(backends._SOURCES, name, _stand_in(name, **kernels))
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


def test_an_op_the_selected_backend_lacks_is_refused_by_name(stand_ins):
    with bik.use_backend("triton"):
        with pytest.raises(
            NotImplementedError, match="op attention is not implemented on backend 'triton'"
        ):
            backends.kernel(CUDA, "attention")
        assert backends.kernel(CUDA, "matmul") is _kernel


def test_auto_passes_an_op_on_to_the_next_backend_that_has_it(stand_ins):
    with bik.use_backend("auto"):
        assert backends.resolve(CUDA, "matmul").name == "triton"
        assert backends.resolve(CUDA, "attention").name == "cuda"


def test_sinks_are_refused_on_a_backend_that_does_not_declare_them(monkeypatch):
    plain = backends.load("reference")
    no_sinks = Backend(
        name="no_sinks",
        device_types=(),
        order="reference kernels, no sinks",
        **{op: getattr(plain, op) for op in backends.OPS},
    )
    monkeypatch.setitem(backends._SOURCES, "no_sinks", no_sinks)
    q = torch.randn(1, 2, 3, 8)
    with bik.use_backend("no_sinks"):
        bik.attention(q, q, q)  # without sinks it runs
        with pytest.raises(NotImplementedError, match="sinks: the no_sinks backend has no"):
            bik.attention(q, q, q, sinks=torch.zeros(2))
    backends._LOADED.pop("no_sinks", None)


def test_an_op_name_outside_the_kernel_layouts_is_refused():
    with pytest.raises(ValueError, match="op: expected one of"):
        backends.load("reference").implements("softmax")


def test_the_backends_command_prints_the_op_by_backend_matrix(capsys):
    from bik.__main__ import main

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split() == [name for name in bik.available_backends() if name != "auto"]
    for op in backends.OPS:
        assert any(row.split()[:1] == [op] for row in rows), op
    for field, (op, _) in ACCELERATORS.items():  # each accelerator, with the op it serves
        assert any(row.split()[:2] == [field, f"({op})"] for row in rows), field
        assert f"  {field}: " in out  # and what runs without it
    assert "reference [NOT batch-invariant]" in out and "cpu: runs here on cpu" in out
