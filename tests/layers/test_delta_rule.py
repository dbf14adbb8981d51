"""The gated delta rule (bik.layers.delta_rule): one fixed order, so a row's output and state
bits depend on nothing but its own tokens: not on the batch, nor on where calls cut the
sequence, nor on prefill vs decode; accurate against float64; and the plain torch forms that
transformers ships disagree between prefill and decode (the negative control)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

import bik
from bik import backends
from bik.layers.delta_rule import causal_conv1d, gated_delta_rule, l2norm, recurrence, tree_sum

CASES = settings(max_examples=min(10, settings.default.max_examples))


def inputs(batch, tokens, heads=2, k_dim=8, v_dim=6, seed=0, per_key=False):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, tokens, heads, k_dim, generator=gen) for _ in range(2))
    v = torch.randn(batch, tokens, heads, v_dim, generator=gen)
    # a log decay: exp(g) in (0.37, 1], one per head or one per key channel
    g = -torch.rand(batch, tokens, heads, *((k_dim,) if per_key else ()), generator=gen)
    beta = torch.rand(batch, tokens, heads, generator=gen)
    return q, k, v, g, beta


def float64_reference(q, k, v, g, beta, use_qk_l2norm):
    """The recurrence in float64 with torch's own sums (transformers' formula)."""
    q, k, v, g, beta = (t.double().transpose(1, 2) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q / q.shape[-1] ** 0.5
    state = torch.zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        read = (state * k[:, :, t, :, None]).sum(-2)
        state = (
            state + k[:, :, t, :, None] * ((v[:, :, t] - read) * beta[:, :, t, None])[..., None, :]
        )
        out.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, 1), state


def test_tree_sum_is_a_sum_in_one_fixed_order():
    x = torch.randn(3, 13, 5, dtype=torch.float64)
    torch.testing.assert_close(tree_sum(x, 1)[:, 0], x.sum(1))
    row = torch.randn(1, 13, 5)
    assert torch.equal(tree_sum(torch.cat([row, torch.randn(6, 13, 5)]), 1)[:1], tree_sum(row, 1))


@pytest.mark.parametrize("use_qk_l2norm", [False, True])
def test_accuracy_against_float64(use_qk_l2norm):
    q, k, v, g, beta = inputs(3, 17)
    out, state = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=use_qk_l2norm)
    ref_out, ref_state = float64_reference(q, k, v, g, beta, use_qk_l2norm)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), ref_state, rtol=1e-5, atol=1e-5)


@CASES
@given(
    batch=st.integers(2, 6),
    tokens=st.integers(1, 12),
    row=st.integers(0, 5),
    seed=st.integers(0, 50),
)
def test_a_row_alone_equals_the_row_in_a_batch(batch, tokens, row, seed):
    row %= batch
    q, k, v, g, beta = inputs(batch, tokens, seed=seed)
    out, state = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    one = slice(row, row + 1)
    alone, alone_state = gated_delta_rule(
        q[one], k[one], v[one], g[one], beta[one], use_qk_l2norm=True
    )
    assert torch.equal(out[one], alone) and torch.equal(state[one], alone_state)


@CASES
@given(tokens=st.integers(2, 16), cut=st.integers(1, 15), seed=st.integers(0, 50))
def test_prefill_equals_chunked_prefill_equals_decode(tokens, cut, seed):
    """One call over the prompt, two calls cut anywhere carrying the state, and one call a
    token: the same outputs and final state, bit for bit."""
    cut = min(cut, tokens - 1)
    q, k, v, g, beta = inputs(2, tokens, seed=seed)
    whole, state = gated_delta_rule(q, k, v, g, beta)
    first, mid = gated_delta_rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut])
    rest, end = gated_delta_rule(
        q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], initial_state=mid
    )
    assert torch.equal(torch.cat([first, rest], 1), whole) and torch.equal(end, state)
    carried, steps = None, []
    for t in range(tokens):
        step = slice(t, t + 1)
        o, carried = gated_delta_rule(
            q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], initial_state=carried
        )
        steps.append(o)
    assert torch.equal(torch.cat(steps, 1), whole) and torch.equal(carried, state)


def test_negative_control_transformers_prefill_and_decode_forms_differ():
    """transformers' chunked form (its prefill) and recurrent form (its decode) of the same
    tokens give other bits: the mismatch bik's one order removes."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta = inputs(2, 70, k_dim=16, v_dim=16)
    chunked, _ = modeling.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=True
    )
    recurrent, _ = modeling.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=True
    )
    assert not torch.equal(chunked, recurrent)
    ours, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    torch.testing.assert_close(ours, recurrent, rtol=1e-4, atol=1e-5)


