"""batch_invariant_mode: unmodified torch code (MLP + attention block) becomes invariant."""

import pytest
import torch
import torch.nn.functional as F

import bik.mode
from bik.mode import batch_invariant_mode

pytestmark = pytest.mark.filterwarnings("ignore:Warning only once")


class Block(torch.nn.Module):
    """A plain-torch transformer block: RMSNorm, causal SDPA, SiLU MLP, log-softmax head."""

    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.norm = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        b, t, d = x.shape
        h = F.rms_norm(x, (d,), self.norm, 1e-6)
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, d))
        x = x + self.down(F.silu(self.up(F.rms_norm(x, (d,), self.norm, 1e-6))))
        return torch.log_softmax(x, -1)


def _row0_equal(model, x, sizes):
    with torch.no_grad():
        alone = model(x[:1])[0]
        return [torch.equal(model(x[:n])[0], alone) for n in sizes]


def test_mode_makes_a_plain_block_invariant():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(64, 1, 256)
    assert not all(_row0_equal(model, x, (2, 8, 64))), "negative control: plain torch should differ"
    with batch_invariant_mode():
        assert bik.mode.is_batch_invariant_mode_enabled()
        assert all(_row0_equal(model, x, (2, 8, 64)))
    assert not bik.mode.is_batch_invariant_mode_enabled()


def test_mode_backward_runs_and_is_deterministic():
    torch.manual_seed(0)
    model, x = Block(dim=64), torch.randn(3, 5, 64)
    grads = []
    with batch_invariant_mode():
        for _ in range(2):
            model.zero_grad()
            model(x).sum().backward()
            grads.append(model.qkv.weight.grad.clone())
    assert torch.equal(*grads) and grads[0].abs().sum() > 0


def test_mode_mean_and_softmax_match_torch():
    x = torch.randn(5, 7, 300)
    with batch_invariant_mode():
        mean, soft = x.mean(dim=(0, 2), keepdim=True), torch.softmax(x, dim=1)
    assert torch.allclose(mean, x.double().mean(dim=(0, 2), keepdim=True).float(), atol=1e-6)
    assert torch.allclose(soft, torch.softmax(x, dim=1), atol=1e-6)


def test_mode_refuses_what_it_cannot_cover():
    q = torch.randn(1, 2, 4, 16)
    with batch_invariant_mode():
        with pytest.raises(NotImplementedError, match="attn_mask"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
        with pytest.raises(NotImplementedError, match=r"torch\.float64"):
            torch.mm(torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64))


def test_mode_bmm_entry_does_not_depend_on_the_batch():
    torch.manual_seed(1)
    a, b = torch.randn(33, 1, 256), torch.randn(33, 256, 300)
    with batch_invariant_mode():
        alone = torch.bmm(a[:1], b[:1])
        assert all(torch.equal(torch.bmm(a[:n], b[:n])[:1], alone) for n in (2, 9, 33))
    # the float64 reference runs outside the mode (it covers float32/16 only)
    assert torch.allclose(alone, (a[:1].double() @ b[:1].double()).float(), atol=1e-4)


def test_mode_makes_a_transformers_moe_block_invariant():
    """Qwen2-MoE's block, unmodified: router softmax, experts (torch._grouped_mm or per-expert
    F.linear), SiLU and the shared expert's sigmoid gate all run through bik in the mode."""
    from bik import testing

    block = testing.load_model("tiny-qwen2_moe").model.layers[0].mlp
    torch.manual_seed(3)
    x = torch.randn(1, 300, 128)

    def tokens_alone_vs_together():
        with torch.no_grad():
            together = block(x)[0, ::10]
            alone = torch.cat([block(x[:, t : t + 1])[0] for t in range(0, 300, 10)])
        return torch.equal(together, alone)

    assert not tokens_alone_vs_together(), "negative control: plain torch should differ"
    with batch_invariant_mode():
        assert tokens_alone_vs_together()
