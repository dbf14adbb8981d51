"""Mixture of experts: grouped_linear, routing and the expert MLP. A token's bits depend only on
the token: not on the batch, nor on which or how many other tokens chose the same expert."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import DTYPES, assert_bitwise, assert_close_to_reference, randn
from hypothesis import given, settings
from hypothesis import strategies as st

import bik
from bik import testing
from bik.layers.moe import expert_mlp, route, route_grouped_sigmoid
from bik.ops.grouped_linear import grouped_linear

# The interpreted Triton kernel runs a 64x64 tile per program: keep the cases few and small.
CASES = settings(max_examples=min(10, settings.default.max_examples))


def random_groups(rows, groups, seed):
    chosen = torch.randint(0, groups, (rows,), generator=torch.Generator().manual_seed(seed))
    return chosen.to(DEVICE)


@CASES
@given(
    dtype=st.sampled_from(DTYPES),
    rows=st.integers(1, 140),  # past two 64-row tiles: tail rows of a tile included
    groups=st.integers(1, 5),
    n=st.integers(1, 70),
    k=st.integers(1, 70),
    seed=st.integers(0, 50),
)
def test_grouped_linear_row_depends_only_on_its_row_and_group(
    backend, dtype, rows, groups, n, k, seed
):
    x = randn((rows, k), dtype, seed)
    weight = randn((groups, n, k), dtype, seed + 1)
    chosen = random_groups(rows, groups, seed)
    out = grouped_linear(x, weight, chosen)
    for r in {0, rows // 2, rows - 1}:
        alone = grouped_linear(x[r : r + 1], weight, chosen[r : r + 1])
        assert_bitwise(alone[0], out[r], f"row {r} alone")
        assert_bitwise(bik.linear(x[r], weight[chosen[r]]), out[r], f"row {r} via bik.linear")
    # Other tokens move to other groups and the batch is reversed: row 0 keeps its bits.
    others = torch.cat([chosen[:1], (chosen[1:] + 1) % groups]).flip(0)
    moved = grouped_linear(x.flip(0), weight, others)
    assert_bitwise(moved[-1], out[0], "other rows regrouped and reordered")


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_linear_accuracy(backend, dtype):
    x, weight = randn((37, 48), dtype, 1), randn((4, 20, 48), dtype, 2)
    chosen = random_groups(37, 4, 3)
    expected = torch.einsum("rk,rnk->rn", x.double(), weight.double()[chosen])
    assert_close_to_reference(grouped_linear(x, weight, chosen), expected, dtype, "grouped_linear")


def test_grouped_linear_backward_matches_torch(backend):
    x = randn((30, 24), torch.float32, 4).requires_grad_()
    weight = randn((3, 16, 24), torch.float32, 5).requires_grad_()
    chosen = random_groups(30, 3, 6)
    grad = randn((30, 16), torch.float32, 7)
    grouped_linear(x, weight, chosen).backward(grad)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, weight))
    torch.einsum("rk,rnk->rn", x64, w64[chosen]).backward(grad.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_grouped_linear_errors():
    x, weight, chosen = torch.zeros(3, 4), torch.zeros(2, 5, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="weight"):
        grouped_linear(x, torch.zeros(2, 5, 3), chosen)
    with pytest.raises(TypeError, match="groups: expected dtype int32 or int64"):
        grouped_linear(x, weight, chosen.float())
    with pytest.raises(ValueError, match=r"groups: expected shape \(3,\)"):
        grouped_linear(x, weight, chosen[:2])
    with pytest.raises(ValueError, match="groups"):
        grouped_linear(x, weight, torch.tensor([0, 1, 2]))


def hf_route(logits, top_k, normalize):
    """transformers' router arithmetic: softmax, topk, renormalise."""
    probs = torch.softmax(logits, dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts


@pytest.mark.parametrize("normalize", [True, False])
def test_route_matches_the_transformers_formula(backend, normalize):
    logits = randn((50, 8), torch.float32, 8, scale=3.0)
    weights, experts = route(logits, 3, normalize)
    expected_weights, expected_experts = hf_route(logits.double(), 3, normalize)
    assert torch.equal(experts, expected_experts)
    torch.testing.assert_close(weights.double(), expected_weights, rtol=1e-6, atol=1e-7)


def test_route_breaks_ties_toward_the_lower_expert_index(backend):
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0]], device=DEVICE)
    weights, experts = route(logits, 2, normalize=True)
    assert experts.tolist() == [[1, 2], [0, 1]]
    assert torch.equal(weights, torch.full_like(weights, 0.5))