def test_bad_shapes_name_the_argument():
    q, k, v, g, beta = inputs(2, 3)
    with pytest.raises(ValueError, match="key: expected the shape of query"):
        gated_delta_rule(q, k[:, :2], v, g, beta)
    with pytest.raises(ValueError, match=r"value: expected \[B, T, H, V\]"):
        gated_delta_rule(q, k, v[:1], g, beta)
    with pytest.raises(ValueError, match=r"beta: expected shape \(2, 3, 2\)"):
        gated_delta_rule(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match=r"initial_state: expected shape \(2, 2, 8, 6\)"):
        gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 8, 5))


# ---- the backends' kernels and the gradient ----------------------------------------------


def composition(q, k, v, g, beta, state):
    """What gated_delta_rule runs without a kernel: the torch composition, by hand."""
    q, k, v, g, beta = (t.float().transpose(1, 2) for t in (q, k, v, g, beta))
    q, k = l2norm(q), l2norm(k)
    out, state = recurrence(q / q.shape[-1] ** 0.5, k, v, g.exp(), beta, state)
    return out.transpose(1, 2), state


@settings(max_examples=min(6, settings.default.max_examples))
@given(
    batch=st.integers(1, 3),
    tokens=st.integers(1, 6),
    k_dim=st.sampled_from([1, 5, 8, 12]),
    v_dim=st.sampled_from([3, 16, 70]),  # 70: a tail past the Triton kernel's 64-wide block
    per_key=st.booleans(),
    seed=st.integers(0, 50),
)
def test_backend_kernels_give_the_compositions_bits(
    backend, batch, tokens, k_dim, v_dim, per_key, seed
):
    """Each invariant backend's delta_rule kernel (C++, Triton) equals the torch composition
    bit for bit: outputs and final state, from a random state, every key width (a power of
    two or padded to one), both decay forms."""
    assert backends.load(backend).delta_rule is not None or backend == "cuda"  # cuda: none
    tensors = inputs(batch, tokens, 2, k_dim, v_dim, seed, per_key)
    q, k, v, g, beta = (t.to(DEVICE) for t in tensors)
    state = torch.randn(batch, 2, k_dim, v_dim, generator=torch.Generator().manual_seed(seed))
    state = state.to(DEVICE)
    out, end = gated_delta_rule(q, k, v, g, beta, state, use_qk_l2norm=True)
    with bik.use_backend("reference"):  # it has no kernel: the composition runs
        plain = gated_delta_rule(q, k, v, g, beta, state, use_qk_l2norm=True)
    for got, expected in zip((out, end), composition(q, k, v, g, beta, state)):
        assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip((out, end), plain))


def test_the_gradient_differentiates_the_same_order():
    """With inputs that require grad the composition runs (autograd through it): the same
    forward bits as the kernel, and gradients close to float64 autograd of the formula."""
    q, k, v, g, beta = inputs(2, 9)
    kernel_out, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    out, state = gated_delta_rule(*leaves, use_qk_l2norm=True)
    assert torch.equal(out.detach(), kernel_out)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * weights).sum() + state.sum(), leaves)
    wide = [t.double().requires_grad_() for t in (q, k, v, g, beta)]
    ref_out, ref_state = float64_reference(*wide, True)
    ref_grads = torch.autograd.grad((ref_out * weights.double()).sum() + ref_state.sum(), wide)
    for name, got, ref in zip(["q", "k", "v", "g", "beta"], grads, ref_grads):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5, msg=name)


