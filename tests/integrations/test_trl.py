"""bik in TRL: GRPOTrainer with a colocated vLLM engine logs exactly zero mismatch.

End to end on a tiny random Qwen3 with a character tokenizer: TRL's own metrics
(``sampling/sampling_logp_difference/*`` 0, ``sampling/importance_sampling_ratio/*`` 1) and the
two log-prob tensors TRL compares, equal bit for bit, with left-padded prompts of different
lengths and completions that stop early at EOS in every batch. The negative control keeps bik
in the engine but gives the trainer back to TRL: its metrics move.
"""

import gc
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")
trl = pytest.importorskip("trl", reason="TRL is not installed (make install-vllm)")

import bik  # noqa: E402
import bik.trl  # noqa: E402
from bik.families import FAMILIES  # noqa: E402
from bik.trl import MismatchError, ZeroMismatchCallback  # noqa: E402

CHARS = "abcdefgh ."  # a tiny vocabulary: EOS (1 in 12) ends many completions early
PROMPTS = ["a", "bad cafe", "ace.", "hedge bag fed", "c", "fade . ahead"]


@pytest.fixture(autouse=True)
def trl_off_after():
    yield
    bik.trl.disable()


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def save_tiny(path, family, **keys):
    """A random tiny model of ``family`` and the character tokenizer, saved where TRL and vLLM
    load them."""
    from transformers import AutoModelForCausalLM

    tokenizer = char_tokenizer()
    config = FAMILIES[family].tiny_config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **keys,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("trl-qwen3"), "qwen3")


def grpo_args(out, **overrides):
    from trl import GRPOConfig

    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=6,
        num_generations=3,  # two prompts of different lengths per step
        max_completion_length=10,
        temperature=0.7,
        learning_rate=0.05,  # large: the weights TRL syncs into the engine really move
        max_steps=3,
        logging_steps=1,
        bf16=False,
        use_cpu=True,  # CI has no GPU; TrainingArguments refuses bf16=True otherwise
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.5,
        vllm_max_model_length=64,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    return GRPOConfig(**{**settings, **overrides})


def reward_a(completions, **_):
    return [float(c.count("a")) for c in completions]


def build_trainer(model_dir, out, **overrides):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return GRPOTrainer(
        model=model,
        reward_funcs=reward_a,
        args=grpo_args(out, **overrides),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )


def record_batches(trainer):
    """Keep each batch TRL scores: the tensors it compares and the masks around them."""
    seen = []
    score = trainer._generate_and_score_completions

    def recording(inputs):
        out = score(inputs)
        seen.append({k: v for k, v in out.items() if isinstance(v, torch.Tensor)})
        return out

    trainer._generate_and_score_completions = recording
    return seen