@CASES
@given(
    dtype=st.sampled_from(DTYPES),
    tokens=st.integers(1, 40),
    top_k=st.integers(1, 4),
    seed=st.integers(0, 50),
    down_chunks=st.sampled_from([None, 4]),  # 4 chunks of the intermediate size 20
)
def test_expert_mlp_token_depends_only_on_the_token(
    backend, dtype, tokens, top_k, seed, down_chunks
):
    hidden, inner, num_experts = 24, 20, 6
    x = randn((tokens, hidden), dtype, seed)
    gate_up = randn((num_experts, 2 * inner, hidden), dtype, seed + 1)
    down = randn((num_experts, hidden, inner), dtype, seed + 2)
    logits = randn((tokens, num_experts), dtype, seed + 3, scale=2.0)
    weights, experts = route(logits, top_k, normalize=True)
    out = expert_mlp(x, experts, weights, gate_up, down, down_chunks=down_chunks)
    last = tokens - 1
    alone_weights, alone_experts = route(logits[last:], top_k, normalize=True)
    assert_bitwise(alone_weights[0], weights[last], "route alone")
    single = expert_mlp(
        x[last:], alone_experts, alone_weights, gate_up, down, down_chunks=down_chunks
    )
    assert_bitwise(single[0], out[last], "token alone")


