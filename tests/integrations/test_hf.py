"""patch_model on Hugging Face causal LMs: bitwise rollout-vs-train log-probs, verify, errors."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bik
from bik import testing
from bik.__main__ import main
from bik.families import FAMILIES
from bik.testing.checks import first_divergent_module, run_checks

pytest.importorskip("transformers")
PRESETS = [f"tiny-{family}" for family in FAMILIES]  # verify's presets


def tiny(preset, dtype=torch.float32):
    return testing.load_model(preset, dtype=dtype)


def _sampled(model, seed, **kwargs):
    """``model.generate`` sampling from the full distribution (seeded), with its logits."""
    torch.manual_seed(seed)
    return model.generate(
        do_sample=True,
        top_k=0,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )


@pytest.mark.parametrize("preset", PRESETS)
def test_patched_model_passes_every_check_and_plain_torch_fails_one(preset):
    model = tiny(preset)
    plain = run_checks(model)
    assert not all(ok for ok, _ in plain.values()), "negative control: plain torch should differ"
    bik.patch_model(model)
    patched = run_checks(model)
    assert all(ok for ok, _ in patched.values()), patched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "preset",
    [
        "tiny-qwen3",
        "tiny-olmo3",
        "tiny-smollm3",
        "tiny-glm4_moe",
        "tiny-deepseek_v3",
        "tiny-gpt_oss",
        "tiny-qwen3_5_text",
        "tiny-qwen3_next",
        "tiny-qwen3_5_moe_text",
        "tiny-nemotron_h",
        "tiny-kimi_linear",
    ],
)
def test_sampled_rollout_logprobs_equal_training_logprobs(preset, dtype):
    """The KV-cache rollout == one padded batched forward == each row alone. OLMo-3 with a
    sliding-window layer beside a full one, SmolLM3 with a NoPE layer, GLM-4.5 MoE with its
    group-limited sigmoid router, DeepSeek-V3 with multi-head latent attention, gpt-oss with
    sinks, an 8-key sliding window the sequences outgrow and clamped SwiGLU experts, Qwen3.5,
    Qwen3-Next and Qwen3.5 MoE with a Gated DeltaNet layer beside a gated full-attention one,
    Nemotron-H with a Mamba2 mixer, an attention layer and an MLP layer, Kimi Linear with a
    Kimi Delta Attention layer beside latent attention (their tiny presets)."""
    model = tiny(preset, dtype)
    bik.patch_model(model)
    assert_rollout_equals_training(model)


def assert_rollout_equals_training(model):
    """Four left-padded prompts (2-11 tokens), 10 sampled tokens each: their rollout
    log-probs equal one padded forward's and each sequence's alone, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen) for n in (5, 11, 2, 7)]
    ids, mask = bik.hf.left_pad(prompts, pad_id=0)
    torch.manual_seed(1)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=0.7,
        top_k=0,
        max_new_tokens=10,
        min_new_tokens=10,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    generated = out.sequences[:, ids.shape[1] :]
    rollout = bik.token_logprobs(torch.stack(out.logits, 1), generated, temperature=0.7)
    full_mask = torch.cat([mask, torch.ones_like(generated)], 1)
    response = torch.cat([torch.zeros_like(mask), torch.ones_like(generated)], 1)
    trained = bik.sequence_logprobs(model, out.sequences, full_mask, response, temperature=0.7)
    assert torch.equal(trained[:, ids.shape[1] :], rollout)
    assert torch.equal(trained[:, : ids.shape[1]], torch.zeros_like(trained[:, : ids.shape[1]]))
    for row, prompt in enumerate(prompts):  # each sequence alone, without padding
        seq = torch.cat([prompt, generated[row]])[None]
        resp = torch.zeros_like(seq)
        resp[:, len(prompt) :] = 1
        alone = bik.sequence_logprobs(model, seq, torch.ones_like(seq), resp, temperature=0.7)
        assert torch.equal(alone[0, len(prompt) :], rollout[row])


