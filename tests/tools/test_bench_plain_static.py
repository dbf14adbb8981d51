"""The GPU probe's baseline for a captured bik decode: the unpatched model over transformers'
StaticCache (bik/testing/plain_static.py). On the CPU its step runs eagerly: checked here
are its tokens and logits against the unpatched model's own generate, and that a step reads
nothing on the host, so a plain CUDA graph can capture it."""

import pytest
import torch
from host_reads import host_reads

import bik
from bik import testing
from bik.testing.plain_static import PlainStaticDecode

pytest.importorskip("transformers")

NEW = 6


def _prompts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (n,), generator=gen) for n in (5, 11, 2, 7)]
    return bik.hf.left_pad(prompts, pad_id=0)  # left padding: the key mask must hide it


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_the_static_decode_follows_the_models_own_generate(preset):
    model = testing.load_model(preset)
    ids, mask = _prompts()
    decoder = PlainStaticDecode(model, max_len=ids.shape[1] + NEW)
    tokens, logits = decoder.generate(ids, mask, NEW)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    assert torch.equal(tokens, out.sequences[:, ids.shape[1] :])
    # not bitwise: SDPA reduces over the whole static cache here, over the keys so far there
    torch.testing.assert_close(logits, torch.stack(out.logits, 1), rtol=1e-5, atol=1e-5)
    other, other_mask = _prompts(seed=1)  # the same batch size: the cache reset and reused
    fresh = PlainStaticDecode(model, max_len=ids.shape[1] + NEW).generate(other, other_mask, NEW)
    assert torch.equal(decoder.generate(other, other_mask, NEW)[1], fresh[1])


def test_a_step_reads_nothing_on_the_host():
    model = testing.load_model("tiny-qwen3")
    ids, mask = _prompts()
    decoder = PlainStaticDecode(model, max_len=ids.shape[1] + 3)
    tokens = decoder.prefill(ids, mask).argmax(-1)
    with host_reads() as found:
        decoder.step(tokens)
        decoder.step(tokens)
    assert found == []


def test_sliding_windows_and_a_full_cache_are_refused():
    with pytest.raises(NotImplementedError, match="sliding_attention"):
        PlainStaticDecode(testing.load_model("tiny-olmo3"), max_len=8)
    model = testing.load_model("tiny-qwen3")
    ids, mask = _prompts()
    with pytest.raises(ValueError, match="max_len"):
        PlainStaticDecode(model, max_len=ids.shape[1]).prefill(ids, mask)
    decoder = PlainStaticDecode(model, max_len=ids.shape[1] + 1)
    tokens = decoder.prefill(ids, mask).argmax(-1)
    decoder.step(tokens)
    with pytest.raises(ValueError, match="positions are full"):
        decoder.step(tokens)
