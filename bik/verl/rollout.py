"""verl's rollout through bik: a replica whose server decodes with the patched model.

verl's agent loop sends each prompt to a rollout server (``generate(request_id, prompt_ids,
sampling_params) -> TokenOutput``) and the trainer's workers push new weights to it through a
``ServerAdapter`` in their own process (``update_weights``). Here the server is a Ray actor
holding a ``bik.patch_model``-ed copy of the policy in the rollout dtype; it decodes one token
at a time with a KV cache and returns, for each sampled token, the trainer's log-prob formula
(:func:`bik.verl.engine.logprobs_of`) of the logits divided by the temperature exactly as
verl's trainer divides them. bik's prefill == decode contract makes those the bits the
trainer's full-sequence forward computes, so verl's rollout-correction metrics read 0 and the
rollout's log-probs can stand for pi_old (``algorithm.rollout_correction.bypass_mode=true``).

Sampling settings the trainer does not mirror (top-p, top-k, a repetition penalty) would make
the sampled distribution differ from the scored one: they are refused when the adapter is
built, naming the setting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import ray
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig, PreTrainedModel
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

from ..hf.patch import patch_model
from . import engine
from .checks import check_sampling, dtype
from .settings import ROLLOUT_NAME, native


def scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits divided by the temperature by verl's trainer's own function (a float32
    temperature, clamped and cast to the logits' dtype; 1 leaves them as they are)."""
    divisor = torch.tensor(temperature, dtype=torch.float32)
    return transformer_impl._scale_logits_by_temperature(
        logits, divisor, is_unit_temperature=temperature == 1.0
    )


def server_name(replica_rank: int) -> str:
    return f"bik_rollout_server_{replica_rank}"


class BikServer:
    """One replica's rollout server: the patched policy, decoding a request at a time."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int) -> None:
        self.config = config
        model_config = omega_conf_to_dataclass(model_config)  # HFModelConfig: the local copy
        path = model_config.local_path
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype("rollout.dtype", config.dtype)
        )
        self.model.eval()
        if not native():
            patch_model(self.model)
        self.stop_ids = _stop_ids(path, model_config)
        self.lock = asyncio.Lock()  # one request decodes at a time: the cores are shared
        self.global_steps: int | None = 0  # the step whose weights it holds (verl's tag)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        if image_data or video_data:
            raise ValueError(
                "image_data / video_data: bik's rollout server takes text prompts only"
            )
        params = dict(sampling_params)
        check_sampling(
            params.get("top_p", 1.0), params.get("top_k", -1), params.get("repetition_penalty", 1.0)
        )
        limit = (
            params.get("max_tokens") or params.get("max_new_tokens") or self._room(len(prompt_ids))
        )
        async with self.lock:
            tokens, logprobs = _decode(
                self.model,
                prompt_ids,
                float(params.get("temperature", 1.0)),
                int(limit),
                self.stop_ids,
            )
        return TokenOutput(
            token_ids=tokens,
            log_probs=logprobs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def _room(self, prompt_length: int) -> int:
        total = self.config.prompt_length + self.config.response_length
        return min(self.config.response_length, total - prompt_length)

    async def load_weights(
        self, weights: dict[str, torch.Tensor], global_steps: int | None
    ) -> None:
        """The trainer's weights at ``global_steps``, full tensors by their Hugging Face names
        (a tied weight may come under both of its names: the state dict has both)."""
        params = self.model.state_dict(keep_vars=True)
        missing = [name for name in weights if name not in params]
        if missing:
            raise KeyError(f"weights: names the rollout model does not have: {missing[:5]}")
        async with self.lock:
            with torch.no_grad():
                for name, tensor in weights.items():
                    params[name].copy_(tensor)
            self.global_steps = global_steps

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # verl's memory and scheduling hooks: a CPU server keeps its weights and cache in place,
    # and decodes each request to its end, so there is nothing to free, abort or resume.
    async def wake_up(self) -> None: ...
    async def sleep(self) -> None: ...
    async def clear_kv_cache(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def resume_generation(self) -> None: ...
    async def start_profile(self, **kwargs: Any) -> None: ...
    async def stop_profile(self) -> None: ...

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}


def _stop_ids(path: str, model_config: Any) -> set[int]:
    """EOS ids from the generation config, else the tokenizer's."""
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = model_config.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


@torch.no_grad()
def _decode(
    model: PreTrainedModel,
    prompt_ids: list[int],
    temperature: float,
    limit: int,
    stop_ids: Iterable[int],
) -> tuple[list[int], list[float]]:
    """Sample up to ``limit`` tokens; each one's log-prob as the trainer computes it.

    temperature 0 is greedy (verl's validation), its log-probs those of the unscaled logits.
    """
    stop = set(stop_ids)
    cache = DynamicCache(config=model.config)
    inputs = torch.tensor([prompt_ids])
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(limit):
        logits = model(input_ids=inputs, past_key_values=cache, use_cache=True).logits[0, -1]
        scaled = scale(logits, temperature if temperature > 0 else 1.0)
        if temperature > 0:
            probs = torch.softmax(scaled.float(), dim=-1)
            token = torch.multinomial(probs, 1)[0]
        else:
            token = scaled.argmax()
        tokens.append(int(token))
        logprobs.append(float(engine.logprobs_of(scaled[None], token[None])[0]))
        if int(token) in stop:
            break
        inputs = token.view(1, 1)
    return tokens, logprobs


class BikReplica(RolloutReplica):
    """A replica served by one :class:`BikServer` actor (any rollout mode)."""

    async def launch_servers(self) -> None:
        server = (
            ray.remote(BikServer)
            .options(
                name=server_name(self.replica_rank),
                num_cpus=0,
                max_concurrency=self.max_concurrency,
            )
            .remote(self.config, self.model_config, self.replica_rank)
        )
        self.servers = [server]
        self._server_handle = server
        self._server_address = server_name(self.replica_rank)

    def rollout_worker_use_gpu(self) -> bool:
        return False


class ServerAdapter(BaseRollout):
    """In each trainer worker: checks the sampling settings, and hands the replica's server
    the trainer's weights (the first rank of the replica sends them)."""

    def __init__(
        self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        check_sampling(self.config.top_p, self.config.top_k)
        rank = torch.distributed.get_rank()
        size = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        size *= self.config.pipeline_model_parallel_size
        self.replica_rank, self.leader = rank // size, rank % size == 0

    async def update_weights(
        self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        if wire_format != "named_tensors":
            raise ValueError(
                f"wire_format: bik's rollout takes 'named_tensors', got {wire_format!r}"
            )
        # Every rank walks the generator: each full tensor is gathered by all of them.
        full = {name: tensor.detach().clone() for name, tensor in weights}
        if self.leader:
            server = ray.get_actor(server_name(self.replica_rank))
            await server.load_weights.remote(full, kwargs.get("global_steps"))

    async def resume(self, tags: list[str]) -> None: ...

    async def release(self) -> None: ...


def register() -> None:
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.ServerAdapter"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: BikReplica)