def test_patch_report_and_unpatch_round_trip():
    model = tiny("tiny-llama")
    ids = torch.randint(3, 256, (2, 9))
    before = model(input_ids=ids).logits
    report = bik.patch_model(model)
    kinds = list(report.patched.values())
    assert kinds.count("bik.linear") == 15 and kinds.count("bik.attention") == 2
    assert (
        kinds.count("bik.rms_norm") == 5
        and report.unpatched == []
        and report.attention_was == "sdpa"
    )
    assert "bik.linear" in str(report)
    assert model.config._attn_implementation == "bik"
    bik.unpatch_model(model)
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in vars(m) for m in model.modules())
    assert torch.equal(model(input_ids=ids).logits, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_generate_the_bits_of_the_plain_patch(dtype):
    plain, packed = tiny("tiny-qwen3", dtype), tiny("tiny-qwen3", dtype)
    bik.patch_model(plain)
    report = bik.patch_model(packed, pack_weights=True)
    assert report.packed_weights and "packed once" in str(report)
    ids = torch.randint(3, 256, (3, 6), generator=torch.Generator().manual_seed(2))

    def sample(model):
        out = _sampled(model, 3, input_ids=ids, max_new_tokens=8)
        return out.sequences, torch.stack(out.logits, 1)

    (seq, logits), (packed_seq, packed_logits) = sample(plain), sample(packed)
    assert torch.equal(packed_seq, seq) and torch.equal(packed_logits, logits)
    pack = bik.backends.resolve(torch.device("cpu"), "matmul").pack_weight
    assert (bik.packed_bytes(packed) > 0) == (pack(torch.zeros(1, 1, dtype=dtype)) is not None)
    bik.unpatch_model(packed)
    assert bik.packed_bytes(packed) == 0


def test_packed_weights_follow_a_fused_adamw_step_and_a_deep_copy():
    # transformers' Trainer defaults to adamw_torch_fused, which bumps no version counter.
    plain, packed = tiny("tiny-qwen3"), tiny("tiny-qwen3")
    bik.patch_model(plain)
    bik.patch_model(packed, pack_weights=True)
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(4))
    for model in (plain, packed):
        with torch.no_grad():
            model(input_ids=ids)  # packs the copy (an eval, a generate)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        optimizer.step()
    with torch.no_grad():
        expected = plain(input_ids=ids).logits
        assert torch.equal(packed(input_ids=ids).logits, expected)
        twin = copy.deepcopy(packed)
        assert torch.equal(twin(input_ids=ids).logits, expected)
    pack = bik.backends.resolve(torch.device("cpu"), "matmul").pack_weight
    assert (bik.packed_bytes(twin) > 0) == (pack(torch.zeros(1, 1)) is not None)


def test_patch_with_explicit_backend():
    model = tiny("tiny-qwen2")
    report = bik.patch_model(model, backend="reference")
    assert report.backend == "reference"
    ids = torch.randint(3, 256, (1, 6))
    with torch.no_grad():
        model(input_ids=ids)
    assert bik.get_backend() == "auto"  # the model's backend does not leak


def test_a_gap_inside_a_row_is_rejected_loudly():
    model = tiny("tiny-qwen3")
    bik.patch_model(model)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]])
    with pytest.raises(RuntimeError, match="zeros between a row's tokens"):
        model(input_ids=torch.randint(3, 256, (2, 4)), attention_mask=mask)


def _stopped_at_eos(prompts, responses, pad_id=0):
    """The batch an RL trainer builds: left-padded prompts, responses of different lengths
    (each ends at its EOS), zeros after EOS; the response mask marks the response tokens."""
    width = max(map(len, prompts)) + max(map(len, responses))
    ids = torch.full((len(prompts), width), pad_id)
    mask, response = torch.zeros_like(ids), torch.zeros_like(ids)
    left = max(map(len, prompts))
    for row, (prompt, answer) in enumerate(zip(prompts, responses)):
        ids[row, left - len(prompt) : left + len(answer)] = torch.cat([prompt, answer])
        mask[row, left - len(prompt) : left + len(answer)] = 1
        response[row, left : left + len(answer)] = 1
    return ids, mask, response, left


