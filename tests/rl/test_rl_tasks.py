"""rl_harness.tasks: the shipped tasks (the old three bit for bit), the growable ones, plug-ins,
the warm-up's long-form share and seed."""

import hashlib
import random

import pytest
import torch
from rl_helpers import TINY, tiny_model_dir

from rl_harness import config, policy, runner, tasks, vocab
from rl_harness.errors import ConfigError
from rl_harness.vocab import CHAR, CHARS

# Recorded with the harness before tasks became plug-ins: every shipped result depends on them.
SAMPLES = {
    ("addition", 3, 7): [
        ("4694+853=", "5547"),
        ("5100231+9896070=", "14996301"),
        ("45707+647=", "46354"),
    ],
    ("sorting", 1, 2): [("s:9,4,7=", "4,7,9"), ("s:2,0,4=", "0,2,4"), ("s:5,1,3,3=", "1,3,3,5")],
    ("counting", 1, 2): [("cd:bbdaac=", "1"), ("ca:dccb=", "0"), ("cd:adc=", "1")],
}
SFT_BATCHES = {
    ("addition", 1, 2): "1237f460aa95bfef781bf200843bcf90a1e57e989d813499c5b6c7e8fb448825",
    ("addition", 3, 7): "028a25f80967137c2bccc3844f3bcb3f758905dd874c2471969f1ea3cce75333",
    ("sorting", 1, 2): "8cca8e967b59677598fe921bbd9dbe30bf3b8ffb7a156336b7c2c93c4bad8dc2",
    ("sorting", 3, 7): "5d1d207ecdf7b37e2f86f7e3ce431601c5189586ad076840da3e99afcdd9cd34",
    ("counting", 1, 2): "031cc51996a181aa7483026d84f8860b5bb3d049f3db373580be71928159f850",
    ("counting", 3, 7): "bdb7dbb516ee3c0073caf190a300312c6d7da318f4a1fb0dac28863a7d2f1867",
}
# warmup_cache_path(config.build(sets=...), "c").name under NUMERICS: warmup.seed unset keeps
# a run's key (the names of before warmup.seed existed, recomputed when the key took in the
# numerics the warm-up's bits depend on)
NUMERICS = {"threads": 2, "torch": "2.13.0+cpu", "cpu": "AVX512"}
CACHE_NAMES = {
    (): "warmup-edf7dd44055dc254.pt",
    ("seed=3", "task.name=sorting"): "warmup-213891f19b72c9c7.pt",
    ("model.hidden_size=32",): "warmup-daacae0fac0e1253.pt",
}


def _task_cfg(name, low, high, **extra):
    sets = {"task.name": name, "task.min_digits": low, "task.max_digits": high, **extra}
    return config.build(sets)


def _sft_digest(cfg, share=0.0):
    rng, digest = random.Random("warmup-0"), hashlib.sha256()
    cfg = cfg.replace(**{"warmup.long_form_share": share})
    for _ in range(3):
        for t in policy.sft_batch(cfg, rng, 16):
            digest.update(t.numpy().tobytes())
            digest.update(str(tuple(t.shape)).encode())
    return digest.hexdigest()


@pytest.mark.parametrize("key", SAMPLES)
def test_direct_tasks_draw_what_they_always_drew(key):
    name, low, high = key
    rng = random.Random(f"{name}-{low}")
    drawn = [tasks.TASKS[name].sample(rng, low, high) for _ in range(3)]
    assert [(e.prompt, e.answer, e.long_form) for e in drawn] == [(*s, None) for s in SAMPLES[key]]


@pytest.mark.parametrize("key", SFT_BATCHES)
def test_direct_tasks_warmup_batches_are_unchanged(key):
    cfg = _task_cfg(*key)
    assert _sft_digest(cfg) == SFT_BATCHES[key]
    assert _sft_digest(cfg, share=0.5) == SFT_BATCHES[key]  # no long form: the same targets