def logged(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def close(trainer):
    del trainer.vllm_generation.llm
    gc.collect()


def test_grpo_logs_exactly_zero_mismatch(model_dir, tmp_path):
    assert_grpo_logs_exactly_zero_mismatch(model_dir, tmp_path)


def test_grpo_with_a_hybrid_policy_logs_exactly_zero_mismatch(tmp_path):
    """Nemotron-H: Mamba2 mixers beside attention, their pooled fp32 states in the engine
    (bik.vllm.mamba2), the convolution and scan weights synced after every update."""
    path = save_tiny(tmp_path / "nemotron_h", "nemotron_h", mamba_head_dim=16)
    assert_grpo_logs_exactly_zero_mismatch(path, tmp_path / "out")


def assert_grpo_logs_exactly_zero_mismatch(model_dir, tmp_path):
    bik.trl.enable(backend="cpu")
    trainer = build_trainer(model_dir, tmp_path)
    trainer.add_callback(ZeroMismatchCallback())
    batches = record_batches(trainer)
    try:
        trainer.train()
    finally:
        close(trainer)
    assert len(batches) == 3
    early = []
    for step, batch in enumerate(batches):
        mask = batch["completion_mask"].bool()
        assert bool((~batch["prompt_mask"].bool()).any()), "no left-padded prompt"
        stopped = (batch["completion_ids"] == 1) & mask  # <eos> is token 1
        early.append(bool((stopped.any(-1) & ~mask[:, -1]).any()))
        ours, engine = batch["old_per_token_logps"][mask], batch["sampling_per_token_logps"][mask]
        unequal = (ours != engine).sum().item()
        assert unequal == 0, f"step {step}: {unequal} of {mask.sum().item()} log-probs differ"
    assert any(early), "no completion stopped early at EOS"  # training may learn to go on
    for name in bik.trl._DIFFERENCE_METRICS:
        assert logged(trainer, name) == [0.0] * 3, name
    for name in bik.trl._RATIO_METRICS:
        assert logged(trainer, name) == [1.0] * 3, name
    assert any(abs(x) > 0 for x in logged(trainer, "loss") + logged(trainer, "grad_norm"))


def _train_counting_forwards(model_dir, out, monkeypatch):
    """Train 3 steps; returns the logged losses and grad norms and the trainer forwards run."""
    calls = []
    score = bik.trl.completion_logprobs
    monkeypatch.setattr(
        bik.trl, "completion_logprobs", lambda *a, **k: calls.append(1) or score(*a, **k)
    )
    trainer = build_trainer(model_dir, out)
    trainer.add_callback(ZeroMismatchCallback())
    try:
        trainer.train()
    finally:
        close(trainer)
    return logged(trainer, "loss"), logged(trainer, "grad_norm"), len(calls)


def test_engine_logprobs_skip_the_old_forward_and_change_no_bit(model_dir, tmp_path, monkeypatch):
    """Issue 48, item 1: with bik the engine's log-probs are the old log-probs, so the
    recomputing forward is skipped (one per generated batch) and training is the same."""
    bik.trl.enable(backend="cpu")
    loss, grad, forwards = _train_counting_forwards(model_dir, tmp_path / "a", monkeypatch)
    bik.trl.enable(backend="cpu", engine_logprobs=True)
    skipped = _train_counting_forwards(model_dir, tmp_path / "b", monkeypatch)
    assert skipped == (loss, grad, forwards - 3)
    bik.trl.enable(backend="cpu", engine_logprobs=True, audit_every=1)  # recomputes, compares
    assert _train_counting_forwards(model_dir, tmp_path / "c", monkeypatch) == skipped[:2] + (
        forwards,
    )


def test_engine_logprobs_of_masked_truncated_completions(model_dir, tmp_path, monkeypatch):
    """Issue 72, item 7: TRL's ``mask_truncated_completions`` (the DAPO setting) masks a
    truncated completion whole; its engine log-probs are dropped as the recomputing forward
    drops them, and training is the same bits with and without the skipped forward."""
    truncated = []
    convert = bik.trl.engine_logprobs
    monkeypatch.setattr(
        bik.trl,
        "engine_logprobs",
        lambda engine, mask, keep: (
            truncated.append(int((~mask[:, -keep:].any(-1)).sum())) or convert(engine, mask, keep)
        ),
    )
    runs = []
    for audit_every in (0, 1):  # 1: every batch also recomputed and compared
        bik.trl.enable(backend="cpu", engine_logprobs=True, audit_every=audit_every)
        trainer = build_trainer(
            model_dir, tmp_path / str(audit_every), mask_truncated_completions=True
        )
        try:
            trainer.train()
        finally:
            close(trainer)
        runs.append((logged(trainer, "loss"), logged(trainer, "grad_norm")))
    assert sum(truncated) > 0, "no completion was truncated"
    assert runs[0] == runs[1]


def test_engine_logprobs_refuses_a_count_other_than_the_rows():
    """Issue 72, item 9: a shorter list left the last rows' old log-probs 0."""
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    assert bik.trl.engine_logprobs([[-1.0], [-2.0, -3.0]], mask, 2).tolist() == [
        [-1.0, 0.0],
        [-2.0, -3.0],
    ]
    with pytest.raises(MismatchError, match="returned 1 completions' log-probs for 2 rows"):
        bik.trl.engine_logprobs([[-1.0]], mask, 2)
    with pytest.raises(MismatchError, match=r"completion 1: the engine returned 1 log-probs"):
        bik.trl.engine_logprobs([[-1.0], [-2.0]], mask, 2)


def test_an_audit_fails_loudly_at_a_difference(model_dir, tmp_path, monkeypatch):
    bik.trl.enable(backend="cpu", engine_logprobs=True, audit_every=2)
    exact = bik.trl.engine_logprobs
    monkeypatch.setattr(bik.trl, "engine_logprobs", lambda *a: exact(*a) * (1 + 2**-20))
    trainer = build_trainer(model_dir, tmp_path)
    try:
        with pytest.raises(MismatchError, match=r"batch 2: the engine's log-probs differ"):
            trainer.train()
    finally:
        close(trainer)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"engine_logprobs": True, "audit_every": -1}, "audit_every: expected an int >= 0"),
        ({"audit_every": 3}, "audits engine_logprobs=True, which is off"),
    ],
)
def test_engine_logprobs_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        bik.trl.enable(backend="cpu", **options)