def _eos_rows_vs_alone(model, prompts, responses):
    """Per row: (the row's response log-probs in the EOS-padded batch, the same row alone)."""
    ids, mask, response, left = _stopped_at_eos(prompts, responses)
    with torch.no_grad():
        batch = bik.sequence_logprobs(model, ids, mask, response)
    pairs = []
    for row, (prompt, answer) in enumerate(zip(prompts, responses)):
        seq = torch.cat([prompt, answer])[None]
        resp = torch.zeros_like(seq)
        resp[:, len(prompt) :] = 1
        with torch.no_grad():
            alone = bik.sequence_logprobs(model, seq, torch.ones_like(seq), resp)
        pairs.append((batch[row, left : left + len(answer)], alone[0, len(prompt) :]))
    return pairs


@settings(deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=2, max_size=5),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_stopping_at_eos_equal_each_row_alone(dtype, lengths, seed):
    model = _patched_qwen3(dtype)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 256, (p,), generator=gen) for p, _ in lengths]
    responses = [torch.randint(3, 256, (r,), generator=gen) for _, r in lengths]
    for in_batch, alone in _eos_rows_vs_alone(model, prompts, responses):
        assert torch.equal(in_batch, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_whose_every_row_ends_before_its_width_is_scored(dtype):
    """Issue 72, item 9: trailing zeros on every row (all stopped before the batch's width)
    made the keys in use fewer than the queries, and sequence_logprobs raised. The rows get
    the bits of the batch cut to its longest row; the padding columns score 0."""
    model = _patched_qwen3(dtype)
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0]])
    response = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0, 0]])
    with torch.no_grad():
        whole = bik.sequence_logprobs(model, ids, mask, response)
        cut = bik.sequence_logprobs(model, ids[:, :5], mask[:, :5], response[:, :5])
    assert torch.equal(whole[:, :5], cut) and not whole[:, 5:].any()


def test_rows_stopping_at_eos_move_under_plain_torch():
    """Negative control: the same batches through the unpatched model change some row."""
    model = tiny("tiny-qwen3", torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen) for n in (5, 11, 2, 7, 9, 3, 12, 4)]
    responses = [torch.randint(3, 256, (n,), generator=gen) for n in (12, 3, 8, 1, 6, 10, 2, 9)]
    pairs = _eos_rows_vs_alone(model, prompts, responses)
    assert not all(torch.equal(a, b) for a, b in pairs)


_PATCHED = {}


def _patched_qwen3(dtype):
    """One patched tiny model per dtype for the hypothesis examples (built once)."""
    if dtype not in _PATCHED:
        _PATCHED[dtype] = tiny("tiny-qwen3", dtype)
        bik.patch_model(_PATCHED[dtype])
    return _PATCHED[dtype]


def test_generate_stopping_at_eos_equals_the_trainer_with_zeros_after_eos():
    """Rows of one sampled batch stop at EOS at different steps; the trainer scores them with
    zeros after each EOS and gets the rollout's log-probs of every real token, bit for bit."""
    model = tiny("tiny-qwen3", torch.bfloat16)
    bik.patch_model(model)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen) for n in (5, 11, 2, 7)]
    ids, mask = bik.hf.left_pad(prompts, pad_id=0)

    def sample(eos):
        return _sampled(
            model, 1, input_ids=ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos
        )

    # EOS := a token the first row samples mid-way, so rows stop at different steps
    eos = int(sample(None).sequences[0, ids.shape[1] + 4])
    out = sample(eos)
    generated = out.sequences[:, ids.shape[1] :]
    stops = [
        int((row == eos).int().argmax()) + 1 if (row == eos).any() else len(row)
        for row in generated
    ]
    assert len(set(stops)) > 1, "rows should stop at different lengths"
    rollout = bik.token_logprobs(torch.stack(out.logits, 1), generated)
    keep = torch.arange(generated.shape[1])[None] < torch.tensor(stops)[:, None]
    full_mask = torch.cat([mask, keep.long()], 1)
    response = torch.cat([torch.zeros_like(mask), keep.long()], 1)
    trained = bik.sequence_logprobs(model, out.sequences, full_mask, response)
    assert torch.equal(trained[:, ids.shape[1] :], torch.where(keep, rollout, 0.0))


