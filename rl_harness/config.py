"""Run configuration: nested defaults, ``--set section.key=value`` overrides, validation.

Every knob of a run lives here with its default; recipes are sets of overrides. A bad key,
value or combination raises ``ConfigError`` before any work starts.
"""

import copy
import json
from pathlib import Path

DEFAULTS = {
    "seed": 0,
    "steps": 200,
    "checkpoint_every": 20,
    "model": {  # a tiny random-init Qwen3-style policy, or a local model directory
        "path": None,
        "family": "qwen3",
        "hidden_size": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 16,
    },
    "task": {"name": "addition", "min_digits": 1, "max_digits": 2},
    "warmup": {"steps": 600, "lr": 3e-3, "batch_size": 64},  # supervised, cached, before RL
    "rollout": {
        "prompts": 32,
        "samples_per_prompt": 4,
        "max_new_tokens": 10,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        # mismatch sources, all on the rollout side; defaults give zero mismatch
        "kernels": "bik",
        "dtype": "float32",
        "split_size": 0,
        "logit_noise_std": 0.0,
        "logit_noise_bias": 0.0,
        "logit_round_bits": 0,
    },
    "train": {
        "advantage": "grpo",
        "loss": "ppo",
        "lr": 2e-4,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dtype": "float32",
        "kernels": "bik",
        "micro_batch_size": 0,  # 0: the whole batch in one forward
    },
    "remedy": {
        "name": "none",
        "clip": 2.0,
        "low": 0.5,
        "high": 2.0,
        "geo_low": 0.999,
        "geo_high": 1.001,
        "k_threshold": 0.01,
        "veto": 1e-4,
        "self_normalize": False,
        "bypass": False,
    },
    "lr_schedule": {
        "name": "constant",
        "min_ratio": 0.1,
        "period_factor": 1.8,
        "surge_ratio": 1.5,
        "surge_window": 5,
        "decay_period": 0,
    },
    "collapse": {
        "window": 5,
        "reward_drop": 0.5,
        "grad_norm_factor": 10.0,
        "grad_norm_floor": 0.01,
        "k3_max": 0.05,
        "ess_min": 0.5,
        "length_surge": 2.0,
    },
    "assert_zero_mismatch": True,  # a run whose config injects nothing must measure exactly 0
}

CHOICES = {
    "model.family": ("llama", "mistral", "qwen2", "qwen3"),
    "task.name": ("addition", "sorting", "counting"),
    "rollout.kernels": ("bik", "native"),
    "train.kernels": ("bik", "native"),
    "rollout.dtype": ("float32", "bfloat16", "float16"),
    "train.dtype": ("float32", "bfloat16", "float16"),
    "train.advantage": ("grpo", "rloo"),
    "train.loss": ("ppo", "reinforce"),
    "remedy.name": (
        "none",
        "token_tis",
        "seq_tis",
        "geo_is",
        "geo_rs",
        "token_mis",
        "k1_rs",
        "k3_rs",
        "token_veto",
        "fp16",
    ),
    "lr_schedule.name": ("constant", "length_surge"),
}


class ConfigError(ValueError):
    """A configuration that cannot run, reported before any work starts."""


def _coerce(key, text, default):
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"{key}: expected true or false, got {text!r}")
        return text.lower() in ("true", "1")
    if isinstance(default, int) and not isinstance(default, bool):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{key}: expected an integer, got {text!r}") from None
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {text!r}") from None
    return None if text.lower() in ("none", "null") else text


def apply(config, key, value):
    """Set ``section.key`` (a string value is converted to the default's type)."""
    section, _, name = key.rpartition(".")
    node = config
    for part in filter(None, section.split(".")):
        if not isinstance(node.get(part), dict):
            raise ConfigError(f"unknown config key {key!r}")
        node = node[part]
    if name not in node or isinstance(node[name], dict):
        raise ConfigError(
            f"unknown config key {key!r}; known: {', '.join(sorted(flatten(config)))}"
        )
    default = DEFAULTS_FLAT.get(key, node[name])
    node[name] = _coerce(key, value, default) if isinstance(value, str) else value


def flatten(config, prefix=""):
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


DEFAULTS_FLAT = flatten(DEFAULTS)


def build(overrides=(), sets=()):
    """DEFAULTS + a recipe's ``overrides`` (dict) + ``--set key=value`` strings, validated."""
    config = copy.deepcopy(DEFAULTS)
    for key, value in dict(overrides).items():
        apply(config, key, value)
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set: expected key=value, got {item!r}")
        apply(config, key.strip(), value.strip())
    validate(config)
    return config


def validate(config):
    flat = flatten(config)
    for key, allowed in CHOICES.items():
        if flat[key] not in allowed:
            raise ConfigError(f"{key}: expected one of {allowed}, got {flat[key]!r}")
    positive = [
        "steps",
        "rollout.prompts",
        "rollout.samples_per_prompt",
        "rollout.max_new_tokens",
        "rollout.temperature",
        "train.lr",
        "remedy.clip",
        "warmup.batch_size",
    ]
    for key in positive:
        if not flat[key] > 0:
            raise ConfigError(f"{key}: expected a positive value, got {flat[key]!r}")
    if flat["train.advantage"] in ("grpo", "rloo") and flat["rollout.samples_per_prompt"] < 2:
        raise ConfigError(
            "rollout.samples_per_prompt: grpo/rloo advantages need at least 2 samples per prompt"
        )
    if not 0 < flat["rollout.top_p"] <= 1:
        raise ConfigError(f"rollout.top_p: expected a value in (0, 1], got {flat['rollout.top_p']}")
    if flat["rollout.split_size"] % 32:
        raise ConfigError("rollout.split_size: expected 0 (bik's default) or a multiple of 32")
    if flat["rollout.split_size"] and flat["rollout.kernels"] != "bik":
        raise ConfigError("rollout.split_size only applies to rollout.kernels=bik")
    if not 0 <= flat["rollout.logit_round_bits"] <= 23:
        raise ConfigError("rollout.logit_round_bits: expected 0 (off) to 23 mantissa bits")
    if flat["remedy.name"] == "fp16" and (flat["train.dtype"], flat["rollout.dtype"]) != (
        "float32",
        "float32",
    ):
        raise ConfigError(
            "remedy.name=fp16 sets both dtypes itself; leave train.dtype and "
            "rollout.dtype at float32"
        )
    path = flat["model.path"]
    if path is not None and not Path(path).is_dir():
        raise ConfigError(f"model.path: no model directory at {path!r}")


def is_zero_mismatch(config):
    """True when nothing in the config makes the rollout differ from the trainer."""
    r, t = config["rollout"], config["train"]
    return (
        r["kernels"] == "bik"
        and t["kernels"] == "bik"
        and r["dtype"] == t["dtype"]
        and r["split_size"] == 0
        and r["logit_noise_std"] == 0
        and r["logit_noise_bias"] == 0
        and r["logit_round_bits"] == 0
    )


def save(config, path):
    Path(path).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")


def load(path):
    config = json.loads(Path(path).read_text())
    validate(config)
    return config
