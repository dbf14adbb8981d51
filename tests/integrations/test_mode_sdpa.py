"""batch_invariant_mode over SDPA: grouped-query attention the way transformers calls it."""

import pytest
import torch
import torch.nn.functional as F

import bik
from bik.mode import batch_invariant_mode

pytestmark = pytest.mark.filterwarnings("ignore:Warning only once")

HQ, HKV, T, D = 8, 2, 37, 64


class _GqaModule(torch.nn.Module):
    """What transformers' sdpa_attention_forward reads from an attention module."""

    num_key_value_groups = HQ // HKV
    is_causal = True


def _qkv(batch, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HQ, T, D, generator=gen).to(dtype)
    k, v = (torch.randn(batch, HKV, T, D, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mode_runs_transformers_gqa_sdpa_invariantly(dtype):
    sdpa = pytest.importorskip("transformers.integrations.sdpa_attention")
    module, scale = _GqaModule(), D**-0.5
    q, k, v = _qkv(6, dtype=dtype)

    def forward(q_, k_, v_):
        return sdpa.sdpa_attention_forward(module, q_, k_, v_, None, scaling=scale)[0]

    expected = bik.attention(q, k, v, causal=True, scale=scale).transpose(1, 2)
    if dtype == torch.float32:  # negative control: torch's decode and prefill bits differ
        assert not torch.equal(forward(q[:, :, -1:], k, v), forward(q, k, v)[:, -1:])
    with batch_invariant_mode():
        prefill = forward(q, k, v)  # enable_gqa=True, is_causal=True: the CPU flash kernel
        alone = forward(q[3:4], k[3:4], v[3:4])
        decode = forward(q[:, :, -1:], k, v)  # one query over the cache: is_causal=False
        decode_alone = forward(q[3:4, :, -1:], k[3:4], v[3:4])
    assert torch.equal(prefill, expected)
    assert torch.equal(alone[0], prefill[3])
    assert torch.equal(decode, prefill[:, -1:]) and torch.equal(decode_alone[0], decode[3])


def test_mode_gqa_sdpa_backward_matches_torch():
    """The logsumexp the mode hands torch's backward kernel pairs query and kv heads right."""
    q, k, v = _qkv(2, seed=1)
    grad_out = torch.randn(2, HQ, T, D, generator=torch.Generator().manual_seed(2))

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        out.backward(grad_out)
        return [t.grad for t in leaves]

    expected = grads()
    with batch_invariant_mode():
        first, second = grads(), grads()
    for name, a, b, e in zip("qkv", first, second, expected):
        assert torch.equal(a, b), f"grad {name}: not run-to-run deterministic"
        assert torch.allclose(a, e, atol=1e-4), f"grad {name}: differs from torch's"
