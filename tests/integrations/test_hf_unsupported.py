"""Attention features bik does not implement raise at call time; the report lists only modules
that reduce."""

import pytest
import torch

import bik

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bik import testing

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


@pytest.fixture(scope="module")
def patched_llama():
    model = testing.load_model("tiny-llama")
    bik.patch_model(model)
    return model


_GEN = torch.Generator().manual_seed(0)
Q, K, V = (torch.randn(2, h, 9, 32, generator=_GEN) for h in (4, 2, 2))


def _call(model, q=Q, **kwargs):
    """bik's registered attention function called as a transformers attention module calls it."""
    module = model.model.layers[0].self_attn
    fn = ALL_ATTENTION_FUNCTIONS[bik.hf.ATTENTION_NAME]
    return fn(module, q, K, V, None, scaling=module.scaling, **kwargs)[0]


@pytest.mark.parametrize(
    "keyword, value",
    [
        ("sliding_window", 4),  # 9 keys: the window is active
        ("dropout", 0.1),
        ("is_causal", False),
        ("output_attentions", True),
        ("position_bias", torch.zeros(1, 4, 9, 9)),
    ],
)
def test_unimplemented_attention_keyword_raises_naming_it_and_the_module(
    patched_llama, keyword, value
):
    with pytest.raises(NotImplementedError, match=rf"LlamaAttention.*'llama'.*{keyword}="):
        _call(patched_llama, **{keyword: value})


def test_inactive_or_bookkeeping_keywords_do_not_change_the_output(patched_llama):
    plain = _call(patched_llama)
    same = _call(
        patched_llama,
        softcap=None,
        s_aux=None,
        sliding_window=9,  # every key inside the window
        dropout=0.0,
        is_causal=True,
        output_attentions=False,
        position_ids=torch.arange(9)[None],
        use_cache=True,
        output_hidden_states=True,  # the HF Trainer and hidden-state users pass these through
        return_dict=True,
        num_items_in_batch=torch.tensor(18),
    )
    assert torch.equal(plain, same)
    decode = _call(patched_llama, Q[:, :, -1:], sliding_window=None)
    assert torch.equal(decode, plain[:, -1:])  # output is [B, Tq, Hq, D]


def test_gemma2_soft_capping_is_computed():
    model = _random_init("gemma2", attn_logit_softcapping=0.5, final_logit_softcapping=1.0)
    ids = torch.randint(3, 64, (2, 7))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        bik.patch_model(model)
        patched = model(input_ids=ids).logits
    torch.testing.assert_close(patched, expected, rtol=1e-5, atol=1e-5)


def test_softcap_keyword_is_applied(patched_llama):
    module = patched_llama.model.layers[0].self_attn
    k, v = (t.repeat_interleave(2, 1) for t in (K, V))  # GQA: 2 query heads per KV head
    scores = 0.05 * torch.tanh(Q @ k.transpose(-1, -2) * module.scaling / 0.05)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    expected = (scores.masked_fill(~causal, -torch.inf).softmax(-1) @ v).transpose(1, 2)
    capped = _call(patched_llama, softcap=0.05)
    torch.testing.assert_close(capped, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(capped, _call(patched_llama), atol=1e-3)


def test_an_active_window_runs_in_a_patched_model():
    """Mistral's window (every layer) is a mask over whole cache layers in the patched model,
    active or not; the attention function of a module patch_model did not prepare still
    refuses an active one (the sliding_window case above)."""
    model = _random_init("mistral", sliding_window=4)
    report = bik.patch_model(model)
    assert list(report.patched.values()).count(
        "bik.attention, a sliding window over whole cache layers"
    ) == len(model.model.layers)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 64, (1, 9)))
        left_padded = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
        counted = bik.hf.generation_position_ids(left_padded)  # the row's tokens from 0
        ids = torch.randint(3, 64, (1, 9))
        model(input_ids=ids, attention_mask=left_padded, position_ids=counted)
        # transformers' default numbers columns: a decode step would misplace the row's start
        with pytest.raises(RuntimeError, match="position_ids must number each row's tokens"):
            model(input_ids=ids, attention_mask=left_padded)


def test_training_mode_attention_dropout_raises():
    model = testing.load_model("tiny-qwen3")
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    bik.patch_model(model)
    model(input_ids=torch.randint(3, 256, (1, 5)))  # eval: transformers passes dropout=0.0
    model.train()
    with pytest.raises(NotImplementedError, match=r"dropout=0\.1.*model\.eval\(\)"):
        model(input_ids=torch.randint(3, 256, (1, 5)))


def _listed_types(report):
    return {entry.rsplit(" (", 1)[1].rstrip(")") for entry in report.unpatched}


def test_report_lists_only_unpatched_modules_that_reduce():
    gpt2 = bik.patch_model(_gpt2(), strict=False)
    assert _listed_types(gpt2) == {"Conv1D", "LayerNorm"}  # not GPT2Block, GELU, Dropout
    cohere = bik.patch_model(_random_init("cohere"), strict=False)
    assert _listed_types(cohere) == {"CohereLayerNorm"}  # not SiLU nor the containers
    oss = _random_init("gpt_oss", num_local_experts=4, num_experts_per_tok=2)
    assert not bik.patch_model(oss).unpatched  # a supported family: router and experts too
    assert "NOT patched" in str(cohere) and "SiLU" not in str(cohere).split("NOT")[1]
    gemma2 = bik.patch_model(_random_init("gemma2"))  # (1 + w) RMSNorm, GELU-tanh, soft-caps
    assert not gemma2.unpatched and "bik.gelu_tanh" in gemma2.patched.values()


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
    model = testing.load_model("tiny-llama")
    for layer in model.model.layers:
        layer.mlp.act_fn = _Squash()
    report = bik.patch_model(model)
    assert report.unpatched == []
    model = testing.load_model("tiny-llama")
    model.model.layers[1].mlp.act_fn = _Scale()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.act_fn \(_Scale\).*strict=False"):
        bik.patch_model(model)


def test_a_mask_edited_in_place_is_read_again(patched_llama):
    """The per-forward cache of the mask's bounds must notice an in-place edit of the mask."""
    mask = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    module = patched_llama.model.layers[0].self_attn
    fn = ALL_ATTENTION_FUNCTIONS[bik.hf.ATTENTION_NAME]
    fn(module, Q, K, V, mask, scaling=module.scaling)
    mask[1, :, :, :3] = False  # row 1 becomes left-padded by 3
    edited = fn(module, Q, K, V, mask, scaling=module.scaling)[0]
    fresh = fn(module, Q, K, V, mask.clone(), scaling=module.scaling)[0]
    assert torch.equal(edited, fresh)