def test_direct_reward_is_exact_match_then_eos():
    example = tasks.Example("7+5=", "12")
    task = tasks.TASKS["addition"]
    ids = CHAR.encode("12")
    assert tasks.score(task, example, ids + [CHAR.eos, CHAR.pad], CHAR) == 1.0
    assert tasks.score(task, example, [CHAR.bos, *ids, CHAR.eos], CHAR) == 1.0  # specials dropped
    assert tasks.score(task, example, ids, CHAR) == 0.0  # unfinished
    assert tasks.score(task, example, CHAR.encode("x:12") + [CHAR.eos], CHAR) == 0.0
    assert tasks.score(task, example, [*ids, CHAR.size, CHAR.eos], CHAR) == 0.0  # out of vocab


def test_task_names_are_the_config_choices():
    with pytest.raises(config.ConfigError, match=r"task\.name: expected one of \('addition'"):
        config.build({}, ["task.name=subtraction"])
    for name in tasks.TASKS:  # every registered task is a choice (chat_addition: a tokenizer)
        assert name in config.TASK_NAMES
        if name != "chat_addition":
            assert config.build({}, [f"task.name={name}"]).task.name == name


def test_scratch_addition_forms():
    example = tasks.TASKS["scratch_addition"].sample(random.Random(0), 3, 3)
    a, b = (int(x) for x in example.prompt[:-1].split("+"))
    assert example.answer == str(a + b)
    scratch, _, answer = example.long_form.rpartition(":")
    assert answer == example.answer
    columns = scratch.split(",")
    assert len(columns) == 3
    assert columns[0] == f"{a % 10}+{b % 10}+0={a % 10 + b % 10}"


def test_iterate_forms():
    class StartAt37(random.Random):
        def randrange(self, *args):
            return 37

    assert tasks.TASKS["iterate"].draw(StartAt37(), 3) == ("i37n03=", "02=18,01=61,00=90", "90")
    example = tasks.TASKS["iterate"].sample(random.Random(0), 3, 3)
    assert example.long_form.startswith("02=") and example.long_form.endswith(":" + example.answer)


@pytest.mark.parametrize("name", ["scratch_addition", "iterate"])
def test_growable_reward_takes_the_final_answer(name):
    task = tasks.TASKS[name]
    example = task.sample(random.Random(1), 4, 4)
    assert task.reward(example, example.long_form, True) == 1.0
    assert task.reward(example, example.answer, True) == 1.0
    assert task.reward(example, "junk:" + example.answer, True) == 1.0
    assert task.reward(example, example.long_form, False) == 0.0
    assert task.reward(example, example.long_form + "1", True) == 0.0
    assert task.target(example, long_form=True) == example.long_form
    assert task.target(example, long_form=False) == example.answer
    assert set(example.prompt + example.long_form) <= set(CHARS)


@pytest.mark.parametrize("name", ["scratch_addition", "iterate"])
def test_growable_lengths_reach_long_responses_within_their_bounds(name):
    task, rng = tasks.TASKS[name], random.Random(2)
    for size in (1, 10, 20):
        prompt_max, target_max = task.max_lengths(size)
        for _ in range(50):
            example = task.sample(rng, size, size)
            assert len(example.prompt) <= prompt_max
            assert len(example.long_form) <= target_max
            assert len(example.answer) <= size + 1
    longest = [len(task.sample(rng, 20, 20).long_form) for _ in range(20)]
    assert min(longest) >= 100 and max(longest) <= 210
    assert 1 + task.max_lengths(20)[0] + task.max_lengths(20)[1] + 1 <= 256


