"""bik's activations and the rotary formula: elementwise, and bit-identical wherever an element
sits (contiguous, strided, alone, in a big batch), which torch's own fp32 activations are not."""

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import DTYPES, assert_bitwise, assert_close_to_reference, randn
from hypothesis import given
from hypothesis import strategies as st

from bik.layers.rotary import apply_rotary, default_inv_freq, rotary_cos_sin
from bik.ops.activations import gelu_tanh, sigmoid, silu, silu_and_mul, softplus

# bik's activation -> torch's own (the accuracy oracle, and the negative control).
ACTIVATIONS = {
    silu: F.silu,
    sigmoid: torch.sigmoid,
    softplus: F.softplus,
    gelu_tanh: functools.partial(F.gelu, approximate="tanh"),
}
NAMED = pytest.mark.parametrize("ours", list(ACTIVATIONS), ids=lambda f: f.__name__)


def strided_copy(x):
    """``x`` as every second element of a buffer: torch's scalar loop runs on it."""
    buffer = x.new_empty(2 * x.numel())
    buffer[::2] = x
    return buffer[::2]


@NAMED
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 3000), seed=st.integers(0, 100))
def test_activation_bits_do_not_depend_on_layout(ours, dtype, n, seed):
    x = randn((n,), dtype, seed, scale=4.0)
    whole = ours(x)
    assert_bitwise(ours(torch.cat((x, x)))[n:], whole, "second half of a bigger tensor")
    assert_bitwise(ours(strided_copy(x)), whole, "strided view")
    assert_bitwise(ours(x[-1:]), whole[-1:], "last element alone")


def test_torch_exp_vector_and_scalar_loops_agree():
    # bik.silu and bik.sigmoid rely on it: a sample of fp32 values across exp's finite range.
    x = torch.linspace(-87.0, 88.0, 400_000)
    assert torch.equal(torch.exp(x), torch.exp(strided_copy(x)))


def test_torch_log_vector_and_scalar_loops_agree():
    # bik.softplus relies on it: its log argument lies in [1, 2]; a wider sample besides.
    for x in (torch.linspace(1.0, 2.0, 400_000), torch.logspace(-30, 30, 400_000)):
        assert torch.equal(torch.log(x), torch.log(strided_copy(x)))


def test_torch_tanh_vector_and_scalar_loops_agree():
    # bik.gelu_tanh relies on it: fp32 tanh is +-1 beyond |x| = 9.1, a sample up to there.
    x = torch.linspace(-10.0, 10.0, 400_000)
    assert torch.equal(torch.tanh(x), torch.tanh(strided_copy(x)))


@NAMED
@pytest.mark.skipif(
    DEVICE.type == "cuda",
    reason="a CPU effect (vector vs scalar loops): on an H100, torch's fp32 activations gave "
    "the same bits on both layouts (benchmarks/results/h100-*-test-kernels-*.log)",
)
def test_negative_control_torch_fp32_activation_depends_on_layout(ours):
    x = randn((20_000,), torch.float32, 1, scale=4.0)
    theirs = ACTIVATIONS[ours]
    assert not torch.equal(theirs(x), theirs(strided_copy(x)))


@NAMED
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_accuracy(ours, dtype):
    x = randn((7, 64), dtype, 3, scale=4.0)
    assert_close_to_reference(ours(x), ACTIVATIONS[ours](x.double()), dtype, ours.__name__)


def test_silu_and_mul_is_silu_times_up():
    x = randn((7, 64), torch.bfloat16, 3, scale=4.0)
    assert_bitwise(silu_and_mul(x), silu(x[:, :32]) * x[:, 32:], "silu_and_mul")


@NAMED
def test_activation_backward(ours):
    x = randn((5, 8), torch.float32, 4).requires_grad_()
    ours(x).sum().backward()
    ref = x.detach().double().requires_grad_()
    ACTIVATIONS[ours](ref).sum().backward()
    torch.testing.assert_close(x.grad.double(), ref.grad, rtol=1e-6, atol=1e-6)


@NAMED
def test_activation_errors(ours):
    with pytest.raises(TypeError, match="x"):
        ours(torch.zeros(3, dtype=torch.int64))


def test_silu_and_mul_errors():
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(torch.zeros(2, 3))


@given(dtype=st.sampled_from(DTYPES), batch=st.integers(1, 4), length=st.integers(1, 50))
def test_rotary_rows_do_not_depend_on_the_batch(dtype, batch, length):
    inv_freq = default_inv_freq(10000.0, 32)
    positions = torch.arange(length).expand(batch, length)
    cos, sin = rotary_cos_sin(inv_freq, positions, 1.0, dtype)
    cos1, sin1 = rotary_cos_sin(inv_freq, positions[-1, -1:], 1.0, dtype)
    assert_bitwise(cos[-1, -1:], cos1, "cos")
    assert_bitwise(sin[-1, -1:], sin1, "sin")


def test_rotary_matches_transformers():
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3 as qwen3

    config = Qwen3Config(hidden_size=64, num_attention_heads=2, head_dim=32, rope_theta=5e5)
    module = qwen3.Qwen3RotaryEmbedding(config).to(DEVICE)
    assert_bitwise(module.inv_freq, default_inv_freq(5e5, 32).to(DEVICE), "inv_freq")
    positions = torch.arange(300, device=DEVICE)[None]
    x = randn((1, 300, 64), torch.float32, 5)
    ours = rotary_cos_sin(module.inv_freq, positions, module.attention_scaling, torch.float32)
    for mine, theirs in zip(ours, type(module).forward(module, x, positions)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=2e-6)
    q, k = randn((1, 2, 300, 32), torch.float32, 6), randn((1, 2, 300, 32), torch.float32, 7)
    cos, sin = ours
    q_ref, _ = qwen3.apply_rotary_pos_emb(q, k, cos, sin)
    assert_bitwise(apply_rotary(q, cos[:, None], sin[:, None]), q_ref, "apply_rotary")


def test_rotary_errors():
    with pytest.raises(TypeError, match="positions"):
        rotary_cos_sin(default_inv_freq(1e4, 8), torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="dim"):
        default_inv_freq(1e4, 7)
