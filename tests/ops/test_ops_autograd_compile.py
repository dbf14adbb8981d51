"""Second derivatives, torch.compile and meta tensors: every op is a torch.library custom op
whose compiled, eager and fake paths agree."""

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, assert_bitwise, randn

import bik
from bik.backends import reference
from bik.backends.base import AttentionOptions


def _linear(x, w, b):
    return bik.linear(x, w, b)


def _attention(q, k, v):
    return bik.attention(q, k, v, split_size=32)


def _reference_attention(q, k, v, softcap=None, window=None):
    kv_start = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)
    options = AttentionOptions(True, q.shape[-1] ** -0.5, 256, softcap, window)
    return reference.attention(q, k, v, kv_start, options)


TOKENS = torch.tensor([3, 0, 7, 5, 1], device=DEVICE)
# op under test, its float64 oracle, input shapes
CASES = {
    "linear": (_linear, F.linear, [(5, 12), (7, 12), (7,)]),
    "rms_norm": (
        lambda x, w: bik.rms_norm(x, w),
        lambda x, w: reference.rms_norm(x, w, 1e-6),
        [(5, 12), (12,)],
    ),
    "log_softmax": (bik.log_softmax, lambda x: torch.log_softmax(x, -1), [(5, 9)]),
    "token_logprobs": (
        lambda x: bik.token_logprobs(x, TOKENS, 0.7),
        lambda x: reference.token_logprobs(x, TOKENS, 0.7),
        [(5, 9)],
    ),
    "attention": (_attention, _reference_attention, [(1, 4, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)]),
    "attention_softcap_window": (
        lambda q, k, v: bik.attention(q, k, v, split_size=32, softcap=1.5, window=3),
        lambda q, k, v: _reference_attention(q, k, v, softcap=1.5, window=3),
        [(1, 4, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)],
    ),
}


def _second_derivatives(fn, inputs):
    """d/d(inputs) of sum(grad_0 ** 2), where grad_0 = d sum(fn(inputs) ** 2) / d inputs[0]."""
    (first,) = torch.autograd.grad(fn(*inputs).pow(2).sum(), inputs[0], create_graph=True)
    assert first.requires_grad, "the gradient lost its graph under create_graph=True"
    return torch.autograd.grad(first.pow(2).sum(), inputs, allow_unused=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_double_backward_matches_float64(backend, name):
    fn, oracle, shapes = CASES[name]
    inputs = [randn(s, torch.float32, seed=i).requires_grad_() for i, s in enumerate(shapes)]
    wide = [t.detach().double().requires_grad_() for t in inputs]
    for got, want in zip(_second_derivatives(fn, inputs), _second_derivatives(oracle, wide)):
        if want is None:
            continue
        assert got is not None
        torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=2e-4)


def _every_op(x, w, b, norm_w, q, k, v, tokens):
    h = bik.rms_norm(bik.linear(x, w, b), norm_w)
    return (
        bik.log_softmax(h),
        bik.token_logprobs(h, tokens, 0.7),
        bik.matmul(x, w.t()),
        bik.attention(q, k, v, split_size=32),
        bik.attention(q, k, v, split_size=32, softcap=1.5, window=5),
    )


def _every_op_inputs():
    return (
        randn((6, 40), torch.float32, 1),
        randn((33, 40), torch.float32, 2),
        randn((33,), torch.float32, 3),
        randn((33,), torch.float32, 4),
        randn((2, 4, 37, 16), torch.float32, 5),
        randn((2, 2, 37, 16), torch.float32, 6),
        randn((2, 2, 37, 16), torch.float32, 7),
        torch.arange(6, device=DEVICE) * 5,
    )


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_ops_equal_eager_bitwise_in_one_graph(backend, compiler):
    if backend == "triton" and DEVICE.type == "cpu":
        pytest.skip("Triton under the interpreter is already covered by the cpu backend case")
    inputs = _every_op_inputs()
    torch._dynamo.reset()
    # fullgraph: every op traces as one custom op, with no graph break
    compiled = torch.compile(_every_op, backend=compiler, fullgraph=True)
    for eager, traced in zip(_every_op(*inputs), compiled(*inputs)):
        assert torch.equal(eager, traced)


def test_compiled_training_step_runs_the_custom_ops_backward():
    x, w = randn((4, 12), torch.float32, 1), randn((5, 12), torch.float32, 2)
    x.requires_grad_()

    def loss(x_):
        return bik.log_softmax(bik.linear(x_, w)).pow(2).sum()

    torch._dynamo.reset()
    (compiled_grad,) = torch.autograd.grad(
        torch.compile(loss, backend="aot_eager", fullgraph=True)(x), x
    )
    (eager_grad,) = torch.autograd.grad(loss(x), x)
    assert torch.equal(compiled_grad, eager_grad)


def test_meta_tensors_get_shapes_and_dtypes_without_running_a_kernel():
    meta = torch.device("meta")
    x, w = torch.empty(3, 5, 8, device=meta), torch.empty(6, 8, device=meta)
    assert bik.linear(x, w).shape == (3, 5, 6)
    assert bik.rms_norm(x, torch.empty(8, device=meta)).shape == x.shape
    assert bik.log_softmax(x, dtype=torch.bfloat16).dtype == torch.bfloat16
    tokens = torch.zeros(3, 5, dtype=torch.int64, device=meta)
    out = bik.token_logprobs(x, tokens)
    assert (out.shape, out.dtype, out.device) == ((3, 5), torch.float32, meta)
    q, kv = torch.empty(2, 4, 3, 8, device=meta), torch.empty(2, 2, 9, 8, device=meta)
    assert bik.attention(q, kv, kv).shape == q.shape


