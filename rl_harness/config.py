"""Run configuration: one frozen dataclass per section, validated once, at construction.

Every knob of a run lives here with its default; recipes are sets of overrides. ``build``
applies a recipe's overrides and ``--set section.key=value`` strings to the defaults and
returns a :class:`Config`; a bad key, value or combination raises :class:`ConfigError`
naming the dotted key and what was expected, before any work starts. ``config.json`` in a
run directory is :meth:`Config.to_json` (nested, one object per section); :func:`load` reads
it back, filling keys an older file lacks with their defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from bik.contract import DTYPE_NAMES, TP_CHUNKS, check_split_size
from bik.families import FAMILIES, MOE_FAMILIES, SUPPORTED_FAMILIES
from bik.testing.models import MODELS

from . import tasks
from .errors import ConfigError
from .remedies import IS_REMEDIES, Precision, RemedyConfig, precision
from .sections import Section, spec

__all__ = [
    "CollapseConfig",
    "Config",
    "ConfigError",
    "EvalConfig",
    "LRScheduleConfig",
    "ModelConfig",
    "RemedyConfig",
    "RolloutConfig",
    "TaskConfig",
    "TrainConfig",
    "WarmupConfig",
    "build",
    "flatten",
    "load",
]

KERNELS = ("bik", "native")
TASK_NAMES = tuple(tasks.TASKS)  # the task registry's names (rl_harness.tasks.TASKS)
KL_ESTIMATORS = ("k1", "k2", "k3")
ENGINES = ("hf", "vllm")
SHADOWS = ("none", "native")  # rollout.shadow: off, or a native-kernel meter
SPECULATIVE = ("none", "ngram")  # rollout.speculative: off, or n-gram (prompt lookup) drafts
DTYPES = tuple(DTYPE_NAMES)  # bik.contract's one table of dtype names
WARMUP_KERNELS = ("bik", "torch")  # warmup.kernels; a saved config without it: torch
MIN_TEMPERATURE = 1e-3  # below it logits / T and the 1 / T gradients overflow float32

# The harness compares the rollout's expert choices with the trainer's (routing flips): bik's
# engine records them (bik.vllm.routing), vLLM's own CPU engine cannot (its capture needs the
# V2 model runner, which needs Triton)
VLLM_MOE_REFUSAL = (
    "native vLLM does not report the expert choices the harness compares (routing flips) for "
    "mixture-of-experts policies on this platform"
)


@dataclass(frozen=True)
class ModelConfig(Section):
    """A tiny random-init policy of ``family``, or a local model directory (``path``), or a
    real model of bik.testing.models by name (``path=smollm2``: prepared on first use).

    ``chat_template``: prompts are the user turn of the tokenizer's chat template, ready for
    the assistant's answer (a ``path`` model whose tokenizer has one).

    ``experts`` and ``experts_per_token`` size the mixture-of-experts families
    (bik.families.MOE_FAMILIES); the dense families ignore them."""

    SECTION: ClassVar[str] = "model"
    path: str | None = None
    chat_template: bool = False
    family: str = spec("qwen3", choices=SUPPORTED_FAMILIES)
    hidden_size: int = spec(64, ge=1)
    layers: int = spec(2, ge=1)
    heads: int = spec(4, ge=1)
    kv_heads: int = spec(2, ge=1)
    head_dim: int = spec(16, ge=2, multiple_of=2)  # RoPE rotates pairs of dimensions
    experts: int = spec(8, ge=1)
    experts_per_token: int = spec(2, ge=1)

    @property
    def moe(self) -> bool:
        """True for a random-init mixture-of-experts family (a ``path`` model: see
        rl_harness.routing.routers)."""
        return self.path is None and self.family in MOE_FAMILIES

    def _validate(self) -> None:
        if self.experts_per_token > self.experts:
            raise ConfigError(
                f"model.experts_per_token: expected at most model.experts ({self.experts}), "
                f"got {self.experts_per_token}"
            )
        if self.hidden_size % self.heads:
            raise ConfigError(
                f"model.heads: expected a divisor of model.hidden_size ({self.hidden_size}), "
                f"got {self.heads}"
            )
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model.kv_heads: expected a divisor of model.heads ({self.heads}), "
                f"got {self.kv_heads}"
            )
        if self.path is not None and self.path not in MODELS and not Path(self.path).is_dir():
            raise ConfigError(
                f"model.path: no model directory at {self.path!r} (nor a real model: "
                f"{', '.join(MODELS)})"
            )
        if self.chat_template and self.path is None:
            raise ConfigError(
                "model.chat_template: expected a model.path whose tokenizer has a chat template"
            )


@dataclass(frozen=True)
class TaskConfig(Section):
    """The task (rl_harness.tasks): a shipped one by ``name``, or a plug-in ``module`` (an
    importable module whose ``TASK`` implements rl_harness.tasks.Task; it replaces ``name``),
    and its size range."""

    SECTION: ClassVar[str] = "task"
    name: str = spec("addition", choices=TASK_NAMES)
    module: str | None = None
    # at most 20: the longest warm-up sequence (sorting 60 digits) fits the 256 positions
    min_digits: int = spec(1, ge=1, le=20)
    max_digits: int = spec(2, ge=1, le=20)

    def _validate(self) -> None:
        if self.max_digits < self.min_digits:
            raise ConfigError(
                f"task.max_digits: expected at least task.min_digits ({self.min_digits}), "
                f"got {self.max_digits}"
            )
        if self.module is not None:
            tasks.load(self.module)  # a module that cannot serve is refused before any work


@dataclass(frozen=True)
class WarmupConfig(Section):
    """Supervised warm-up on the task before RL (cached, see policy.warmup).

    ``seed``: the warm-up's own seed (its data order), so several RL seeds can start from one
    warmed-up policy; None: the run's ``seed``. ``long_form_share``: the share of warm-up
    targets in the task's long form (a scratchpad before the answer), for tasks that have
    one; the rest answer directly, so RL can discover that the long form pays. ``kernels``:
    ``bik`` trains it in bik's fixed orders, so a config names one warm-up on any thread count
    (policy.warmup); ``torch`` in plain torch, whose CPU reductions split by thread (the
    warm-ups of runs saved before this key existed, which load as ``torch``)."""

    SECTION: ClassVar[str] = "warmup"
    steps: int = spec(600, ge=0)
    lr: float = spec(3e-3, gt=0)
    batch_size: int = spec(64, ge=1)
    seed: int | None = spec(None, ge=0)
    long_form_share: float = spec(0.0, ge=0, le=1)
    kernels: str = spec("bik", choices=WARMUP_KERNELS)


@dataclass(frozen=True)
class RolloutConfig(Section):
    """Sampling, and every rollout-side mismatch source (defaults inject none)."""

    SECTION: ClassVar[str] = "rollout"
    prompts: int = spec(32, ge=1)
    samples_per_prompt: int = spec(4, ge=2)  # grpo and rloo compare samples of one prompt
    max_new_tokens: int = spec(10, ge=1)
    temperature: float = spec(1.0, ge=MIN_TEMPERATURE)
    top_k: int = spec(0, ge=0)  # 0: off
    top_p: float = spec(1.0, gt=0, le=1)
    # hf: the harness's KV-cache sampler (rl_harness.rollout); vllm: an in-process vLLM
    # engine (rl_harness.engines.vllm)
    engine: str = spec("hf", choices=ENGINES)
    kernels: str = spec("bik", choices=KERNELS)
    dtype: str = spec("float32", choices=DTYPES)
    split_size: int = spec(0, ge=0)  # 0: bik's default attention split
    logit_noise_std: float = spec(0.0, ge=0)
    logit_noise_bias: float = spec(0.0)
    logit_round_bits: int = spec(0, ge=0, le=23)  # 0: off
    # The rollout copy's linear weights rounded to this many mantissa bits after every
    # refresh, as an fp8 rollout serves them (e4m3: 3, e5m2: 2; the exponent is not limited).
    weight_round_bits: int = spec(0, ge=0, le=23)  # 0: off
    # The vLLM engine's tensor-parallel degree (a worker process per rank, each on its own
    # core). Above 1 the rollout and the trainer both run bik's TP-invariant order (row-
    # parallel K in bik.contract.TP_CHUNKS chunks), so TP 2 rollouts equal the one-process
    # trainer bit for bit.
    tensor_parallel: int = spec(1, ge=1)
    # Log a 16-bit digest of every response each step (metric rollout/response_digests), so a
    # paired analysis can say which rows an arm and its twin sampled alike
    # (rl_harness.studies.edge).
    digests: bool = spec(False)
    # The shadow meter: "native" computes, each step, the log-probs of the sampled tokens with
    # native torch kernels the rollout's way (decode over the KV cache, in rollout.dtype), for
    # measurement only (metrics shadow/...): what a fast engine's mismatch would have been.
    # Training reads none of it.
    shadow: str = spec("none", choices=SHADOWS)
    # Speculative decoding: "ngram" drafts up to speculative_tokens tokens a step by prompt
    # lookup (the continuation of the latest earlier match of the row's last
    # speculative_ngram tokens, down to 1) and one forward scores them. In the hf sampler
    # (rl_harness.rollout) a draft stands where it equals the token the sampler draws there:
    # the tokens, log-probs and random numbers are plain decoding's (with bik's kernels bit
    # for bit: the scoring forward gives each position a decode step's bits). In the vLLM
    # engine, vLLM's rejection sampler keeps or replaces drafts (tokens distributed as plain
    # sampling's, not the same draws; with bik every log-prob the trainer's). Metrics
    # rollout/draft_tokens, rollout/draft_accepted, rollout/forwards (vLLM: engine steps).
    speculative: str = spec("none", choices=SPECULATIVE)
    speculative_tokens: int = spec(4, ge=1)
    speculative_ngram: int = spec(3, ge=1)

    def _validate(self) -> None:
        if self.split_size:
            try:
                check_split_size(self.split_size)
            except ValueError as error:
                raise ConfigError(
                    f"rollout.split_size: expected 0 (bik's default) or a split size bik "
                    f"accepts ({error})"
                ) from None
            if self.kernels != "bik":
                raise ConfigError("rollout.split_size only applies to rollout.kernels=bik")
        if self.tensor_parallel > 1:
            if self.engine != "vllm":
                raise ConfigError(
                    f"rollout.tensor_parallel: expected 1 with rollout.engine={self.engine} "
                    f"(tensor parallelism is the vLLM engine's), got {self.tensor_parallel}"
                )
            if TP_CHUNKS % self.tensor_parallel:
                raise ConfigError(
                    f"rollout.tensor_parallel: expected a power of two dividing {TP_CHUNKS} "
                    f"(bik's TP-invariant order cuts K into {TP_CHUNKS} chunks), got "
                    f"{self.tensor_parallel}"
                )
        if self.shadow != "none" and self.engine != "hf":
            raise ConfigError(
                f"rollout.shadow={self.shadow}: the shadow meter replays the hf sampler's "
                f"decode; expected rollout.engine=hf, got {self.engine}"
            )
        if self.speculative != "none" and self.engine == "vllm" and self.top_k:
            raise ConfigError(
                f"rollout.top_k: expected 0 with rollout.speculative={self.speculative} on "
                f"rollout.engine=vllm (bik.vllm speculates with a temperature alone: "
                f"bik/vllm/speculative.py), got {self.top_k}"
            )
        if self.engine == "vllm":
            # The synthetic sources live in the hf sampler's loop; bik's vLLM attention runs
            # the default split; vLLM's top-p keeps another set than LogitsProcessor's (it
            # filters after the temperature, with its own cumulative sum).
            for key, off in (
                ("split_size", 0),
                ("logit_noise_std", 0.0),
                ("logit_noise_bias", 0.0),
                ("logit_round_bits", 0),
                ("weight_round_bits", 0),
                ("top_p", 1.0),
            ):
                if getattr(self, key) != off:
                    raise ConfigError(
                        f"rollout.{key}: expected {off} (off) with rollout.engine=vllm, which "
                        f"does not implement it; got {getattr(self, key)!r} (use rollout.engine=hf)"
                    )


LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass(frozen=True)
class TrainConfig(Section):
    """Advantages, loss, optimiser and the trainer side's kernels.

    PPO: each step's batch gets ``ppo_epochs`` passes; each pass updates on ``mini_batches``
    mini-batches in a fixed order (mini-batch k: the k-th contiguous run of
    rollout.prompts / mini_batches prompt groups), one optimiser step each. pi_old is the
    trainer's forward over the whole batch before the first update (the one the mismatch
    metrics use). The defaults (1, 1) are one update on the whole batch, whose PPO ratio is 1.

    ``loss_agg``: how a mini-batch's per-token losses become one number.
    ``token_mean``: their mean over all the mini-batch's response tokens. ``seq_mean_token_mean``:
    the mean over its sequences of each sequence's token mean. ``seq_mean_token_sum_norm``
    (Dr. GRPO): their sum over a constant, its number of sequences x rollout.max_new_tokens.

    ``filter_groups``: drop the prompt groups whose samples all got the same reward (all
    right or all wrong: zero GRPO advantage) from the loss, as DAPO's dynamic sampling does
    (without resampling: a step that drops every group makes no update).
    ``kl_coef``: weight of a KL penalty to the reference policy (the warmed-up policy, frozen)
    estimated per token by ``kl_estimator`` from d = log pi - log pi_ref (k1: d; k2: d^2 / 2;
    k3: the unbiased, always non-negative ``exp(-d) - 1 + d``, unclamped). ``entropy_coef``:
    weight of an entropy bonus (subtracted from the loss). Both terms are aggregated by
    ``loss_agg`` (rl_harness.losses.policy_loss). ``autocast``: the trainer's forward under
    ``torch.autocast`` in that dtype over fp32 weights, as a mixed-precision trainer runs (a
    mismatch source: the rollout does not autocast).

    ``grad_clip``: the largest global gradient norm. An update whose gradient norm is not
    finite (an fp16 overflow, a NaN loss) is never applied: it is skipped (weights and
    optimiser state unchanged), counted in the step's ``update_skipped`` metric and
    reported by a warning. A task reward that is not a finite number stops the run first.
    """

    SECTION: ClassVar[str] = "train"
    advantage: str = spec("grpo", choices=("grpo", "rloo"))
    loss: str = spec("ppo", choices=("ppo", "reinforce"))
    lr: float = spec(2e-4, gt=0)
    weight_decay: float = spec(0.0, ge=0)
    grad_clip: float = spec(1.0, gt=0)  # max global grad norm
    clip_low: float = spec(0.2, ge=0, lt=1)
    clip_high: float = spec(0.28, ge=0)
    dtype: str = spec("float32", choices=DTYPES)
    kernels: str = spec("bik", choices=KERNELS)
    micro_batch_size: int = spec(0, ge=0)  # 0: the whole batch in one forward
    ppo_epochs: int = spec(1, ge=1)
    mini_batches: int = spec(1, ge=1)  # whole prompt groups each: divides rollout.prompts
    loss_agg: str = spec("token_mean", choices=LOSS_AGGS)
    filter_groups: bool = False
    kl_coef: float = spec(0.0, ge=0)
    kl_estimator: str = spec("k3", choices=KL_ESTIMATORS)
    entropy_coef: float = spec(0.0, ge=0)
    autocast: str = spec("none", choices=("none", "bfloat16"))

    def _validate(self) -> None:
        if self.autocast != "none" and self.dtype != "float32":
            raise ConfigError(
                f"train.autocast={self.autocast}: autocast runs over float32 weights; expected "
                f"train.dtype=float32, got {self.dtype}"
            )


@dataclass(frozen=True)
class LRScheduleConfig(Section):
    """The learning-rate schedule (rl_harness.schedule)."""

    SECTION: ClassVar[str] = "lr_schedule"
    name: str = spec("constant", choices=("constant", "length_surge"))
    min_ratio: float = spec(0.1, gt=0, le=1)
    period_factor: float = spec(1.8, gt=0)
    surge_ratio: float = spec(1.5, gt=0)
    surge_window: int = spec(5, ge=1)
    decay_period: int = spec(0, ge=0)  # 0: period_factor x the surge step


@dataclass(frozen=True)
class CollapseConfig(Section):
    """Thresholds of the per-step collapse flags (rl_harness.collapse).

    ``grad_norm_factor``: the blow-up flag (a step above factor x the median of the window
    before it). ``grad_norm_drop_factor``: the drop flag, on the smoothed grad norm (the
    rolling median over ``window`` steps) against its value one window earlier.
    """

    SECTION: ClassVar[str] = "collapse"
    window: int = spec(5, ge=1)
    reward_drop: float = spec(0.5, ge=0, le=1)
    grad_norm_factor: float = spec(10.0, ge=1)
    grad_norm_drop_factor: float = spec(3.0, ge=1)
    grad_norm_floor: float = spec(0.01, ge=0)
    k3_max: float = spec(0.05, ge=0)
    ess_min: float = spec(0.5, ge=0, le=1)
    length_surge: float = spec(2.0, gt=0)


@dataclass(frozen=True)
class EvalConfig(Section):
    """Greedy accuracy of the trained policy (the trainer copy) on a held-out prompt set,
    every ``every`` steps (0: off) and at the last step. The ``prompts`` prompts are drawn
    once, from a stream of their own (the same set for every run seed), never from the
    training prompts' stream (rl_harness.evaluate). ``at_start``: step 0's row also holds an
    evaluation made before its update (the warm-up's policy), unless step 0 evaluates after
    its update anyway."""

    SECTION: ClassVar[str] = "eval"
    every: int = spec(0, ge=0)
    prompts: int = spec(64, ge=1)
    at_start: bool = spec(False)


SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig,
    "task": TaskConfig,
    "warmup": WarmupConfig,
    "rollout": RolloutConfig,
    "train": TrainConfig,
    "remedy": RemedyConfig,
    "lr_schedule": LRScheduleConfig,
    "collapse": CollapseConfig,
    "eval": EvalConfig,
}


@dataclass(frozen=True)
class Config(Section):
    """A whole run. Construct it through :func:`build` or :func:`load`."""

    seed: int = spec(0, ge=0)
    steps: int = spec(200, ge=1)
    checkpoint_every: int = spec(20, ge=1)
    assert_zero_mismatch: bool = True  # a run whose config injects nothing must measure 0
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    remedy: RemedyConfig = field(default_factory=RemedyConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def _validate(self) -> None:
        for name, kind in SECTIONS.items():
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"{name}: expected a {kind.__name__}")
        precision(self.remedy.name, self.train.dtype, self.rollout.dtype)  # fp16's own check
        if self.remedy.bypass and self.remedy.name in IS_REMEDIES and self.train.loss == "ppo":
            # verl refuses it too: with pi_old := pi_rollout the PPO ratio pi_theta / pi_rollout
            # already corrects for the rollout policy; an IS weight would correct twice.
            raise ConfigError(
                f"remedy.bypass=true: the PPO ratio already uses the rollout log-probs as "
                f"pi_old; remedy.name={self.remedy.name} would correct for the rollout policy "
                f"twice (use remedy.bypass=false, or a rejection remedy)"
            )
        if self.rollout.prompts % self.train.mini_batches:
            raise ConfigError(
                f"train.mini_batches: expected a divisor of rollout.prompts "
                f"({self.rollout.prompts}; a mini-batch holds whole prompt groups), "
                f"got {self.train.mini_batches}"
            )
        if self.task.name == "chat_addition" and not self.task.module and not self.model.path:
            raise ConfigError(
                "task.name=chat_addition: its questions are words, which need a model.path "
                "with a tokenizer (e.g. model.path=smollm2 model.chat_template=true)"
            )
        family = FAMILIES[self.model.family]
        refused = family.vllm.startswith("refused") and not self.model.path
        native_moe = self.model.moe and self.rollout.kernels == "native"
        if self.rollout.engine == "vllm" and (native_moe or refused):
            why = VLLM_MOE_REFUSAL if native_moe else f"bik.vllm {family.vllm}"
            raise ConfigError(
                f"rollout.engine=vllm: {why} (model.family={self.model.family}); "
                "use rollout.engine=hf"
            )

    @property
    def precision(self) -> Precision:
        """The dtype each side runs in and the trainer's loss scale (remedies.precision)."""
        return precision(self.remedy.name, self.train.dtype, self.rollout.dtype)

    @property
    def zero_mismatch(self) -> bool:
        """True when nothing in the config makes the rollout differ from the trainer."""
        r, t, p = self.rollout, self.train, self.precision
        return (
            r.kernels == "bik"
            and t.kernels == "bik"
            and p.rollout_dtype == p.train_dtype
            and r.split_size == 0
            and r.logit_noise_std == 0
            and r.logit_noise_bias == 0
            and r.logit_round_bits == 0
            and r.weight_round_bits == 0
            and t.autocast == "none"
        )

    def to_json(self) -> str:
        """The text of config.json."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """Nested plain values, one object per section (the layout of config.json). A key
        added after runs were recorded is written only when set (``model.chat_template``,
        ``rollout.tensor_parallel``; ``warmup.kernels`` when "torch", the warm-up of every run
        before it, as which :func:`load` reads its absence), so the config.json of a run
        without it stays byte for byte what it was."""
        values = dataclasses.asdict(self)
        if not self.model.chat_template:
            del values["model"]["chat_template"]
        if self.rollout.tensor_parallel == 1:
            del values["rollout"]["tensor_parallel"]
        if self.warmup.kernels == "torch":
            del values["warmup"]["kernels"]
        return values

    @property
    def tp_invariant(self) -> bool:
        """True when both sides run bik's TP-invariant order (a TP-sharded vLLM rollout)."""
        return self.rollout.tensor_parallel > 1

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Config:
        """A Config from nested values (config.json); missing keys keep their defaults."""
        return _construct(flatten(values))

    def replace(self, **flat: Any) -> Config:
        """A copy with dotted keys replaced (``replace(**{"rollout.top_k": 8})``), validated."""
        values = flatten(self.to_dict())
        for key, value in flat.items():
            _known(key)
            values[key] = value
        return _construct(values)


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'section.key': value} of nested values."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


