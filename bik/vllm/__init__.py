"""bik inside vLLM: rollouts whose log-probs equal the trainer's, bit for bit.

Two ways to switch it on, both per process (vLLM's engine process inherits it):

* ``from bik.vllm import LLM`` and ``LLM(model_dir, ...)``: a ``vllm.LLM`` with bik enabled
  (``backend=`` picks bik's kernels, ``enforce_eager=True`` by default);
* ``BIK_VLLM=<backend> vllm serve ...`` (or any script that builds a vLLM engine): bik's
  ``vllm.general_plugins`` entry point (:mod:`bik.vllm.plugin`) reads the variable. Unset,
  empty, ``0`` or ``off``: bik stays off; any other value must name an invariant backend
  (auto, cpu, cuda, triton), else the engine stops with an error naming ``BIK_VLLM``.

Only batch-invariant backends run in vLLM: ``reference`` (plain torch) is refused. vLLM loads
only the plugins ``VLLM_PLUGINS`` lists when it is set, so :func:`enable` refuses a
``VLLM_PLUGINS`` without ``bik`` (its engine processes would run vLLM's own numerics); with
the environment variable alone no bik code runs to notice, so set both or neither.

Enabled, bik replaces vLLM's norms, activations and rotary layers through vLLM's custom-op
registry, runs unquantized linear layers and the LM head through ``bik.linear``, the
sampler's log-softmax through ``bik.log_softmax``, attention (sinks, sliding windows and
soft-capping included) through bik's backend in vLLM's attention-backend registry,
mixture-of-experts layers through bik's routing and grouped experts (:mod:`bik.vllm.moe`),
latent attention in the trainer's form (:mod:`bik.vllm.mla`) and the recurrent layers
of the hybrids (:mod:`bik.vllm.gdn`, :mod:`bik.vllm.mamba2`, at TP 1). What bik cannot make
invariant (torch.compile or CUDA graphs, EAGLE draft heads, quantization, TP without
``tp_invariant``, biased experts and recurrent layers above TP 1, PP, LoRA, scaled RoPE
variants other than YaRN...) is refused when the engine starts; docs/vllm.md's family table
says which families run. Then vLLM's log-probs equal
``bik.token_logprobs`` of the bik-patched Hugging Face model loaded from the same directory,
for every batch vLLM forms: continuous batching, chunked prefill, prefix caching, ``n > 1``.

Tensor parallelism runs with ``tp_invariant=True`` only (``BIK_VLLM_TP_INVARIANT=1`` for the
plugin): row-parallel linears (the experts' down projections included) and the
vocab-parallel embedding then follow bik's TP-invariant order (bik.contract), and the
log-probs at every TP degree equal those of the model patched with
``bik.patch_model(model, tp_invariant=True)``; so do expert-parallel engines
(``enable_expert_parallel=True``).
"""

import functools
import os
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from .. import backends, packed_weights

if TYPE_CHECKING:
    import vllm
    from transformers import PreTrainedModel

ENV_VAR = "BIK_VLLM"  # the bik backend to run vLLM with; unset, empty, 0 or off: bik stays off
OFF = ("", "0", "off")  # BIK_VLLM values (any case) that leave bik off
PLUGIN = "bik"  # bik's name in vLLM's general plugins (setup.py), as VLLM_PLUGINS lists it
TP_ENV_VAR = "BIK_VLLM_TP_INVARIANT"  # "1": the TP-invariant order (engine processes read it)
_enabled: str | None = None
_tp_invariant = False


def requested() -> str | None:
    """The backend ``BIK_VLLM`` asks for, or None when it leaves bik off (see the module
    doc); a ValueError naming ``BIK_VLLM`` when it names no invariant backend."""
    value = os.environ.get(ENV_VAR, "")
    name = value.strip().lower()  # any case and spacing, as for the off values
    if name in OFF:
        return None
    try:
        return _invariant_backend(name)
    except ValueError as error:
        raise ValueError(
            f"{ENV_VAR}={value!r}: {error}; unset it (or set {'/'.join(OFF[1:])}) for bik off"
        ) from None


def _invariant_backend(backend: str) -> str:
    """``backend`` if it is "auto" or a batch-invariant backend (a vLLM engine exists to
    give the trainer's bits: a non-invariant one cannot), else a ValueError."""
    name = backends.check_name(backend)
    if name == "auto":
        return name
    try:
        invariant = backends.load(name).invariant
    except ImportError:  # not built here: its first kernel call says how to build it
        return name
    if not invariant:
        raise ValueError(
            f"backend: {name!r} is not batch-invariant, so vLLM's log-probs would not equal "
            "the trainer's; bik.vllm runs the invariant backends only (auto, cpu, cuda, triton)"
        )
    return name


def _check_plugins() -> None:
    """vLLM loads only the plugins VLLM_PLUGINS lists (when set): without bik's, the engine
    processes it starts would run vLLM's numerics while this one believes bik is on."""
    listed = os.environ.get("VLLM_PLUGINS")
    if listed is not None and PLUGIN not in [name.strip() for name in listed.split(",")]:
        raise ValueError(
            f"VLLM_PLUGINS={listed!r} does not list bik's plugin {PLUGIN!r}: vLLM's engine "
            f"processes would not load bik and would run vLLM's own numerics; add {PLUGIN} to "
            "VLLM_PLUGINS or unset it"
        )