def test_long_form_share_sets_the_first_rows_targets():
    cfg = _task_cfg("iterate", 2, 5)
    short = policy.sft_batch(cfg, random.Random(0), 8)
    mixed = policy.sft_batch(cfg.replace(**{"warmup.long_form_share": 0.25}), random.Random(0), 8)
    # the same problems (no random number decides the form); two rows in the long form
    targets = [t.sum() for t in mixed[2]]
    assert [int(t) for t in targets[2:]] == [int(t) for t in short[2].sum(-1)[2:]]
    assert all(int(t) > 4 for t in targets[:2])
    texts = [CHAR.decode(row[mask.bool()].tolist()) for row, mask in zip(mixed[0], mixed[2])]
    assert all(":" in t for t in texts[:2]) and not any(":" in t for t in texts[2:])


def test_plugin_module_replaces_the_task_name(tmp_path):
    cfg = config.build({}, TINY + ["steps=2", "task.module=rl_plugin_task"])
    assert isinstance(tasks.of(cfg.task), tasks.Task)
    rows, examples = tasks.prompt_batch(cfg, random.Random(0))
    assert all(e.prompt.startswith("e:") for e in examples)
    assert rows[0] == [CHAR.bos, *CHAR.encode(examples[0].prompt)]
    runner.run(cfg, tmp_path / "run", cache_dir=tmp_path / "cache", progress=False)
    assert len(runner.read_metrics(tmp_path / "run")) == 2


@pytest.mark.parametrize("module", ["no_such_module_here", "rl_plugin_broken"])
def test_a_bad_plugin_module_is_refused_at_config(module):
    with pytest.raises(ConfigError, match=r"task\.module"):
        config.build({"task.module": module})


def test_sequences_that_cannot_fit_the_policy_are_refused(tmp_path):
    cfg = config.build({}, TINY + ["task.name=iterate", "rollout.max_new_tokens=250"])
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens: expected at most 248"):
        runner.Run(cfg, tmp_path / "cache")
    policy.check_positions(cfg.replace(**{"rollout.max_new_tokens": 248}), 256)
    wide = config.build({"task.name": "sorting", "task.max_digits": 20})
    with pytest.raises(ConfigError, match=r"task\.max_digits"):
        policy.check_positions(wide, 200)


@pytest.mark.parametrize("sets", CACHE_NAMES)
def test_warmup_cache_keys_without_warmup_seed_are_unchanged(sets, monkeypatch):
    """A plain-torch warm-up (warmup.kernels=torch: every warm-up before the key) keeps its
    cache's name."""
    monkeypatch.setattr(policy, "warmup_numerics", lambda: NUMERICS)
    cfg = config.build(sets=[*sets, "warmup.kernels=torch"])
    assert policy.warmup_cache_path(cfg, "c").name == CACHE_NAMES[sets]


def test_warmup_cache_is_keyed_by_what_changes_its_bits(monkeypatch):
    """Issue 42, item 5: plain torch trains the warm-up (warmup.kernels=torch), and its bits
    change with the thread count; a run on 1 thread reused the cache of a run on 2 and hid it.
    bik's warm-up (issue 72, item 11) has the same bits on any thread count: one cache."""
    torch_order, bik_order = (config.build({}, [f"warmup.kernels={k}"]) for k in ("torch", "bik"))
    names, bik_names = set(), set()
    for change in ({}, {"threads": 1}, {"torch": "2.14.0+cpu"}, {"cpu": "AVX2"}):
        monkeypatch.setattr(policy, "warmup_numerics", lambda c=change: {**NUMERICS, **c})
        names.add(policy.warmup_cache_path(torch_order, "c").name)
        bik_names.add(policy.warmup_cache_path(bik_order, "c").name)
    assert len(names) == 4 and len(bik_names) == 3 and not names & bik_names
    monkeypatch.undo()
    # the key reads torch's own count (a stand-in for it: whether torch.set_num_threads takes
    # effect in a test process depends on what ran in it before)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = [policy.warmup_cache_path(cfg, "c") for cfg in (torch_order, bik_order)]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    two = [policy.warmup_cache_path(cfg, "c") for cfg in (torch_order, bik_order)]
    assert two[0] != one[0] and two[1] == one[1]


