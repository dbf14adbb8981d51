"""bik.hf.StaticDecoder: a decode loop over a static KV cache that reads nothing on the host
(so a CUDA graph can capture its step) and gives the bits of the eager patched decode and of
the trainer's full forward."""

import pytest
import torch
from host_reads import host_reads

import bik
from bik import testing
from bik.hf import fused_projections
from bik.testing import rollouts

pytest.importorskip("transformers")

PROMPTS = (5, 11, 2, 7)
STEPS = 8


def _prompts(vocab=256):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=gen) for n in PROMPTS]
    return bik.hf.left_pad(prompts, pad_id=0)


def _sampler(seed):
    gen = torch.Generator().manual_seed(seed)
    return lambda logits: torch.multinomial(logits.float().softmax(-1), 1, generator=gen)[:, 0]


def _eager_decode_logits(model, ids, mask, tokens):
    """The logits of the eager patched decode (a DynamicCache, the mask read as generate's)
    feeding ``tokens`` after the prompt."""
    sequences = torch.cat([ids, tokens], 1)
    full = torch.cat([mask, torch.ones_like(tokens)], 1)
    response = torch.cat([torch.zeros_like(mask), torch.ones_like(tokens)], 1)
    rollout = rollouts.Rollout(sequences, full, response, torch.empty(0), ids.shape[1])
    return rollouts.decode_logits(model, rollout)


def _trainer_logprobs(model, ids, mask, tokens):
    """The trainer's log-probs of ``tokens`` (one full forward, bik.sequence_logprobs)."""
    sequences = torch.cat([ids, tokens], 1)
    full = torch.cat([mask, torch.ones_like(tokens)], 1)
    response = torch.cat([torch.zeros_like(mask), torch.ones_like(tokens)], 1)
    return bik.sequence_logprobs(model, sequences, full, response)[:, ids.shape[1] :]


def _patched(preset, dtype=torch.float32):
    model = testing.load_model(preset, dtype=dtype)
    bik.patch_model(model)
    return model


@pytest.mark.parametrize(
    ("preset", "dtype"),
    [
        ("tiny-qwen3", torch.float32),
        ("tiny-qwen3", torch.bfloat16),
        ("tiny-olmo3", torch.float32),  # a sliding window the sequences outgrow
        ("tiny-gpt_oss", torch.float32),  # sinks, a sliding window, MoE
    ],
)
def test_static_decode_gives_the_bits_of_the_eager_decode_and_the_trainer(preset, dtype):
    model = _patched(preset, dtype)
    ids, mask = _prompts()
    decoder = bik.hf.StaticDecoder(model, max_len=ids.shape[1] + STEPS)
    tokens, logits = decoder.generate(ids, mask, STEPS, choose=_sampler(1))
    assert torch.equal(_eager_decode_logits(model, ids, mask, tokens), logits)
    trained = _trainer_logprobs(model, ids, mask, tokens)
    assert torch.equal(trained, bik.token_logprobs(logits.float(), tokens))


def test_a_decoder_reused_for_new_prompts_equals_a_fresh_one():
    """A second prefill of the same batch size refills the buffers of the first (a captured
    step keeps its addresses): nothing of the first batch leaks into the second. Another
    batch size gets new buffers."""
    model = _patched("tiny-qwen3")
    ids, mask = _prompts()
    other_ids, other_mask = bik.hf.left_pad([torch.arange(3, 3 + n) for n in (9, 1, 4, 6)], 0)
    decoder = bik.hf.StaticDecoder(model, max_len=16)
    decoder.generate(ids, mask, 4)
    reused = decoder.generate(other_ids, other_mask, 4)
    fresh = bik.hf.StaticDecoder(model, max_len=16).generate(other_ids, other_mask, 4)
    assert all(torch.equal(a, b) for a, b in zip(reused, fresh))
    narrower = decoder.generate(ids[:2], mask[:2], 4)
    assert torch.equal(
        narrower[1], bik.hf.StaticDecoder(model, 16).generate(ids[:2], mask[:2], 4)[1]
    )


