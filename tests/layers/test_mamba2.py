"""The Mamba2 selective scan (bik.layers.mamba2): one fixed order, so a row's output and state
bits depend on nothing but its own tokens: not on the batch, nor on where calls cut the
sequence, nor on prefill vs decode; accurate against float64; and the plain torch forms that
transformers ships disagree between prefill and decode (the negative control)."""

import pytest
import torch
from conftest import DEVICE
from hypothesis import given, settings
from hypothesis import strategies as st

import bik
from bik import backends
from bik.layers.mamba2 import recurrence, selective_scan

CASES = settings(max_examples=min(10, settings.default.max_examples))


def inputs(batch, tokens, heads=4, head_dim=3, groups=2, state=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, tokens, heads, head_dim, generator=gen)
    dt = torch.rand(batch, tokens, heads, generator=gen) * 0.5  # a softplus'd step
    a = -torch.rand(heads, generator=gen) * 4  # -exp(A_log)
    b, c = (torch.randn(batch, tokens, groups, state, generator=gen) for _ in range(2))
    d = torch.randn(heads, generator=gen)
    return x, dt, a, b, c, d


def float64_reference(x, dt, a, b, c, d):
    """The recurrence in float64 with torch's own sums."""
    x, dt, a, b, c, d = (t.double() for t in (x, dt, a, b, c, d))
    per_group = x.shape[2] // b.shape[2]
    b, c = (t.repeat_interleave(per_group, dim=2) for t in (b, c))
    state = torch.zeros(x.shape[0], x.shape[2], x.shape[3], b.shape[3], dtype=torch.float64)
    out = []
    for t in range(x.shape[1]):
        step = dt[:, t]
        state = state * torch.exp(step * a)[..., None, None]
        state = state + (step[..., None] * x[:, t])[..., None] * b[:, t, :, None, :]
        out.append((state * c[:, t, :, None, :]).sum(-1) + d[:, None] * x[:, t])
    return torch.stack(out, 1), state


@settings(max_examples=min(6, settings.default.max_examples))
@given(
    batch=st.integers(1, 3),
    tokens=st.integers(1, 6),
    heads_groups=st.sampled_from([(1, 1), (4, 2), (6, 3)]),
    head_dim=st.sampled_from([1, 3, 40]),  # 40: a tail past the Triton kernel's 32-row block
    state_dim=st.sampled_from([1, 5, 16]),
    seed=st.integers(0, 50),
)
def test_backend_kernels_give_the_compositions_bits(
    backend, batch, tokens, heads_groups, head_dim, state_dim, seed
):
    """Each invariant backend's selective_scan kernel (C++, Triton) equals the torch
    composition bit for bit, outputs and final state, from a random state."""
    assert backends.load(backend).selective_scan is not None or backend == "cuda"  # cuda: none
    heads, groups = heads_groups
    tensors = inputs(batch, tokens, heads, head_dim, groups, state_dim, seed)
    x, dt, a, b, c, d = (t.to(DEVICE) for t in tensors)
    state = torch.randn(batch, heads, head_dim, state_dim).to(DEVICE)
    y, end = selective_scan(x, dt, a, b, c, d, state)
    xs, steps = x.transpose(1, 2), dt.transpose(1, 2)
    read, composed_end = recurrence(
        torch.exp(steps * a[:, None]),
        steps[..., None] * xs,
        b.transpose(1, 2),
        c.transpose(1, 2),
        state,
    )
    assert torch.equal(y, (read + d[:, None, None] * xs).transpose(1, 2))
    assert torch.equal(end, composed_end)
    with bik.use_backend("reference"):  # it has no kernel: the composition runs
        plain = selective_scan(x, dt, a, b, c, d, state)
    assert torch.equal(plain[0], y) and torch.equal(plain[1], end)


