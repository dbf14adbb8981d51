"""What bik cannot patch: the report lists only modules that reduce."""

import pytest
import torch

import bik

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM

from bik.tools import verify

_SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


def _random_init(family, **overrides):
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**_SMALL, **overrides})
    return AutoModelForCausalLM.from_config(config).eval()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))


def _listed_types(report):
    return {entry.rsplit(" (", 1)[1].rstrip(")") for entry in report.unpatched}


def test_report_lists_only_unpatched_modules_that_reduce():
    gpt2 = bik.patch_model(_gpt2(), strict=False)
    assert _listed_types(gpt2) == {"Conv1D", "LayerNorm"}  # not GPT2Block, GELU, Dropout
    gemma2 = bik.patch_model(_random_init("gemma2"), strict=False)
    assert _listed_types(gemma2) == {"Gemma2RMSNorm"}  # not GELUTanh nor the containers
    oss = _random_init("gpt_oss", num_local_experts=4, num_experts_per_tok=2)
    assert _listed_types(bik.patch_model(oss, strict=False)) == {
        "GptOssTopKRouter",
        "GptOssExperts",
    }
    assert "NOT patched" in str(gemma2) and "GELUTanh" not in str(gemma2)


class _Squash(torch.nn.Module):
    """Elementwise, no weights: nothing to make invariant."""

    def forward(self, x):
        return torch.tanh(x)


class _Scale(torch.nn.Module):
    """Owns a weight and is not a Linear or an RMSNorm: bik cannot vouch for its order."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.weight.sum()


def test_strict_accepts_unknown_elementwise_modules_and_rejects_unknown_weighted_ones():
    model = verify.load_model("tiny-llama")
    for layer in model.model.layers:
        layer.mlp.act_fn = _Squash()
    report = bik.patch_model(model)
    assert report.unpatched == []
    model = verify.load_model("tiny-llama")
    model.model.layers[1].mlp.act_fn = _Scale()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.act_fn \(_Scale\).*strict=False"):
        bik.patch_model(model)