DEFAULTS: dict[str, Any] = flatten(dataclasses.asdict(Config()))
"""Every dotted key with its default value."""


def _known(key: str) -> None:
    if key not in DEFAULTS:
        close = difflib.get_close_matches(key, DEFAULTS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown config key {key!r}; {hint}known: {', '.join(sorted(DEFAULTS))}")


def _construct(flat: Mapping[str, Any]) -> Config:
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    top: dict[str, Any] = {}
    for key, value in flat.items():
        _known(key)
        section, _, name = key.rpartition(".")
        (sections[section] if section else top)[name] = value
    try:
        # Config's section fields by name (each of its own type: Any to the type checker)
        built: dict[str, Any] = {name: kind(**sections[name]) for name, kind in SECTIONS.items()}
        return Config(**top, **built)
    except TypeError as error:  # a dataclass refusing an argument: report it as config
        raise ConfigError(str(error)) from None


def build(overrides: Mapping[str, Any] | None = None, sets: Iterable[str] = ()) -> Config:
    """Defaults + a recipe's ``overrides`` ({'section.key': value}) + ``--set key=value``
    strings (later ones win), validated."""
    flat = dict(DEFAULTS)
    for key, value in dict(overrides or {}).items():
        _known(key)
        flat[key] = value
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set: expected key=value, got {item!r}")
        _known(key.strip())
        flat[key.strip()] = value.strip()
    return _construct(flat)


def load(path: str | Path) -> Config:
    """The Config saved at ``path`` (config.json); ConfigError naming the file otherwise."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: not a readable config ({error})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a JSON object of config sections")
    values.pop("world_size", None)  # a run directory's record beside the sections (rundir)
    warmup = values.get("warmup")
    if isinstance(warmup, dict):  # saved before warmup.kernels: plain torch warmed it up
        warmup.setdefault("kernels", "torch")
    try:
        return Config.from_dict(values)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
