"""rl_harness config: frozen per-section dataclasses, validated once, errors naming the key."""

import dataclasses
import json
from pathlib import Path

import pytest

from rl_harness import config, recipes, rundir
from rl_harness.config import Config, ConfigError

RESULTS = Path(__file__).resolve().parents[2] / "results" / "rl"


def test_sections_are_frozen_dataclasses_with_the_defaults():
    cfg = config.build()
    assert cfg == Config() and cfg.rollout.top_k == 0 and cfg.train.lr == 2e-4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.top_k = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3


def test_set_strings_and_recipe_values_are_typed():
    cfg = config.build(
        {"train.lr": 1e-3, "rollout.temperature": 1},
        ["rollout.top_k=8", "remedy.bypass=true", "model.path=none", "train.lr=5e-4"],
    )
    assert cfg.rollout.top_k == 8 and cfg.remedy.bypass is True and cfg.model.path is None
    assert cfg.train.lr == 5e-4  # --set wins over the recipe
    assert isinstance(cfg.rollout.temperature, float)


def shipped_runs(name: str) -> list[Path]:
    """Where recipe ``name``'s committed runs lie: results/rl/<name>, else seed 0 of each
    sweep that ran it (results/rl/<sweep>/<name>/seed0; a sweep may have run it with --set
    overrides)."""
    if (RESULTS / name).is_dir():
        return [RESULTS / name]
    return sorted(RESULTS.glob(f"*/{name}/seed0"))


REMEDY_DECAY_PERIOD = 17  # fp8w_fixed's P, registered in RESULTS.md section 17 from its pilot


def grid_runs(name: str) -> list[tuple[Path, Config]]:
    """The runs of a stability-edge grid of recipe ``name`` (results/rl/<name>/lr<LR>/<arm>/
    seed<k>: a dose of rl_harness.studies.edge or a remedy arm of
    rl_harness.studies.edge_remedies) and the config each builds today."""
    from rl_harness.studies import edge, edge_remedies

    runs = []
    for path in sorted(RESULTS.glob(f"{name}/lr*/*/seed*")):
        lr, arm, seed = float(path.parts[-3][2:]), path.parts[-2], int(path.parts[-1][4:])
        if arm in edge.DOSES:
            cfg = edge.cell_config(name, edge.Cell(lr, arm, seed))
        else:
            cfg = edge_remedies.arm_config(name, lr, arm, seed, decay_period=REMEDY_DECAY_PERIOD)
        runs.append((path, cfg))
    return runs


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_shipped_config_json_reads_back_unchanged(name):
    """Every recipe has a committed run whose config.json is what the recipe builds today,
    byte for byte (a grid's runs: what their cell builds)."""
    grid = grid_runs(name)
    if grid:
        for path, cell in grid:
            text = (path / "config.json").read_text()
            assert text == rundir.config_text(cell, rundir.recorded_world_size(path) or 1)
        return
    expected = config.build(recipes.overrides(name))
    runs = shipped_runs(name)
    # config.json: the sections, and the world size beside them where the run recorded it
    texts = [(path / "config.json").read_text() for path in runs]
    sizes = [rundir.recorded_world_size(path) for path in runs]
    assert any(
        t == (expected.to_json() if n is None else rundir.config_text(expected, n))
        for t, n in zip(texts, sizes)
    )
    for path, text, size in zip(runs, texts, sizes):  # every shipped config reads back
        cfg = config.load(path / "config.json")
        assert (cfg.to_json() if size is None else rundir.config_text(cfg, size)) == text


def test_older_config_json_without_a_section_loads_with_defaults(tmp_path):
    values = Config().to_dict()
    del values["collapse"], values["train"]["micro_batch_size"]
    (tmp_path / "config.json").write_text(json.dumps(values))
    assert config.load(tmp_path / "config.json") == Config()


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "not a readable config"),
        ("[1, 2]", "expected a JSON object"),
        ('{"train": {"lr": -1}}', "train.lr: expected a number > 0"),
        ('{"nope": 1}', "unknown config key 'nope'"),
    ],
)
def test_unreadable_config_json_names_the_file(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=match) as error:
        config.load(tmp_path / "config.json")
    assert str(tmp_path / "config.json") in str(error.value)


def test_replace_revalidates():
    assert Config().replace(**{"rollout.top_k": 4}).rollout.top_k == 4
    with pytest.raises(ConfigError, match=r"rollout\.top_k"):
        Config().replace(**{"rollout.top_k": -4})