def test_a_latent_cache_is_refused_and_keys_that_are_not_the_pages_too(monkeypatch):
    """DeepSeek-V3 caches its compressed latent (keys and values of other shapes) and expands
    it each step: refused at prefill. A cache whose update hands attention other tensors than
    the pages (so attention would run over every key of a page, unwritten ones included) is
    refused at the step."""
    ids, mask = _prompts()
    latent = bik.hf.StaticDecoder(_patched("tiny-deepseek_v3"), max_len=ids.shape[1] + 2)
    with pytest.raises(NotImplementedError, match="latent cache"):
        latent.prefill(ids, mask)
    decoder = bik.hf.StaticDecoder(_patched("tiny-qwen3"), max_len=ids.shape[1] + 2)
    next_tokens = decoder.prefill(ids, mask).argmax(-1)
    layer = type(decoder._cache.layers[0])
    update = layer.update
    monkeypatch.setattr(
        layer, "update", lambda self, *a, **k: [t + 0 for t in update(self, *a, **k)]
    )
    with pytest.raises(NotImplementedError, match="not the static cache's pages"):
        decoder.step(next_tokens)


@pytest.mark.parametrize(
    ("preset", "fuse"), [("tiny-qwen3", False), ("tiny-olmo3", False), ("tiny-qwen3", True)]
)
def test_a_static_decode_step_reads_nothing_on_the_host(preset, fuse):
    """And the detector is live: the eager decode over a DynamicCache reads the mask."""
    model = _patched(preset)
    ids, mask = _prompts()
    decoder = bik.hf.StaticDecoder(model, max_len=ids.shape[1] + 4, fuse_projections=fuse)
    next_tokens = decoder.prefill(ids, mask).argmax(-1)
    decoder.step(next_tokens)  # the first step runs once before any capture
    with host_reads() as found:
        decoder.step(next_tokens)
        decoder.step(next_tokens)
    assert found == []
    with host_reads() as found:
        _eager_decode_logits(model, ids, mask, next_tokens[:, None].repeat(1, 2))
    assert found, "negative control: the eager decode reads the mask on the host"


@pytest.mark.parametrize("preset", ["tiny-gpt_oss", "tiny-qwen3_moe"])
def test_a_moe_step_on_the_triton_backend_reads_nothing_on_the_host(preset, monkeypatch):
    """The triton backend's grouped kernel reads the experts' token counts on the device, so
    a MoE step can be captured. The experts' range check reads the host for a CPU tensor
    only (on CUDA it is torch._assert_async, queued on the device): recorded here, not run."""
    model = testing.load_model(preset)
    bik.patch_model(model, backend="triton")
    checked: list[str] = []
    monkeypatch.setattr(bik._checks, "values_in_range", lambda name, *_: checked.append(name))
    ids, mask = _prompts()
    decoder = bik.hf.StaticDecoder(model, max_len=ids.shape[1] + 3, graph=False)
    next_tokens = decoder.prefill(ids, mask).argmax(-1)
    decoder.step(next_tokens)
    checked.clear()
    with host_reads() as found:
        decoder.step(next_tokens)
    assert found == [] and "groups" in checked
    graphed = bik.hf.StaticDecoder(model, max_len=ids.shape[1] + 1, graph=True)
    with pytest.raises(ValueError, match="CUDA"):  # not refused for its experts: no GPU here
        graphed.step(graphed.prefill(ids, mask).argmax(-1))


def test_static_decode_under_the_triton_backend_gives_the_trainers_bits():
    model = testing.load_model("tiny-qwen3")
    bik.patch_model(model, backend="triton")
    ids, mask = _prompts()
    decoder = bik.hf.StaticDecoder(model, max_len=ids.shape[1] + 3)
    tokens, logits = decoder.generate(ids, mask, 3)
    trained = _trainer_logprobs(model, ids, mask, tokens)
    assert torch.equal(trained, bik.token_logprobs(logits, tokens))


@pytest.mark.parametrize(
    ("preset", "dtype", "backend", "per_layer"),
    [
        ("tiny-qwen3", torch.float32, "auto", 2),
        ("tiny-qwen3", torch.bfloat16, "auto", 2),
        ("tiny-gpt_oss", torch.float32, "auto", 1),  # q/k/v with biases; experts: no gate/up
        ("tiny-qwen3", torch.bfloat16, "triton", 2),  # a wider weight: other token buckets
    ],
)
def test_fused_projections_give_each_projection_its_own_bits(
    preset, dtype, backend, per_layer, monkeypatch
):
    """q/k/v and gate/up as one linear each: every step's logits equal the unfused decoder's,
    and every member of every group took its columns of the one linear."""
    model = testing.load_model(preset, dtype=dtype)
    bik.patch_model(model, backend=backend)
    ids, mask = _prompts()
    taken = []
    output = fused_projections.ProjectionGroup.output

    def spy(group, member, x, linear):
        out = output(group, member, x, linear)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(fused_projections.ProjectionGroup, "output", spy)
    fused = bik.hf.StaticDecoder(model, ids.shape[1] + STEPS, fuse_projections=True)
    _, logits = fused.generate(ids, mask, STEPS, choose=_sampler(1))
    groups = len(set(fused._groups.values()))
    assert groups == per_layer * model.config.num_hidden_layers
    assert taken == [True] * (STEPS - 1) * len(fused._groups)
    plain = bik.hf.StaticDecoder(model, ids.shape[1] + STEPS)
    assert torch.equal(plain.generate(ids, mask, STEPS, choose=_sampler(1))[1], logits)


