"""The contract's numbers are the same in Python (bik.contract) and in every compiled backend
(csrc/include/bik/contract.h, exported by the bindings)."""

import importlib

import pytest

from bik import contract


@pytest.mark.parametrize("extension", ["bik._cpu", "bik._cuda"])
def test_compiled_backends_export_the_python_contract(extension):
    try:
        lib = importlib.import_module(extension)
    except ImportError:
        pytest.skip(f"{extension} is not built on this machine")
    assert lib.KEY_BLOCK == contract.KEY_BLOCK
    assert lib.DEFAULT_SPLIT_SIZE == contract.DEFAULT_SPLIT_SIZE
    assert lib.CPU_LANES == contract.CPU_LANES
    assert lib.CUDA_ROW_THREADS == contract.CUDA_ROW_THREADS
    assert {
        str(d).removeprefix("torch."): c for d, c in contract.DTYPE_CODES.items()
    } == lib.DTYPE_CODES


def test_row_chunk_depends_on_the_row_length_only():
    assert [contract.row_chunk(n) for n in (0, 1, 2, 3, 100, 4096, 5000)] == [
        1,
        1,
        2,
        4,
        128,
        4096,
        4096,
    ]


def test_split_size_must_be_a_positive_multiple_of_the_key_block():
    assert contract.check_split_size(None) == contract.DEFAULT_SPLIT_SIZE
    assert contract.check_split_size(2 * contract.KEY_BLOCK) == 2 * contract.KEY_BLOCK
    for bad in (0, -32, 33, 64.0, True, "64"):
        with pytest.raises(ValueError, match="split_size: expected a positive multiple"):
            contract.check_split_size(bad)


def test_a_bad_dtype_code_is_refused_by_the_compiled_dispatch():
    lib = pytest.importorskip("bik._cpu")
    with pytest.raises(ValueError, match="dtype code 7"):
        lib.rms_norm(7, 0, 0, 0, 0, 0, 0, 0, 1e-6)
