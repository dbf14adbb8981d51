"""bik.silu and the rotary formula: elementwise, and bit-identical wherever an element sits
(contiguous, strided, alone, in a big batch), which torch's own fp32 SiLU is not."""

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, assert_bitwise, assert_close_to_reference, randn
from hypothesis import given
from hypothesis import strategies as st

from bik.ops.rotary import apply_rotary, default_inv_freq, rotary_cos_sin
from bik.ops.silu import silu, silu_and_mul


@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 3000), seed=st.integers(0, 100))
def test_silu_bits_do_not_depend_on_layout(dtype, n, seed):
    x = randn((n,), dtype, seed, scale=4.0)
    whole = silu(x)
    assert_bitwise(silu(torch.cat((x, x)))[n:], whole, "second half of a bigger tensor")
    buffer = x.new_empty(2 * n)
    buffer[::2] = x
    assert_bitwise(silu(buffer[::2]), whole, "strided view")
    assert_bitwise(silu(x[-1:]), whole[-1:], "last element alone")


def test_torch_exp_vector_and_scalar_loops_agree():
    # bik.silu relies on it: a sample of fp32 values across the range exp is finite in.
    x = torch.linspace(-87.0, 88.0, 400_000)
    buffer = torch.empty(2 * x.numel())
    buffer[::2] = x
    assert torch.equal(torch.exp(x), torch.exp(buffer[::2]))


def test_negative_control_torch_fp32_silu_depends_on_layout():
    x = randn((20_000,), torch.float32, 1, scale=4.0)
    buffer = torch.empty(2 * x.numel())
    buffer[::2] = x
    assert not torch.equal(F.silu(x), F.silu(buffer[::2]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_accuracy_and_and_mul(dtype):
    x = randn((7, 64), dtype, 3, scale=4.0)
    expected = F.silu(x.double())
    assert_close_to_reference(silu(x), expected, dtype, "silu")
    assert_bitwise(silu_and_mul(x), silu(x[:, :32]) * x[:, 32:], "silu_and_mul")


def test_silu_backward():
    x = randn((5, 8), torch.float32, 4).requires_grad_()
    silu(x).sum().backward()
    ref = x.detach().double().requires_grad_()
    F.silu(ref).sum().backward()
    torch.testing.assert_close(x.grad.double(), ref.grad, rtol=1e-6, atol=1e-6)


def test_silu_errors():
    with pytest.raises(TypeError, match="x"):
        silu(torch.zeros(3, dtype=torch.int64))
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
    module = qwen3.Qwen3RotaryEmbedding(config)
    assert_bitwise(module.inv_freq, default_inv_freq(5e5, 32), "inv_freq")
    positions = torch.arange(300)[None]
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