@pytest.mark.parametrize("down_chunks", [None, 8], ids=["grouped", "tp_invariant"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_mlp_accuracy(backend, dtype, down_chunks):
    tokens, hidden, inner, num_experts, top_k = 9, 32, 16, 4, 2
    x = randn((tokens, hidden), dtype, 1)
    gate_up = randn((num_experts, 2 * inner, hidden), dtype, 2, scale=0.3)
    down = randn((num_experts, hidden, inner), dtype, 3, scale=0.3)
    weights, experts = route(randn((tokens, num_experts), dtype, 4), top_k, normalize=False)
    expected = torch.zeros(tokens, hidden, dtype=torch.float64, device=DEVICE)
    for t in range(tokens):
        for rank in range(top_k):
            e = experts[t, rank]
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            expected[t] += weights[t, rank].double() * (down[e].double() @ (F.silu(gate) * up))
    out = expert_mlp(x, experts, weights, gate_up, down, down_chunks=down_chunks)
    assert_close_to_reference(out, expected, dtype, "expert_mlp")


def test_expert_mlp_down_chunks_errors():
    f32 = torch.float32
    x, gate_up, down = randn((3, 8), f32, 1), randn((2, 12, 8), f32, 2), randn((2, 8, 6), f32, 3)
    weights, experts = route(randn((3, 2), f32, 4), 1, normalize=True)
    for chunks, match in ((3, "power of two"), (4, "intermediate size = 6 is not divisible")):
        with pytest.raises(ValueError, match=f"^chunks: .*{match}"):
            expert_mlp(x, experts, weights, gate_up, down, down_chunks=chunks)


def test_negative_control_transformers_experts_depend_on_the_other_tokens():
    """transformers' own experts (one F.linear per expert over the tokens that chose it):
    a token's output changes with how many other tokens chose its experts."""
    model = testing.load_model("tiny-qwen3_moe").to(DEVICE)
    block = model.model.layers[0].mlp
    x = randn((1, 300, 128), torch.float32, 5)
    with torch.no_grad():
        together = block(x)[0]
        alone = torch.cat([block(x[:, t : t + 1])[0] for t in range(0, 300, 10)])
    assert not torch.equal(together[::10], alone)
    bik.patch_model(model)
    with torch.no_grad():
        together = block(x)[0]
        alone = torch.cat([block(x[:, t : t + 1])[0] for t in range(0, 300, 10)])
    assert_bitwise(together[::10], alone, "patched MoE block, token alone vs in a batch")


def test_route_errors():
    with pytest.raises(ValueError, match=r"top_k: expected an int in \[1, 4\]"):
        route(torch.zeros(2, 4), 5, True)
    with pytest.raises(ValueError, match="logits"):
        route(torch.zeros(4), 1, True)


def test_moe_report_and_router_jitter_refused_in_training():
    model = testing.load_model("tiny-mixtral")
    model.config.router_jitter_noise = 0.1
    for layer in model.model.layers:
        layer.mlp.jitter_noise = 0.1
    report = bik.patch_model(model)
    assert report.patched["model.layers.0.mlp.gate"].startswith("bik.linear + bik MoE routing")
    assert report.patched["model.layers.0.mlp.experts"].startswith("bik.grouped_linear")
    assert not report.unpatched
    ids = torch.tensor([[3, 4, 5]])
    model(ids)  # eval mode: no jitter
    model.train()
    with pytest.raises(NotImplementedError, match=r"router_jitter_noise=0\.1"):
        model(ids)
    bik.unpatch_model(model)
    model(ids)  # transformers' own forward again


def hf_grouped_sigmoid(logits, bias, top_k, groups, topk_groups, normalize, scale):
    """transformers' DeepSeek-V3 / GLM-4.5 router after its linear (in float64 here)."""
    tokens, experts = logits.shape
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(tokens, groups, -1).topk(2, dim=-1)[0].sum(-1)
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask[..., None].expand(-1, -1, experts // groups).reshape(tokens, experts)
    chosen = torch.topk(choice.masked_fill(~mask.bool(), float("-inf")), top_k, -1)[1]
    weights = scores.gather(1, chosen)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, chosen


@pytest.mark.parametrize(("groups", "topk_groups"), [(1, 1), (4, 2), (2, 1)])
def test_grouped_sigmoid_route_matches_the_transformers_formula(groups, topk_groups):
    logits = randn((60, 16), torch.float32, 3, scale=2.0)
    bias = randn((16,), torch.float32, 4, scale=0.3)
    weights, experts = route_grouped_sigmoid(logits, bias, 4, groups, topk_groups, True, 2.5)
    expected_w, expected_e = hf_grouped_sigmoid(
        logits.double(), bias.double(), 4, groups, topk_groups, True, 2.5
    )
    assert torch.equal(experts.sort(-1).values, expected_e.sort(-1).values)  # the same set
    torch.testing.assert_close(
        weights.double().sort(-1).values, expected_w.sort(-1).values, rtol=1e-6, atol=1e-7
    )
    per_group = 16 // groups  # each token's experts come from at most topk_groups groups
    assert all(len((row // per_group).unique()) <= topk_groups for row in experts)


def test_grouped_sigmoid_route_ranks_ties_by_index_and_weights_without_the_bias():
    logits = torch.zeros(2, 4)
    bias = torch.tensor([0.0, 0.5, 0.5, 0.0])  # experts 1 and 2 win on the biased score
    weights, experts = route_grouped_sigmoid(logits, bias, 2, 2, 2, normalize=False, scale=1.0)
    assert experts.tolist() == [[1, 2], [1, 2]]
    assert torch.equal(weights, torch.full((2, 2), 0.5))  # sigmoid(0), the bias left out
    _, one_group = route_grouped_sigmoid(logits, bias, 2, 2, 1, normalize=False, scale=1.0)
    assert one_group.tolist() == [[1, 0], [1, 0]]  # group 0 (experts 0, 1) ties group 1: lower


@CASES
@given(tokens=st.integers(1, 40), seed=st.integers(0, 50))
def test_grouped_sigmoid_route_of_a_token_depends_only_on_the_token(tokens, seed):
    logits = randn((tokens, 16), torch.float32, seed, scale=2.0)
    bias = randn((16,), torch.float32, seed + 1, scale=0.3)
    together = route_grouped_sigmoid(logits, bias, 3, 4, 2, True, 1.5)
    for t in range(tokens):
        alone = route_grouped_sigmoid(logits[t : t + 1], bias, 3, 4, 2, True, 1.5)
        assert_bitwise(together[0][t : t + 1], alone[0], "weights, token alone vs in a batch")
        assert torch.equal(together[1][t : t + 1], alone[1])


def test_grouped_sigmoid_route_errors():
    with pytest.raises(ValueError, match=r"bias: expected shape \(8,\)"):
        route_grouped_sigmoid(torch.zeros(2, 8), torch.zeros(4), 2, 2, 1, True, 1.0)
    with pytest.raises(ValueError, match="groups dividing the 8 experts"):
        route_grouped_sigmoid(torch.zeros(2, 8), torch.zeros(8), 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match=r"top_k: expected an int in \[1, 4\]"):
        route_grouped_sigmoid(torch.zeros(2, 8), torch.zeros(8), 5, 2, 1, True, 1.0)


def test_glm4_moe_report_names_the_sigmoid_router():
    model = testing.load_model("tiny-glm4_moe")
    report = bik.patch_model(model)
    assert report.patched["model.layers.1.mlp.gate"].startswith("bik.linear + sigmoid routing")
    assert "model.layers.0.mlp.gate_proj" in report.patched  # the dense first layer
    assert not report.unpatched