def test_first_divergent_module_is_named_for_plain_torch():
    culprit = first_divergent_module(tiny("tiny-mistral"))
    assert culprit is not None and "model.layers.0" in culprit


@pytest.mark.slow  # the same checks run in test_patched_model_passes_every_check...[tiny-qwen3]
def test_verify_cli_passes_and_prints_the_table(capsys):
    assert main(["verify", "--model", "tiny-qwen3"]) == 0
    printed = capsys.readouterr().out
    assert "| batch_1_vs_n | DIFFERS" in printed and "| decode_vs_prefill |" in printed
    assert "all checks bit-identical under bik" in printed


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))


def test_errors():
    model = tiny("tiny-qwen3")
    bik.patch_model(model)
    with pytest.raises(RuntimeError, match="already patched"):
        bik.patch_model(model)
    with pytest.raises(ValueError, match="model: family 'gpt2' is not supported"):
        bik.patch_model(_gpt2())
    with pytest.raises(TypeError, match="model: expected a Hugging Face causal LM"):
        bik.patch_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not patched"):
        bik.unpatch_model(tiny("tiny-llama"))
    with pytest.raises(ValueError, match="model: expected a preset"):
        testing.load_model("no-such-preset")
    with pytest.raises(ValueError, match="response_mask: expected shape"):
        ids = torch.ones(2, 5, dtype=torch.long)
        bik.sequence_logprobs(model, ids, ids, ids[:, :3])
    with pytest.raises(ValueError, match="backend: expected one of"):
        bik.patch_model(tiny("tiny-llama"), backend="nope")
    with pytest.raises(ValueError, match="split_size: expected a positive multiple of 32"):
        bik.patch_model(tiny("tiny-llama"), split_size=48)


def test_non_strict_lists_what_it_cannot_patch():
    report = bik.patch_model(_gpt2(), strict=False)
    assert report.family == "gpt2"
    assert any("Conv1D" in entry for entry in report.unpatched)


def test_nemotron_h_with_biased_projections_is_padding_invariant():
    """Issue 72, item 6: with ``use_bias`` in_proj gives the padding its bias, which the
    Mamba2 convolution carried into the row's first tokens; bik zeroes it before the
    convolution too."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES["nemotron_h"].tiny_config(use_bias=True))
    for name, parameter in model.named_parameters():
        if name.endswith("in_proj.bias"):
            torch.nn.init.normal_(parameter)  # transformers initialises biases at 0
    bik.patch_model(model.eval())
    checks = run_checks(model)
    assert all(ok for ok, _ in checks.values()), checks


def test_nemotron_h_moe_layers_are_refused_by_name():
    """Nemotron-H's MoE blocks (squared-ReLU experts, a sigmoid router) are not patched: a
    strict patch names them instead of running them with torch's order."""
    from transformers import AutoModelForCausalLM

    layer_types = ["linear_attention", "moe", "full_attention", "mlp"]
    config = FAMILIES["nemotron_h"].tiny_config(layer_types=layer_types, num_hidden_layers=4)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match=r"cannot make these modules invariant: .*NemotronHMoE"):
        bik.patch_model(model)