IN_PLACE_CASES = {  # 3-D inputs: the kernels see rows, the result is reshaped back
    "linear": (lambda x: bik.linear(x, torch.ones(7, 12, device=DEVICE)), (2, 3, 12)),
    "matmul": (lambda x: bik.matmul(x, torch.ones(7, 12, device=DEVICE).t()), (2, 3, 12)),
    "rms_norm": (lambda x: bik.rms_norm(x, torch.ones(12, device=DEVICE)), (2, 3, 12)),
    "log_softmax": (bik.log_softmax, (2, 3, 12)),
    "token_logprobs": (
        lambda x: bik.token_logprobs(x, torch.zeros(2, 3, dtype=torch.long, device=DEVICE)),
        (2, 3, 12),
    ),
    "attention": (lambda x: bik.attention(x, x, x), (1, 2, 3, 12)),
}


@pytest.mark.parametrize("name", sorted(IN_PLACE_CASES))
def test_outputs_can_be_modified_in_place_under_autograd(backend, name):
    """As with torch's own ops (e.g. verl's ``logits.div_(temperature)``): the output of a
    custom op must not be a view, or autograd refuses the in-place change."""
    fn, shape = IN_PLACE_CASES[name]
    x = randn(shape, torch.float32, 0).requires_grad_()
    out = fn(x)
    out.mul_(2.0)
    out.sum().backward()
    assert x.grad is not None


def test_fake_tensors_and_make_fx_go_through_the_custom_ops():
    """A raw kernel would write through a fake tensor's pointer, or vanish from a traced graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    x, w = torch.randn(3, 8), torch.randn(5, 8)
    with FakeTensorMode() as mode:
        out = bik.linear(mode.from_tensor(x), mode.from_tensor(w))
    assert out.shape == (3, 5)
    graph = make_fx(lambda a, b: bik.log_softmax(bik.linear(a, b)))(x, w)
    targets = {str(node.target) for node in graph.graph.nodes}
    assert {"bik.matmul.default", "bik.log_softmax.default"} <= targets
    assert torch.equal(graph(x, w), bik.log_softmax(bik.linear(x, w)))


def test_value_checks_are_skipped_on_fake_and_meta_tensors():
    """Issue 25, item 14: under a bare FakeTensorMode, bik.attention(kv_start=...) and
    bik.token_logprobs raised DataDependentOutputException: validation read values that a
    fake tensor does not have. Real tensors are still checked."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, kv_start = torch.randn(2, 2, 4, 8), torch.tensor([0, 1])
    logits, tokens = torch.randn(3, 10), torch.tensor([1, 2, 3])
    with FakeTensorMode() as mode:
        fake_q = mode.from_tensor(q)
        out = bik.attention(fake_q, fake_q, fake_q, kv_start=mode.from_tensor(kv_start))
        logp = bik.token_logprobs(mode.from_tensor(logits), mode.from_tensor(tokens))
    assert out.shape == q.shape and logp.shape == (3,)
    assert bik.token_logprobs(logits.to("meta"), tokens.to("meta")).shape == (3,)
    with pytest.raises(ValueError, match=r"tokens: expected values in \[0, 9\]"):
        bik.token_logprobs(logits, torch.tensor([1, 2, 10]))


def test_vmap_over_batch_dims():
    """Issue 25, item 13: ``torch.vmap(lambda t: bik.linear(t, w))(x)`` failed with "Cannot
    access data pointer". Row ops run once on the examples' rows (a row's bits do not depend
    on the others); batched weights and attention run example by example. Either way the
    result equals one call per example, bit for bit."""
    x, w, ws = torch.randn(4, 3, 16), torch.randn(8, 16), torch.randn(4, 8, 16)
    norm_w, logits = torch.randn(16), torch.randn(4, 3, 10)
    tokens = torch.randint(0, 10, (4, 3))
    q = torch.randn(4, 1, 2, 5, 8)
    each = lambda f, *args: torch.stack([f(*(a[i] for a in args)) for i in range(4)])
    cases = [
        (lambda t: bik.linear(t, w), (x,)),
        (bik.linear, (x, ws)),  # a batched weight
        (lambda t: bik.rms_norm(t, norm_w), (x,)),
        (bik.log_softmax, (logits,)),
        (bik.token_logprobs, (logits, tokens)),
        (lambda t: bik.token_logprobs(t, tokens[0]), (logits,)),  # only the logits batched
        (lambda t: bik.attention(t, t, t, causal=True), (q,)),
    ]
    for f, args in cases:
        assert_bitwise(torch.vmap(f)(*args), each(f, *args))
    assert_bitwise(
        torch.vmap(lambda t: bik.linear(t, w), in_dims=1)(x), bik.linear(x, w).transpose(0, 1)
    )
    nested = torch.vmap(torch.vmap(lambda t: bik.linear(t, w)))(x)
    assert_bitwise(nested, bik.linear(x, w))
    with pytest.raises(ValueError, match=r"tokens: expected values in \[0, 9\]"):
        torch.vmap(bik.token_logprobs)(logits, tokens.masked_fill(tokens == tokens[0, 0], 10))