# ---- the short causal convolution ----------------------------------------------------------


def conv_inputs(batch, channels, length, width=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, length, generator=gen).to(dtype)
    return x, torch.randn(channels, width, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_matches_torch_conv1d_in_float64(dtype):
    x, weight = conv_inputs(2, 5, 11, dtype=dtype)
    reference = F.conv1d(x.double(), weight.double()[:, None], padding=3, groups=5)[..., :11]
    got = causal_conv1d(x, weight)
    assert got.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), reference, rtol=tolerance, atol=tolerance)


@CASES
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 20),
    row=st.integers(0, 3),
    cut=st.integers(0, 20),
    seed=st.integers(0, 50),
)
def test_causal_conv1d_rows_and_decode_windows_keep_their_bits(batch, length, row, cut, seed):
    x, weight = conv_inputs(batch, 6, length, seed=seed)
    row, cut = row % batch, cut % length
    whole = causal_conv1d(x, weight)
    assert torch.equal(causal_conv1d(x[row : row + 1], weight), whole[row : row + 1])
    # a decode step convolves the cached window (the last inputs) and keeps the last output
    window = x[:, :, max(0, cut - 3) : cut + 1]
    assert torch.equal(causal_conv1d(window, weight)[..., -1], whole[..., cut])


def test_causal_conv1d_bad_shapes_name_the_argument():
    x, weight = conv_inputs(1, 4, 5)
    with pytest.raises(ValueError, match="weight: expected 4 channels"):
        causal_conv1d(x, weight[:3])
    with pytest.raises(ValueError, match="x"):
        causal_conv1d(x[0], weight)


# ---- a decay per key channel (Kimi Delta Attention) ---------------------------------------


def test_a_decay_per_key_channel_keeps_the_order_and_matches_transformers():
    """Kimi Delta Attention's g [B, T, H, K]: a row alone == in a batch, a cut sequence ==
    the whole, close to transformers' recurrent form, whose chunked form (its prefill)
    disagrees with it (the negative control)."""
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, _, beta = inputs(3, 40, k_dim=16, v_dim=16)
    g = -torch.rand(3, 40, 2, 16, generator=torch.Generator().manual_seed(5))
    out, state = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    alone, _ = gated_delta_rule(q[1:2], k[1:2], v[1:2], g[1:2], beta[1:2], use_qk_l2norm=True)
    assert torch.equal(out[1:2], alone)
    first, mid = gated_delta_rule(
        q[:, :17], k[:, :17], v[:, :17], g[:, :17], beta[:, :17], None, True
    )
    rest, end = gated_delta_rule(
        q[:, 17:], k[:, 17:], v[:, 17:], g[:, 17:], beta[:, 17:], mid, True
    )
    assert torch.equal(torch.cat([first, rest], 1), out) and torch.equal(end, state)
    recurrent, _ = modeling.recurrent_kimi_delta_attention(
        q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True
    )
    chunked, _ = modeling.chunk_kimi_delta_attention(
        q, k, v, g, beta, chunk_size=16, use_qk_l2norm_in_kernel=True
    )
    assert not torch.equal(chunked, recurrent)
    torch.testing.assert_close(out, recurrent, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"g: expected shape \(3, 40, 2\) or \(3, 40, 2, 16\)"):
        gated_delta_rule(q, k, v, g[..., :3], beta)


def test_a_convolution_bias_must_have_one_entry_per_channel():
    """Issue 72, item 9: a ``(1,)`` bias was broadcast to every channel."""
    x, weight = torch.randn(1, 3, 5), torch.randn(3, 4)
    causal_conv1d(x, weight, torch.randn(3))
    with pytest.raises(ValueError, match=r"^bias: expected shape \(3,\), one per channel"):
        causal_conv1d(x, weight, torch.randn(1))