def test_the_gradient_runs_through_the_same_order():
    """With inputs that require grad the composition runs under autograd: the kernel's
    forward bits, and gradients close to float64 autograd of the formula."""
    args = inputs(2, 7)
    kernel_y, _ = selective_scan(*args)
    leaves = [t.clone().requires_grad_() for t in args]
    y, state = selective_scan(*leaves)
    assert torch.equal(y.detach(), kernel_y)
    weights = torch.randn(y.shape)
    grads = torch.autograd.grad((y * weights).sum() + state.sum(), leaves)
    wide = [t.double().requires_grad_() for t in args]
    y_ref, state_ref = float64_reference(*wide)
    ref_grads = torch.autograd.grad((y_ref * weights.double()).sum() + state_ref.sum(), wide)
    for name, got, ref in zip(["x", "dt", "a", "b", "c", "d"], grads, ref_grads):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5, msg=name)


def test_accuracy_against_float64():
    args = inputs(2, 9)
    y, state = selective_scan(*args)
    y_ref, state_ref = float64_reference(*args)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), state_ref, rtol=1e-5, atol=1e-5)


@CASES
@given(
    batch=st.integers(2, 5),
    tokens=st.integers(1, 10),
    row=st.integers(0, 4),
    seed=st.integers(0, 50),
)
def test_a_row_alone_equals_the_row_in_a_batch(batch, tokens, row, seed):
    row %= batch
    x, dt, a, b, c, d = inputs(batch, tokens, seed=seed)
    y, state = selective_scan(x, dt, a, b, c, d)
    one = slice(row, row + 1)
    alone, alone_state = selective_scan(x[one], dt[one], a, b[one], c[one], d)
    assert torch.equal(y[one], alone) and torch.equal(state[one], alone_state)


@CASES
@given(tokens=st.integers(2, 14), cut=st.integers(1, 13), seed=st.integers(0, 50))
def test_prefill_equals_chunked_prefill_equals_decode(tokens, cut, seed):
    cut = min(cut, tokens - 1)
    x, dt, a, b, c, d = inputs(2, tokens, seed=seed)
    whole, state = selective_scan(x, dt, a, b, c, d)

    def part(t0, t1, initial):
        s = slice(t0, t1)
        return selective_scan(x[:, s], dt[:, s], a, b[:, s], c[:, s], d, initial)

    first, mid = part(0, cut, None)
    rest, end = part(cut, tokens, mid)
    assert torch.equal(torch.cat([first, rest], 1), whole) and torch.equal(end, state)
    carried, steps = None, []
    for t in range(tokens):
        y, carried = part(t, t + 1, carried)
        steps.append(y)
    assert torch.equal(torch.cat(steps, 1), whole) and torch.equal(carried, state)


def test_negative_control_transformers_prefill_and_decode_forms_differ():
    """transformers' chunked scan (its prefill) and its recurrent update (its decode) give
    other bits for the same tokens: the mismatch bik's one order removes."""
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    x, dt, a, b, c, d = inputs(1, 20, heads=4, head_dim=8, groups=2, state=16)
    chunked, final = modeling.mamba2_chunk_scan(
        x, dt, a, b, c, chunk_size=8, D=d, return_final_states=True
    )
    state = torch.zeros_like(final)
    decoded = []
    for t in range(20):
        decoded.append(
            modeling.mamba2_selective_state_update(
                state,
                x[:, t],
                dt[:, t, :, None].expand(-1, -1, 8),
                a[:, None, None].expand(-1, 8, 16),
                b[:, t],
                c[:, t],
                d[:, None].expand(-1, 8),
            )
        )
    decoded = torch.stack(decoded, 1)
    assert not torch.equal(chunked.float(), decoded)
    ours, _ = selective_scan(x, dt, a, b, c, d)
    torch.testing.assert_close(ours, decoded, rtol=1e-4, atol=1e-5)


def test_bad_shapes_name_the_argument():
    x, dt, a, b, c, d = inputs(2, 3)
    with pytest.raises(ValueError, match="dt: expected shape"):
        selective_scan(x, dt[:, :2], a, b, c, d)
    with pytest.raises(ValueError, match="c: expected"):
        selective_scan(x, dt, a, b, c[:, :, :1], d)
    with pytest.raises(ValueError, match="groups do not divide"):
        selective_scan(
            x, dt, a, b[:, :, :1].expand(-1, -1, 3, -1), c[:, :, :1].expand(-1, -1, 3, -1), d
        )
    with pytest.raises(ValueError, match="a: expected shape"):
        selective_scan(x, dt, a[:2], b, c, d)
