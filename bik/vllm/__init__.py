"""bik inside vLLM: rollouts whose log-probs equal the trainer's, bit for bit.

Two ways to switch it on, both per process (vLLM's engine process inherits it):

* ``from bik.vllm import LLM`` and ``LLM(model_dir, ...)``: a ``vllm.LLM`` with bik enabled
  (``backend=`` picks bik's kernels, ``enforce_eager=True`` by default);
* ``BIK_VLLM=<backend> vllm serve ...`` (or any script that builds a vLLM engine): bik's
  ``vllm.general_plugins`` entry point (:mod:`bik.vllm.plugin`) reads the variable.

Enabled, bik replaces vLLM's RMSNorm, SiLU-and-multiply and rotary layers through vLLM's
custom-op registry, runs unquantized linear layers and the LM head through ``bik.linear``,
the sampler's log-softmax through ``bik.log_softmax`` and attention through bik's backend in
vLLM's attention-backend registry. What bik cannot make invariant (torch.compile or CUDA
graphs, speculative decoding, quantization, TP/PP, LoRA, sliding windows, scaled RoPE
variants...) is refused when the engine starts. Then vLLM's log-probs equal
``bik.token_logprobs`` of the bik-patched Hugging Face model loaded from the same directory,
for every batch vLLM forms: continuous batching, chunked prefill, prefix caching, ``n > 1``.
"""

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from .. import backends

if TYPE_CHECKING:
    import vllm

ENV_VAR = "BIK_VLLM"  # the bik backend to run vLLM with; unset or empty: bik stays off
_enabled: str | None = None


def enable(backend: str = "auto") -> None:
    """Route vLLM's numerics through bik in this process (see the module doc). Idempotent;
    a second call may only change the kernel backend."""
    global _enabled
    backends.set_backend(backend)
    os.environ[ENV_VAR] = backend  # engine processes vLLM spawns enable bik too
    if _enabled is None:
        _install()
    _enabled = backend


def enabled() -> str | None:
    """The bik backend vLLM runs with in this process, or None when bik is off."""
    return _enabled


def LLM(model: str, *, backend: str = "auto", **kwargs: Any) -> "vllm.LLM":
    """``vllm.LLM(model, **kwargs)`` with bik enabled (``enforce_eager`` defaults to True)."""
    import vllm
    from transformers import AutoConfig

    from .config import check_hf_config

    trust = kwargs.get("trust_remote_code", False)
    check_hf_config(AutoConfig.from_pretrained(model, trust_remote_code=trust))
    enable(backend)
    kwargs.setdefault("enforce_eager", True)
    return vllm.LLM(model=model, **kwargs)


def _install() -> None:
    from vllm.model_executor.model_loader import base_loader
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from . import layers, sampler
    from .config import check_model

    layers.install()
    sampler.install()
    path = "bik.vllm.attention.BikAttentionBackend"
    # The CPU platform always picks CPU_ATTN: bik takes that slot; GPU platforms take it
    # through CUSTOM (attention_config={"backend": "CUSTOM"}) or the slots overridden here.
    for slot in ("CUSTOM", "CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"):
        register_backend(getattr(AttentionBackendEnum, slot), path)
    process = base_loader.process_weights_after_loading

    def process_then_check(model, *args, **kwargs):
        process(model, *args, **kwargs)
        check_model(model)

    base_loader.process_weights_after_loading = process_then_check


def update_weights(llm: "vllm.LLM", named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write new policy weights (``(name, tensor)`` pairs with Hugging Face parameter names,
    e.g. ``model.named_parameters()``) into a running engine, then drop its prefix cache,
    whose KV blocks were computed with the old weights."""
    weights = [(name, tensor.detach()) for name, tensor in named_tensors]
    llm.apply_model(lambda model: model.load_weights(iter(weights)))
    llm.reset_prefix_cache()