@pytest.mark.parametrize("family", ["olmo3", "gemma2", "gemma3_text", "mistral"])
def test_an_active_sliding_window_is_exact(family):
    """A 4-key window that 7- to 21-token sequences outgrow: transformers' sliding cache layers
    are kept whole, the window is a mask, and decode steps find their rows' first keys from
    the position ids: the rollout equals the trainer bit for bit, and the patched model stays
    within fp32 rounding of transformers' own."""
    from transformers import AutoModelForCausalLM

    config = FAMILIES[family].tiny_config(sliding_window=4)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        report = bik.patch_model(model)
        torch.testing.assert_close(model(ids).logits, plain, rtol=1e-5, atol=1e-5)
    assert "bik.attention, a sliding window over whole cache layers" in report.patched.values()
    assert_rollout_equals_training(model)


def test_a_filled_sliding_cache_layer_is_refused():
    """A sliding-window cache layer filled before patching may have dropped keys: refused, not
    continued from."""
    from transformers import AutoModelForCausalLM, DynamicCache

    config = FAMILIES["olmo3"].tiny_config(sliding_window=4)
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(3, 256, (1, 6)), **bik.hf.cache_argument(model, cache))
        bik.patch_model(model)
        with pytest.raises(NotImplementedError, match=r"sliding-window layer .*already filled"):
            model(torch.randint(3, 256, (1, 1)), **bik.hf.cache_argument(model, cache))


def test_position_ids_that_do_not_count_the_tokens_are_refused_under_an_active_window():
    from transformers import AutoModelForCausalLM, DynamicCache

    config = FAMILIES["olmo3"].tiny_config(sliding_window=4)
    model = AutoModelForCausalLM.from_config(config).eval()
    bik.patch_model(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(3, 256, (1, 6)), **bik.hf.cache_argument(model, cache))
        with pytest.raises(RuntimeError, match="position_ids must number each row's tokens"):
            step = torch.randint(3, 256, (1, 1))
            model(step, **bik.hf.cache_argument(model, cache), position_ids=torch.tensor([[9]]))


@pytest.mark.parametrize("family", ["olmo3", "gpt_oss"])
def test_column_numbered_position_ids_of_a_left_padded_batch_are_refused(family):
    """Issue 72, item 4: position ids 0..T-1 in every row of a left-padded batch. A decode step
    whose window hides its row's first token took the padding's first column as the row's
    start, and its logits left the trainer's silently; the prefill, where the row's start is
    in view, now refuses them. Rows counted from their first token still run."""
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.manual_seed(0)
    config = FAMILIES[family].tiny_config(sliding_window=4)
    model = AutoModelForCausalLM.from_config(config).eval()
    bik.patch_model(model)
    ids = torch.randint(3, 256, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    columns = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        with pytest.raises(RuntimeError, match="position_ids must number each row's tokens"):
            model(
                ids,
                attention_mask=mask,
                position_ids=columns,
                use_cache=True,
                past_key_values=cache,
            )
        counted = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        model(ids, attention_mask=mask, position_ids=counted, use_cache=True, past_key_values=cache)


def test_latent_attention_with_narrower_value_heads_matches_transformers():
    """DeepSeek-V3's value heads (16) are narrower than its query/key heads (24): bik widens
    them with zero columns; the patched model stays within fp32 rounding of transformers'."""
    model = testing.load_model("tiny-deepseek_v3")
    ids = torch.randint(3, 256, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(ids).logits
        bik.patch_model(model)
        patched = model(ids).logits
    torch.testing.assert_close(patched, plain, rtol=1e-5, atol=1e-5)


def test_value_heads_wider_than_the_key_heads_are_refused():
    from bik.hf.attention import attention_forward

    module = torch.nn.Module()
    q, v = torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 16)
    with pytest.raises(NotImplementedError, match="value_head_dim=16: value heads wider"):
        attention_forward(module, q, q, v, None)
