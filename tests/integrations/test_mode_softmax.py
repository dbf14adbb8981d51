"""batch_invariant_mode over softmax / log_softmax / mean: torch's layouts, dims and 0-d inputs."""

import pytest
import torch

from bik.mode import batch_invariant_mode

pytestmark = pytest.mark.filterwarnings("ignore:Warning only once")

FUNCTIONS = {"softmax": torch.softmax, "log_softmax": torch.log_softmax}
INPUTS = {  # name -> (tensor, dims to reduce along)
    "contiguous": (lambda: torch.randn(3, 4, 5), (0, 1, 2, -1, -2)),
    "transposed": (lambda: torch.randn(4, 3, 5).transpose(0, 1), (0, 1, 2)),
    "channels_last": (
        lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        (1, 3),
    ),
}


@pytest.mark.parametrize("layout", sorted(INPUTS))
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_mode_softmax_returns_torchs_layout(name, layout):
    fn, (make, dims) = FUNCTIONS[name], INPUTS[layout]
    torch.manual_seed(0)
    x = make()
    for dim in dims:
        expected = fn(x, dim)
        with batch_invariant_mode():
            out = fn(x, dim)
        assert out.stride() == expected.stride() and out.is_contiguous(), (dim, out.stride())
        assert out.view(-1).shape == (x.numel(),)
        assert torch.allclose(out, expected, atol=1e-6)


def test_mode_softmax_along_a_leading_dim_does_not_depend_on_the_batch():
    """Softmax over dim 1 of [B, V, S]: a (b, s) row's bits do not depend on B."""
    x = torch.randn(17, 300, 3, generator=torch.Generator().manual_seed(1))
    with batch_invariant_mode():
        for fn in FUNCTIONS.values():
            alone = fn(x[:1], 1)
            assert all(torch.equal(fn(x[:n], 1)[:1], alone) for n in (2, 9, 17))


@pytest.mark.parametrize("value", [2.0, -3.5, float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_mode_softmax_of_a_0d_tensor_matches_torch(name, value):
    fn, x = FUNCTIONS[name], torch.tensor(value)
    for dim in (0, -1):
        expected = fn(x, dim)
        with batch_invariant_mode():
            out = fn(x, dim)
        assert out.shape == () and out.dtype == expected.dtype
        assert torch.equal(out, expected) or (out.isnan() and expected.isnan())
    with pytest.raises(IndexError, match="Dimension out of range"):
        fn(x, 1)
    with batch_invariant_mode(), pytest.raises(IndexError, match="Dimension out of range"):
        fn(x, 1)


def test_mode_mean_handles_0d_inputs_and_bad_dims_like_torch():
    x = torch.tensor(2.5)
    with batch_invariant_mode():
        assert torch.equal(x.mean(), x) and torch.equal(x.mean(0), x) and x.mean(-1).shape == ()
        y = torch.randn(2, 3, 4)
        with pytest.raises(IndexError, match="Dimension out of range"):
            y.mean(3)  # must not silently reduce dim 3 % 3 = 0
        with pytest.raises(ValueError, match=r"dim of aten\.mean\.dim: expected distinct dims"):
            y.mean((0, -3))
        empty = torch.randn(0, 5).mean(0)  # a mean over no elements is NaN
        assert empty.shape == (5,) and empty.isnan().all()


def test_mode_mean_refuses_a_float64_accumulation_it_cannot_do():
    with batch_invariant_mode(), pytest.raises(NotImplementedError, match=r"dtype=torch\.float64"):
        torch.ones(3, 4).mean(-1, dtype=torch.float64)