def test_fused_projections_follow_every_change_of_the_weights():
    """An in-place update, a replaced parameter, a fused optimizer step (which bumps no
    version counter) and a conversion of the model each reach the fused weights before the
    next step: a fresh unfused decoder of the changed model agrees."""
    model = _patched("tiny-qwen3")
    ids, mask = _prompts()
    fused = bik.hf.StaticDecoder(model, ids.shape[1] + 4, fuse_projections=True)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[1].mlp
    gate = mlp.gate_proj.weight
    optimizer = torch.optim.Adam([gate], lr=0.1, fused=True)

    def change_in_place():
        with torch.no_grad():
            attention.k_proj.weight.mul_(1.5)

    def replace_parameter():
        mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.detach() * 0.5)

    def fused_optimizer_step():
        gate.grad = torch.ones_like(gate)
        optimizer.step()

    def convert_the_model():
        model.to(torch.bfloat16)

    changes = (change_in_place, replace_parameter, fused_optimizer_step, convert_the_model)
    for change in changes:
        before = fused.generate(ids, mask, 4)[1]
        change()
        after = fused.generate(ids, mask, 4)[1]
        fresh = bik.hf.StaticDecoder(model, ids.shape[1] + 4).generate(ids, mask, 4)[1]
        assert torch.equal(fresh, after) and not torch.equal(before, after), change.__name__


def test_refusals_name_what_is_wrong():
    plain = testing.load_model("tiny-qwen3")
    with pytest.raises(ValueError, match=r"patched by bik\.patch_model"):
        bik.hf.StaticDecoder(plain, max_len=8)
    model = _patched("tiny-qwen3")
    with pytest.raises(ValueError, match="max_len"):
        bik.hf.StaticDecoder(model, max_len=0)
    with pytest.raises(TypeError, match="fuse_projections: expected a bool"):
        bik.hf.StaticDecoder(model, max_len=8, fuse_projections=1)  # type: ignore[arg-type]
    ids, mask = _prompts()
    decoder = bik.hf.StaticDecoder(model, max_len=ids.shape[1] + 1)
    with pytest.raises(RuntimeError, match="prefill first"):
        decoder.step(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_len"):
        bik.hf.StaticDecoder(model, max_len=ids.shape[1] - 1).prefill(ids, mask)
    with pytest.raises(ValueError, match="attention_mask"):
        decoder.prefill(ids, mask[:, 1:])
    next_tokens = decoder.prefill(ids, mask).argmax(-1)
    with pytest.raises(ValueError, match="one per row"):
        decoder.step(next_tokens[:2])
    decoder.step(next_tokens)  # the longest row now fills max_len
    with pytest.raises(ValueError, match="exceed max_len"):
        decoder.step(next_tokens)
    with pytest.raises(ValueError, match="CUDA"):
        graphed = bik.hf.StaticDecoder(model, max_len=ids.shape[1] + 1, graph=True)
        graphed.step(graphed.prefill(ids, mask).argmax(-1))
    moe = bik.hf.StaticDecoder(_patched("tiny-gpt_oss"), max_len=ids.shape[1] + 1, graph=True)
    with pytest.raises(NotImplementedError, match="reads their token counts on the host"):
        moe.step(moe.prefill(ids, mask).argmax(-1))
    with pytest.raises(NotImplementedError, match="recurrent state"):
        bik.hf.StaticDecoder(_patched("tiny-qwen3_next"), max_len=8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt_oss"])
def test_a_captured_step_replays_the_eager_steps_bits(preset, fuse):
    model = _patched(preset).cuda()
    ids, mask = (t.cuda() for t in _prompts())
    graphed = bik.hf.StaticDecoder(model, max_len=ids.shape[1] + STEPS, fuse_projections=fuse)
    eager = bik.hf.StaticDecoder(model, max_len=ids.shape[1] + STEPS, graph=False)
    _, logits = graphed.generate(ids, mask, STEPS)
    assert graphed._graph is not None
    assert torch.equal(eager.generate(ids, mask, STEPS)[1], logits)
