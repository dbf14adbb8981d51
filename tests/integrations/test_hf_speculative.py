"""Speculative decoding through transformers' ``generate`` on a bik-patched model: prompt
lookup (``prompt_lookup_num_tokens``) and assisted decoding with a draft model
(``assistant_model``) score a draft's k tokens in one verify forward, which under bik gives
each of them the bits one decode step (and the trainer's full forward) gives them.

  greedy    tokens and logits equal plain decoding's and the trainer's forward's, fp32 and
            bf16, a left-padded row included
  sampled   every returned log-prob equals the trainer's for the token sampled
  control   the unpatched fp32 model's speculative logits differ from its full forward's
transformers runs speculative decoding at batch size 1 only.
"""

import pytest
import torch

import bik
from bik import testing

DTYPES = [torch.float32, torch.bfloat16]
# a repetitive prompt, so that prompt lookup finds drafts; two pad tokens before it
PROMPT = torch.tensor([[0, 0, 5, 9, 33, 7, 100, 5, 9, 33, 7, 100, 5, 9, 33, 7, 100, 5, 9]])
MASK = (PROMPT != 0).long()
TOKENS = 12


def _models(dtype, patch=True):
    """The tiny Qwen3 and a draft of it (its weights moved a little), both patched."""
    model = testing.load_model("tiny-qwen3", dtype=dtype)
    draft = testing.load_model("tiny-qwen3", dtype=dtype)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator).to(dtype) * 0.01)
    if patch:
        bik.patch_model(model)
        bik.patch_model(draft)
    return model, draft


def _speculations(draft):
    return {
        "prompt lookup": dict(prompt_lookup_num_tokens=3),
        "draft model": dict(assistant_model=draft),
    }


def _generate(model, **options):
    return model.generate(
        PROMPT,
        attention_mask=MASK,
        max_new_tokens=TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **options,
    )


def _trainer_logits(model, sequences):
    """The full forward's logits at the positions that predicted the generated tokens."""
    mask = torch.cat([MASK, torch.ones_like(sequences[:, PROMPT.shape[1] :])], 1)
    positions = bik.hf.generation_position_ids(mask)
    with torch.no_grad():
        logits = model(sequences, attention_mask=mask, position_ids=positions).logits
    return logits[:, PROMPT.shape[1] - 1 : -1]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_greedy_speculation_gives_plain_decodings_tokens_and_logits(dtype):
    model, draft = _models(dtype)
    plain = _generate(model, do_sample=False)
    expected = torch.stack(plain.logits, 1)
    assert torch.equal(expected, _trainer_logits(model, plain.sequences))
    for name, options in _speculations(draft).items():
        out = _generate(model, do_sample=False, **options)
        assert torch.equal(out.sequences, plain.sequences), name
        assert torch.equal(torch.stack(out.logits, 1), expected), name


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_sampled_speculation_returns_the_trainers_logprobs(dtype):
    model, draft = _models(dtype)
    for name, options in _speculations(draft).items():
        torch.manual_seed(0)
        out = _generate(model, do_sample=True, top_k=0, temperature=0.8, **options)
        generated = out.sequences[:, PROMPT.shape[1] :]
        rollout = bik.token_logprobs(torch.stack(out.logits, 1), generated, temperature=0.8)
        trained = bik.token_logprobs(
            _trainer_logits(model, out.sequences), generated, temperature=0.8
        )
        assert generated.shape[1] == TOKENS and torch.equal(rollout, trained), name


def test_negative_control_unpatched_speculative_logits_differ_from_the_forward():
    model, draft = _models(torch.float32, patch=False)
    for name, options in _speculations(draft).items():
        out = _generate(model, do_sample=False, **options)
        logits = torch.stack(out.logits, 1)
        assert not torch.equal(logits, _trainer_logits(model, out.sequences)), name