@pytest.mark.parametrize(
    "sets, match",
    [
        (["rollout.nope=1"], "unknown config key 'rollout.nope'"),
        (["train.lrr=1"], "unknown config key 'train.lrr'; did you mean 'train.lr'?"),
        (["rollout.kernels=fast"], "rollout.kernels: expected one of"),
        (["train.lr=abc"], "train.lr: expected a finite number"),
        (["rollout.split_size=32", "rollout.kernels=native"], "split_size only applies"),
        (["rollout.split_size=40"], "rollout.split_size: .*multiple of 32"),
        (["model.path=/no/such/model"], "model.path: no model directory"),
        (["remedy.name=fp16", "rollout.dtype=bfloat16"], "remedy.name=fp16 sets both dtypes"),
        (["rollout.samples_per_prompt=1"], "rollout.samples_per_prompt: expected an integer >= 2"),
        (["steps"], "--set: expected key=value"),
        (["remedy.bypass=maybe"], "remedy.bypass: expected true or false"),
        (["rollout.top_k=2.5"], "rollout.top_k: expected an integer"),
        # issue 11: values that used to crash mid-run, after the warm-up
        (["train.grad_clip=-1"], "train.grad_clip: expected a number > 0"),
        (["steps=0"], "steps: expected an integer >= 1"),
        (["checkpoint_every=0"], "checkpoint_every: expected an integer >= 1"),
        (["collapse.window=0"], "collapse.window: expected an integer >= 1"),
        (["rollout.top_k=-1"], "rollout.top_k: expected an integer >= 0"),
        (["train.micro_batch_size=-2"], "train.micro_batch_size: expected an integer >= 0"),
        (["model.heads=3"], r"model.heads: expected a divisor of model.hidden_size \(64\)"),
        (["model.kv_heads=3"], r"model.kv_heads: expected a divisor of model.heads \(4\)"),
        (["model.head_dim=7"], "model.head_dim: expected a multiple of 2"),
        (["train.lr=inf"], "train.lr: expected a finite number, got inf"),
        (["train.lr=nan"], "train.lr: expected a finite number, got nan"),
        (["rollout.temperature=1e-39"], "rollout.temperature: expected a number >= 0.001"),
        (["rollout.temperature=0"], "rollout.temperature: expected a number >= 0.001"),
        (["rollout.top_p=0"], "rollout.top_p: expected a number > 0 and <= 1"),
        (["rollout.top_p=1.5"], "rollout.top_p: expected a number > 0 and <= 1"),
        (["rollout.logit_round_bits=24"], "rollout.logit_round_bits: expected an integer"),
        (["rollout.logit_noise_bias=-inf"], "rollout.logit_noise_bias: expected a finite"),
        (["remedy.clip=0.5"], "remedy.clip: expected a number >= 1"),
        (["remedy.high=0.1"], r"remedy.high: expected at least remedy.low \(0.5\)"),
        (["task.min_digits=3"], r"task.max_digits: expected at least task.min_digits \(3\)"),
        (["seed=-1"], "seed: expected an integer >= 0"),
        (["collapse.ess_min=2"], "collapse.ess_min: expected a number >= 0 and <= 1"),
        (["lr_schedule.min_ratio=0"], "lr_schedule.min_ratio: expected a number > 0"),
        (["train.ppo_epochs=0"], "train.ppo_epochs: expected an integer >= 1"),
        (["train.mini_batches=0"], "train.mini_batches: expected an integer >= 1"),
        (["train.mini_batches=3"], r"train.mini_batches: expected a divisor of rollout.prompts"),
        (["train.loss_agg=seq_sum"], "train.loss_agg: expected one of"),
    ],
)
def test_bad_configs_raise_at_construction(sets, match):
    with pytest.raises(ConfigError, match=match):
        config.build({}, sets)


@pytest.mark.parametrize("key", [k for k, v in config.DEFAULTS.items() if type(v) is float])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_key_must_be_finite(key, value):
    with pytest.raises(ConfigError, match=f"^{key}: expected a finite number"):
        config.build({}, [f"{key}={value}"])


@pytest.mark.parametrize("key", [k for k, v in config.DEFAULTS.items() if type(v) is int])
def test_every_integer_key_has_a_range(key):
    with pytest.raises(ConfigError, match=f"^{key}: expected an integer >="):
        config.build({}, [f"{key}=-1"])


def test_wrongly_typed_recipe_values_are_refused():
    with pytest.raises(ConfigError, match=r"remedy\.bypass: expected true or false, got 1"):
        config.build({"remedy.bypass": 1})
    with pytest.raises(ConfigError, match=r"train\.lr: expected a finite number, got None"):
        config.build({"train.lr": None})


def test_unknown_recipe_is_a_config_error():
    with pytest.raises(ConfigError, match="--recipe: unknown recipe 'nope'"):
        recipes.overrides("nope")


def test_fp16_remedy_sets_both_sides_and_the_loss_scale():
    p = config.build({"remedy.name": "fp16"}).precision
    assert (p.train_dtype, p.rollout_dtype, p.loss_scale) == ("float16", "float16", 1024.0)
    assert config.build({"remedy.name": "fp16"}).zero_mismatch
    p = config.build({}, ["rollout.dtype=bfloat16"]).precision
    assert (p.train_dtype, p.rollout_dtype, p.loss_scale) == ("float32", "bfloat16", 1.0)
    assert not config.build({}, ["rollout.dtype=bfloat16"]).zero_mismatch
    assert not config.build({}, ["rollout.weight_round_bits=3"]).zero_mismatch


def test_mini_batches_run_in_one_process():
    from rl_harness.distributed import World
    from rl_harness.runner import check_world

    cfg = config.build({}, ["train.mini_batches=4", "train.ppo_epochs=2"])
    check_world(cfg, World())
    with pytest.raises(ConfigError, match=r"train.mini_batches=4: PPO mini-batches run in one"):
        check_world(cfg, World(0, 2))
    check_world(config.build({}, ["train.ppo_epochs=2"]), World(1, 2))  # epochs alone: fine