def test_warmup_seed_keys_the_cache_and_the_init():
    def path(**sets):
        return policy.warmup_cache_path(config.build(sets), "c")

    assert path(seed=1, **{"warmup.seed": 5}) == path(seed=2, **{"warmup.seed": 5})
    assert path(seed=1, **{"warmup.seed": 5}) == path(seed=5)
    assert path(seed=1, **{"warmup.seed": 5}) != path(seed=1)
    assert policy.warmup_seed(config.build({"seed": 3})) == 3
    assert policy.warmup_seed(config.build({"seed": 3, "warmup.seed": 0})) == 0


def test_warmup_seed_sets_the_init_and_the_data(tmp_path):
    def warmed(seed, *sets):
        cfg = config.build({}, TINY + ["warmup.steps=2", f"seed={seed}", *sets])
        return runner.Run(cfg, tmp_path / f"cache{seed}{sets}").master.state_dict()

    shared, own, other = warmed(1, "warmup.seed=7"), warmed(7), warmed(1)
    assert all(torch.equal(shared[k], own[k]) for k in shared)
    assert not all(torch.equal(shared[k], other[k]) for k in shared)


def _tokenizer_model_dir(path, pad=True):
    """A tiny local Qwen3 with a character-level tokenizer of its own (ids unlike the
    character vocabulary's, EOS and PAD last, no BOS), built offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [*CHARS, "<unk>", "<eos>", "<pad>"]
    model = models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>")
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    specials = {"unk_token": "<unk>", "eos_token": "<eos>", "pad_token": "<pad>" if pad else None}
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **specials).save_pretrained(path)
    return tiny_model_dir(path)


def test_a_local_tokenizer_is_the_runs_vocabulary(tmp_path):
    path = _tokenizer_model_dir(tmp_path / "model")
    cfg = config.build({}, TINY + [f"model.path={path}", "task.name=iterate", "task.max_digits=3"])
    words = vocab.of(cfg.model)
    assert isinstance(words, vocab.TokenizerVocab)
    assert (words.pad, words.bos, words.eos, words.size) == (42, None, 41, 43)
    rows, examples = tasks.prompt_batch(cfg, random.Random(0))
    assert rows[0] == [CHARS.index(c) for c in examples[0].prompt]  # no BOS
    job = runner.Run(cfg, tmp_path / "cache")  # the zero-mismatch assertion stays on
    assert job.master.config.eos_token_id == 41
    for step in range(2):
        record = job.step(step)
        assert record.metrics["mismatch/tokens_unequal_count"] == 0
    batch = record.batch
    width = int(batch.response_mask.any(0).nonzero()[0])  # the first response column
    for ids, length in zip(
        batch.sequences[:, width:].tolist(), batch.response_mask.sum(-1).tolist()
    ):
        # the policy's 48 ids: the characters, <unk> (dropped), EOS, PAD, 5 beyond the tokenizer
        text = "".join(CHARS[i] if i < 40 else vocab.UNKNOWN * (i >= 43) for i in ids[:length])
        assert words.decode(ids) == text  # through the tokenizer: its ids, its EOS
        assert all(i == words.pad for i in ids[length:])
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens: expected at most 120"):
        runner.Run(cfg.replace(**{"rollout.max_new_tokens": 121}), tmp_path / "cache")


def test_a_tokenizer_without_pad_pads_with_eos(tmp_path):
    path = _tokenizer_model_dir(tmp_path / "model", pad=False)
    words = vocab.of(config.build({"model.path": str(path)}).model)
    assert words.pad == words.eos == 41
    assert words.prompt("12") == [1, 2] and words.decode([1, 2, 41, 5]) == "12"


def test_a_model_dir_without_tokenizer_keeps_the_character_vocabulary(tmp_path):
    path = _tokenizer_model_dir(tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    cfg = config.build({"model.path": str(path)})
    assert vocab.of(cfg.model) is CHAR
    assert policy.build_master(cfg.model, 0).config.eos_token_id == CHAR.eos