def test_bik_only_in_the_engine_mismatches(model_dir, tmp_path):
    """The negative control: the engine is bik's, the trainer TRL's own (fused LM head,
    ``z * (1/T)``, right padding, no position ids); TRL's metrics and the callback see it."""
    bik.trl.enable(backend="cpu")
    trainer = build_trainer(model_dir, tmp_path, max_steps=1)
    bik.trl.disable()
    bik.unpatch_model(trainer.model)
    trainer.add_callback(ZeroMismatchCallback())
    try:
        with pytest.raises(MismatchError, match=r"step 1: .*sampling_logp_difference/max = "):
            trainer.train()
    finally:
        close(trainer)
    assert trainer.state.log_history[-1]["sampling/sampling_logp_difference/max"] > 0


# ---- refusals at trainer build (nothing is built: no engine starts) -------------------------

REFUSED = [
    ({"bf16": True}, "bf16=True over float32 weights"),
    ({"top_p": 0.9}, "top_p=0.9"),
    ({"top_k": 5}, "top_k=5"),
    ({"min_p": 0.1}, "min_p=0.1"),
    ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
    (
        {"generation_kwargs": {"presence_penalty": 0.5}},
        r"generation_kwargs \['presence_penalty'\]",
    ),
    ({"vllm_mode": "server"}, "vllm_mode='server'"),
    ({"use_vllm": False}, "use_vllm=False"),
    ({"cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32=True"),
    ({"vllm_model_impl": "transformers"}, "vllm_model_impl='transformers'"),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSED)
def test_inexact_settings_are_refused(model_dir, tmp_path, overrides, message):
    bik.trl.enable(backend="cpu")
    with pytest.raises(ValueError, match=message):
        build_trainer(model_dir, tmp_path, **overrides)


def test_dropout_the_engine_does_not_run_is_refused(model_dir, tmp_path):
    """Issue 42, item 2: TRL's default disable_dropout=False trained a Phi-3 with residual
    dropout 0.3 against a dropout-free engine (logged max |logp difference| 0.271)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    bik.trl.enable(backend="cpu")
    config = FAMILIES["phi3"].tiny_config(
        vocab_size=len(char_tokenizer()), resid_pdrop=0.3, embd_pdrop=0.3
    )
    phi3 = AutoModelForCausalLM.from_config(config)
    with pytest.raises(
        ValueError, match=r"disable_dropout=False over a model with dropout p=\[0\.3\]"
    ):
        GRPOTrainer(
            model=phi3,
            reward_funcs=reward_a,
            args=grpo_args(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )
    bik.trl.check_settings(grpo_args(tmp_path, disable_dropout=True), phi3)  # TRL zeroes it
    qwen3 = AutoModelForCausalLM.from_pretrained(model_dir, attention_dropout=0.2)
    for disable_dropout in (False, True):  # disable_dropout does not reach attention dropout
        with pytest.raises(ValueError, match=r"attention_dropout=\[0\.2\]"):
            bik.trl.check_settings(grpo_args(tmp_path, disable_dropout=disable_dropout), qwen3)


def test_a_backend_the_engine_refuses_is_refused_at_enable():
    with pytest.raises(ValueError, match="'reference' is not batch-invariant"):
        bik.trl.enable("reference")
    assert bik.trl.enabled() is None


def test_peft_is_refused(model_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    bik.trl.enable(backend="cpu")
    with pytest.raises(ValueError, match="PEFT adapters"):
        GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            reward_funcs=reward_a,
            args=grpo_args(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            peft_config={"r": 8},  # refused before TRL looks at it
        )


def test_untested_trl_version_is_refused(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(RuntimeError, match=r"TRL 1\.17\.0 is outside the tested range"):
        bik.trl.enable()
    assert bik.trl.enabled() is None


def test_disable_restores_trl():
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer.grpo_trainer import GRPOTrainer

    before = {
        name: vars(owner)[name]
        for owner, name in (
            (VLLMGeneration, "_init_vllm"),
            (GRPOTrainer, "__init__"),
            (GRPOTrainer, "_get_per_token_logps_and_entropies"),
        )
    }
    bik.trl.enable()
    assert (
        GRPOTrainer._get_per_token_logps_and_entropies
        is not before["_get_per_token_logps_and_entropies"]
    )
    bik.trl.disable()
    for name, original in before.items():
        owner = VLLMGeneration if name == "_init_vllm" else GRPOTrainer
        assert vars(owner)[name] is original


def test_callback_names_the_step_and_the_gap():
    from types import SimpleNamespace

    logs = {"loss": 0.1, **{n: 0.0 for n in bik.trl._DIFFERENCE_METRICS}}
    logs |= {n: 1.0 for n in bik.trl._RATIO_METRICS}
    callback = ZeroMismatchCallback()
    state = SimpleNamespace(global_step=7)
    callback.on_log(None, state, None, logs=logs)  # all exact: passes
    with pytest.raises(MismatchError, match=r"step 7: .*ratio/max = 1\.25 .*off by 0\.25"):
        callback.on_log(None, state, None, logs={**logs, _ratio_max(): 1.25})
    with pytest.raises(MismatchError, match="sampling_logp_difference/mean not logged"):
        callback.on_log(None, state, None, logs={"loss": 0.1})
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction=True"):
        callback.on_train_begin(SimpleNamespace(use_vllm=False), state, None)
    # a run whose steps TRL never logged (logging_steps above them) checked nothing: it fails
    args = SimpleNamespace(
        use_vllm=True, vllm_importance_sampling_correction=True, logging_steps=10
    )
    callback.on_train_begin(args, state, None)
    with pytest.raises(MismatchError, match=r"logged none of the 7 training steps .*=10\)"):
        callback.on_train_end(args, state, None)
    callback.on_log(args, state, None, logs=logs)
    callback.on_train_end(args, state, None)


def _ratio_max():
    return "sampling/importance_sampling_ratio/max"


# ---- the trainer-side scoring, without TRL's loop -------------------------------------------


def test_right_padded_completions_score_like_single_rows(model_dir):
    """completion_logprobs of TRL's layout (left-padded prompts, right-padded completions) equal
    each sequence scored alone, bit for bit; plain torch on the same layout does not."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 12, (n,), generator=gen) for n in (2, 7, 4, 9)]
    completions = [torch.randint(1, 12, (n,), generator=gen) for n in (6, 1, 3, 6)]
    width_p, width_c = 9, 6
    ids = torch.zeros(4, width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        ids[row, width_p - len(p) : width_p], ids[row, width_p : width_p + len(c)] = p, c
        mask[row, width_p - len(p) : width_p + len(c)] = 1

    def batch_and_alone():
        with torch.no_grad():
            batch, _ = bik.trl.completion_logprobs(model, ids, mask, width_c, 0.7)
            alone = []
            for p, c in zip(prompts, completions):
                seq = torch.cat([p, c])[None]
                logits = model(seq).logits[0, len(p) - 1 : -1]
                alone.append(bik.token_logprobs(logits, c, 0.7))
        return batch, alone

    bik.patch_model(model, backend="cpu")
    batch, alone = batch_and_alone()
    for row, expected in enumerate(alone):
        got = batch[row, : len(expected)]
        assert torch.equal(got, expected), f"row {row}"
        assert bool((batch[row, len(expected) :] == 0).all())
    bik.unpatch_model(model)
    batch, alone = batch_and_alone()
    if all(torch.equal(batch[row, : len(e)], e) for row, e in enumerate(alone)):
        # Seen on a 2-core AVX-512 Xeon: torch's CPU kernels kept one order for every row
        # count of these tiny shapes; the bik assertions above still ran.
        pytest.skip("plain torch gave every row its single-row bits on this CPU: no control")