def check(backend: str = "auto") -> str:
    """What :func:`enable` refuses, checked without enabling anything: ``backend`` when it
    is batch-invariant and VLLM_PLUGINS lets vLLM load bik, else a ValueError."""
    backend = _invariant_backend(backend)
    _check_plugins()
    return backend


def requested_tp_invariant() -> bool:
    """Whether ``BIK_VLLM_TP_INVARIANT`` asks for the TP-invariant order ("1"; unset or "0":
    not); a ValueError naming it for any other value."""
    value = os.environ.get(TP_ENV_VAR, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{TP_ENV_VAR}={value!r}: expected 1 (on) or 0 (off)")
    return value == "1"


def enable(backend: str = "auto", *, tp_invariant: bool = False) -> None:
    """Route vLLM's numerics through bik in this process (see the module doc). Idempotent;
    a second call may change the kernel backend and ``tp_invariant`` (for engines built
    afterwards). ValueError for a backend that is not batch-invariant, or a VLLM_PLUGINS that
    leaves bik's plugin out."""
    global _enabled, _tp_invariant
    if not isinstance(tp_invariant, bool):
        raise TypeError(f"tp_invariant: expected a bool, got {tp_invariant!r}")
    backend = check(backend)
    backends.set_backend(backend)
    os.environ[ENV_VAR] = backend  # engine processes vLLM spawns enable bik too
    os.environ[TP_ENV_VAR] = str(int(tp_invariant))
    if _enabled is None:
        _install()
    from . import layers

    layers.use_tp_invariant(tp_invariant)
    _enabled, _tp_invariant = backend, tp_invariant


def enabled() -> str | None:
    """The bik backend vLLM runs with in this process, or None when bik is off."""
    return _enabled


def tp_invariant() -> bool:
    """Whether vLLM runs bik's TP-invariant order in this process."""
    return _tp_invariant


def LLM(
    model: str, *, backend: str = "auto", tp_invariant: bool = False, **kwargs: Any
) -> "vllm.LLM":
    """``vllm.LLM(model, **kwargs)`` with bik enabled (``enforce_eager`` defaults to True).

    tp_invariant: the TP-invariant order (see the module doc), required for
    ``tensor_parallel_size`` > 1; ``disable_custom_all_reduce`` then defaults to True."""
    import vllm
    from transformers import AutoConfig

    from .config import EngineSettings, check_hf_config, check_settings, check_tensor_parallel

    tensor_parallel = kwargs.get("tensor_parallel_size", 1)
    check_tensor_parallel(tensor_parallel, tp_invariant)
    trust = kwargs.get("trust_remote_code", False)
    check_hf_config(AutoConfig.from_pretrained(model, trust_remote_code=trust), tensor_parallel)
    kwargs.setdefault("enforce_eager", True)
    # recurrent layers' states in fp32, as the trainer keeps them (bik.vllm.gdn)
    kwargs.setdefault("mamba_ssm_cache_dtype", "float32")
    if tp_invariant:
        kwargs.setdefault("disable_custom_all_reduce", True)
    enable(backend, tp_invariant=tp_invariant)
    # before vLLM builds anything: some settings fail inside it in its own words first
    check_settings(EngineSettings.of_arguments(kwargs))
    return vllm.LLM(model=model, **kwargs)


def _install() -> None:
    from vllm.model_executor.model_loader import base_loader
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from . import layers, sampler, speculative
    from .config import check_model

    layers.install()
    sampler.install()
    speculative.install()
    path = "bik.vllm.attention.BikAttentionBackend"
    # The CPU platform always picks CPU_ATTN: bik takes that slot; GPU platforms take it
    # through CUSTOM (attention_config={"backend": "CUSTOM"}) or the slots overridden here.
    for slot in ("CUSTOM", "CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"):
        register_backend(getattr(AttentionBackendEnum, slot), path)
    # MLA models: the CPU platform picks CPU_MLA, or AMX_MLA where the CPU has AMX
    for slot in ("CPU_MLA", "AMX_MLA"):
        register_backend(getattr(AttentionBackendEnum, slot), "bik.vllm.mla.BikMLABackend")
    process = base_loader.process_weights_after_loading

    def process_then_check(model, model_config, *args, **kwargs):
        process(model, model_config, *args, **kwargs)
        layers.patch_transformers_modules(model, model_config.hf_text_config.model_type)
        check_model(model, model_config.hf_text_config)
        _pack_weights(model)

    base_loader.process_weights_after_loading = process_then_check


def _pack_weights(model: Any) -> None:
    """Keep the model's CPU linear weights packed once (``bik.pack_weights``: the same bits).
    vLLM's loaders write weights through ``.data``, which no version counter sees, so every
    ``load_weights`` (each weight update of a running engine) marks the packed copies stale."""
    packed_weights.pack_weights(model)
    if getattr(model.load_weights, "_bik_marks_stale", False):
        return
    load = model.load_weights

    def load_then_mark_stale(*args, **kwargs):
        try:
            return load(*args, **kwargs)
        finally:
            packed_weights.weights_changed()

    load_then_mark_stale._bik_marks_stale = True  # type: ignore[attr-defined]
    model.load_weights = load_then_mark_stale


def update_weights(llm: "vllm.LLM", named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write new policy weights (``(name, tensor)`` pairs with Hugging Face names, e.g.
    ``model.named_parameters()``, plus persistent buffers such as DeepSeek-V3 and GLM-4.5's
    fp32 ``e_score_correction_bias``) into a running engine, then drop its prefix cache,
    whose KV blocks were computed with the old weights. Every pair is checked against the
    engine's model first (a TypeError or ValueError naming it): a bad one leaves every weight
    as it was, as does an error inside vLLM's loaders (the worker restores what they wrote).
    A tensor the model keeps wider than it arrives (an fp32 router bias sent in
    bf16) is refused: the trainer routes with bits the engine would not have."""
    weights = list(named_tensors)
    _check_weights(weights, _state_entries(llm))
    weights = _checkpoint_layout(llm, [(name, tensor.detach()) for name, tensor in weights])
    # A module-level function, not a closure: under TP > 1 it is pickled to every worker.
    llm.apply_model(functools.partial(_load_weights, weights=weights))
    llm.reset_prefix_cache()


def _load_weights(model: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """In each engine worker: vLLM's loaders take the full weights and keep the rank's shard.
    All or nothing: a loader that fails part-way (after writing earlier entries) gets every
    parameter and buffer restored from a copy taken first (one copy of the rank's weights
    while the update runs)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    saved = [(tensor, tensor.detach().clone()) for tensor in tensors]
    try:
        model.load_weights(iter(weights))
    except BaseException:
        with torch.no_grad():
            for tensor, old in saved:
                tensor.copy_(old)
        raise


_META_MODELS: weakref.WeakKeyDictionary[Any, "PreTrainedModel"] = weakref.WeakKeyDictionary()


def _meta_model(llm: Any) -> "PreTrainedModel":
    """The Hugging Face model of ``llm``'s config on the meta device, in the engine's dtype:
    no memory, no weights read."""
    if llm not in _META_MODELS:
        from transformers import AutoModelForCausalLM

        model_config = llm.llm_engine.model_config
        with torch.device("meta"):
            _META_MODELS[llm] = AutoModelForCausalLM.from_config(
                model_config.hf_config, dtype=model_config.dtype
            )
    return _META_MODELS[llm]


def _state_entries(llm: Any) -> dict[str, torch.Tensor]:
    """The Hugging Face state-dict entries of ``llm``'s model (parameters, tied ones included,
    and persistent buffers) as meta tensors: each one's shape and the dtype the model keeps
    it in."""
    return _meta_model(llm).state_dict(keep_vars=True)


def _checkpoint_layout(
    llm: Any, weights: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """``weights`` (a model's state dict) as its checkpoint stores them, the layout vLLM's
    loaders read: transformers keeps some weights renamed or fused in memory (a MoE's experts
    as one ``[E, ...]`` tensor, which DeepSeek-V3's vLLM loader does not take) and
    ``save_pretrained`` reverts that; the same reversion, on the exact tensors."""
    from transformers.core_model_loading import revert_weight_conversion

    return list(revert_weight_conversion(_meta_model(llm), dict(weights)).items())


def _check_weights(weights: list[Any], entries: dict[str, torch.Tensor]) -> None:
    for i, pair in enumerate(weights):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(f"named_tensors[{i}]: expected a (name, tensor) pair, got {pair!r}")
        name, tensor = pair
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if name not in entries:
            raise ValueError(
                f"{name}: not a parameter of the engine's model (expected Hugging Face names, "
                f"such as {next(iter(entries), '?')!r})"
            )
        expected = entries[name]
        if tuple(tensor.shape) != tuple(expected.shape):
            raise ValueError(
                f"{name}: expected shape {tuple(expected.shape)}, got {tuple(tensor.shape)}; "
                "no weight was written"
            )
        if expected.is_floating_point() and not tensor.is_floating_point():
            raise ValueError(
                f"{name}: expected a floating tensor ({expected.dtype}), got {tensor.dtype}; "
                "no weight was written"
            )
        if _narrower(tensor.dtype, expected.dtype):
            raise ValueError(
                f"{name}: expected {expected.dtype} (the model keeps it so: a {tensor.dtype} "
                f"copy has lost bits the trainer still uses), got {tensor.dtype}; no weight was "
                "written"
            )


def _narrower(dtype: torch.dtype, kept: torch.dtype) -> bool:
    """Whether floating ``dtype`` holds fewer bits than the floating ``kept``."""
    floating = dtype.is_floating_point and kept.is_floating_point
    return floating and torch.finfo(dtype).bits < torch.finfo(kept).bits
