"""Decode a patched model from a static KV cache with nothing read back to the host, so that a
decode step can be captured once in a CUDA graph and replayed (:class:`StaticDecoder`).

The prompt is prefilled eagerly through the patched model (a DynamicCache; the mask checked as
``generate``'s is). Each row's keys and values are then copied to the start of that row's own
page of a static cache ``[B, Hkv, max_len, D]`` (its left padding dropped). A decode step
writes each row's new key and value at that row's length and runs bik's paged attention over
the page, the lengths a device tensor. Paged attention counts key blocks and splits from each
sequence's first key, as bik.attention counts them from ``kv_start``: a step gives the bits of
the eager patched decode and of the trainer's one full forward.

Nothing in a step reads a tensor's value on the host (tests/integrations/
test_hf_static_decode.py runs a step under a detector of such reads), and every shape in it is
fixed by the batch and ``max_len``; the host integers it keeps (each row's length) only check
capacity and answer transformers' bookkeeping, and are never fed to a kernel. Families whose
layers keep a recurrent state (linear attention, Mamba) have no static cache here: refused.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch

from .. import backends
from ..families import MOE_FAMILIES
from ..ops._dispatch import needs_custom_op
from ..ops.attention import fp32_sinks, validate_options
from .cache_keyword import cache_argument
from .forwards import fusable_linear
from .fused_projections import fused, projection_groups

STEP_TAG = "_bik_static_step"  # set on a static cache's key pages: the step they belong to
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})


class DecodeStep:
    """What every layer of a decode step shares, on the device: where each row's new token
    goes (``positions``, int64 ``[B]``) and what paged attention reads (``seq_lens``: keys per
    row, the new one included; ``block_table``: row b's keys are page b; ``query_start``:
    one query per row). :meth:`advance` moves them on in place, so a captured graph replays
    the next step."""

    def __init__(self, lengths: torch.Tensor) -> None:
        batch, device = lengths.shape[0], lengths.device
        self.rows = torch.arange(batch, device=device)
        self.positions = lengths.to(torch.int64).clone()
        self.seq_lens = (self.positions + 1).to(torch.int32)
        self.block_table = self.rows.to(torch.int32)[:, None].contiguous()
        self.query_start = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.longest = 0  # host: the longest row before the step (transformers' bookkeeping)

    def advance(self) -> None:
        self.positions.add_(1)
        self.seq_lens.add_(1)

    def reset(self, lengths: torch.Tensor) -> None:
        """A new prefill's lengths, written in place (a captured graph keeps reading these)."""
        self.positions.copy_(lengths)
        self.seq_lens.copy_(lengths + 1)


_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("bik_static_step", default=False)


def static_step_running() -> bool:
    """Whether a :class:`StaticDecoder` step is running: then attention over keys that are not
    a static cache's pages (a model that transforms its cached tensors before attention) is
    refused, never run over every key of the page, the unwritten ones included."""
    return _RUNNING.get()


def _cache_classes() -> tuple[type, type]:
    """The transformers cache classes, built on first use (transformers is optional)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class RowPagesLayer(CacheLayerMixin):
        """One layer's static cache: row b's keys and values from index 0 of page b."""

        is_sliding = False

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, step: DecodeStep) -> None:
            super().__init__()
            self.pages = keys, values
            self.keys, self.values = self.pages
            self.step = step
            self.is_initialized = True
            setattr(keys, STEP_TAG, step)

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor):
            raise RuntimeError("a static cache layer is allocated at prefill")

        def update(self, key_states, value_states, *args, **kwargs):
            if key_states.shape[2] != 1:
                raise ValueError(
                    f"bik static cache: a decode step feeds one token per row, got "
                    f"{key_states.shape[2]} (prefill goes through StaticDecoder.prefill)"
                )
            step, (keys, values) = self.step, self.pages
            keys[step.rows, :, step.positions] = key_states[:, :, 0]
            values[step.rows, :, step.positions] = value_states[:, :, 0]
            return keys, values

        def get_seq_length(self) -> int:
            return self.step.longest

        def get_max_length(self) -> int:
            return self.pages[0].shape[2]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.pages[0].shape[2], 0

    class RowPagesCache(Cache):
        """The static cache of a :class:`StaticDecoder`: one :class:`RowPagesLayer` a layer."""

        def __init__(self, layers: list[Any]) -> None:
            super().__init__(layers=layers)

    return RowPagesLayer, RowPagesCache


def static_step_of(key: torch.Tensor) -> DecodeStep | None:
    """The decode step a static cache's key pages belong to, or None (any other cache)."""
    return getattr(key, STEP_TAG, None)


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    step: DecodeStep,
    scale: float | None,
    split_size: int | None,
    softcap: float | None,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q ``[B, Hq, 1, D]`` over a static cache's pages ``[B, Hkv, max_len, D]`` ->
    ``[B, Hq, 1, D]``: paged attention with the lengths read on the device only. A window
    that hides no key gives the bits of none (the kernels skip nothing then), so the window
    is passed whether or not a row has outgrown it."""
    if query.shape[2] != 1:
        raise ValueError(f"query: a decode step has one token per row, got {query.shape[2]}")
    if needs_custom_op((query, key, value, sinks)):
        raise RuntimeError(
            "bik static decode: runs eagerly or under CUDA-graph capture, under torch.no_grad "
            "(not traced, not compiled, not differentiated); the trainer's forward is "
            "bik.sequence_logprobs"
        )
    backend = backends.resolve(query.device, "attention")
    if backend.paged_attention is None:
        raise NotImplementedError(
            f"bik static decode: the {backend.name} backend has no paged attention kernel; "
            "select one that has (python -m bik backends lists them)"
        )
    packed = query[:, :, 0]
    options = validate_options(packed, True, scale, split_size, softcap, window, sinks)
    kernel = backend.attention_kernel(sinks, "paged_attention")
    paging = (step.block_table, step.query_start, step.seq_lens)
    out = kernel(packed, key, value, *paging, options, fp32_sinks(sinks))
    return out[:, :, None]


def _attention_layers(model: torch.nn.Module) -> None:
    """Refuse models with a layer whose cache a static key/value page cannot hold."""
    if not hasattr(model, "_bik_patch"):
        raise ValueError("model: expected a model patched by bik.patch_model")
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not kinds <= _ATTENTION_LAYERS:
        raise NotImplementedError(
            f"bik static decode: the model has {sorted(kinds - _ATTENTION_LAYERS)} layers, whose "
            "cache keeps a recurrent state; only attention layers have a static cache here "
            "(decode it with model.generate)"
        )


def _grouped_backend(name: str, device: torch.device) -> backends.Backend:
    """The backend a model patched with backend ``name`` runs bik.grouped_linear on."""
    if name == "auto":
        return backends.resolve(device, "matmul")
    with backends.use_backend(name):
        return backends.resolve(device, "matmul")


def capture_step(run_step: Callable[[], None]) -> Any:
    """Run a decode step once eagerly on a side stream (compiles, launch plans and self-checks
    happen there, never inside the capture), then record it in a CUDA graph: recording runs
    nothing, so the decode's state is one step on, as after an eager step. Returns the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_step()
    return graph


class StaticDecoder:
    """A decode loop over a static KV cache for a model patched by ``bik.patch_model``;
    on a CUDA device each step is one captured CUDA graph, replayed.

    ``prefill(input_ids, attention_mask)`` runs the prompt (left padding) eagerly and returns
    the logits of each row's next token ``[B, V]``; ``step(tokens [B])`` feeds one token per
    row and returns the next logits (a buffer the next step overwrites: copy what you keep);
    ``generate`` is a whole loop. Every logit equals the eager patched decode's and the
    trainer's full forward's (``bik.sequence_logprobs``) bit for bit. ``max_len``: the longest
    row the cache holds, prompt included. ``graph``: capture the step (default: on CUDA); the
    first step runs eagerly (compiling the kernels, filling bik's launch plans) before the
    capture, so nothing is compiled or checked inside it. A later prefill of the same batch
    size refills the same buffers, so the captured step serves every batch of a rollout.
    ``fuse_projections``: each step runs a layer's q/k/v and gate/up projections as one
    linear each (bik.hf.fused_projections: the same bits, fewer and wider launches; costs a
    copy of those weights, refreshed whenever a parameter changes).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        max_len: int,
        graph: bool | None = None,
        fuse_projections: bool = False,
    ) -> None:
        _attention_layers(model)
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len: expected a positive int, got {max_len!r}")
        if not isinstance(fuse_projections, bool):
            raise TypeError(f"fuse_projections: expected a bool, got {fuse_projections!r}")
        self._groups = projection_groups(model, fusable_linear) if fuse_projections else {}
        self._distinct_groups = list(dict.fromkeys(self._groups.values()))  # refreshed a step
        self.model, self.max_len = model, max_len
        self.graph_requested = graph
        self._cache: Any = None
        self._step: DecodeStep | None = None
        self._graph: Any = None
        self._lengths: list[int] = []  # host: each row's tokens (prompt + fed), for capacity

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the left-padded prompt; returns the logits of each row's next token."""
        from transformers import DynamicCache

        from .logprobs import generation_position_ids

        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"input_ids, attention_mask: expected two [B, T] tensors of one shape, got "
                f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
            )
        lengths = attention_mask.sum(1)
        self._lengths = [int(n) for n in lengths.tolist()]  # eager: prefill may read the host
        if max(self._lengths) > self.max_len:
            raise ValueError(
                f"input_ids: a prompt of {max(self._lengths)} tokens exceeds max_len {self.max_len}"
            )
        dynamic: Any = DynamicCache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=generation_position_ids(attention_mask),
            **cache_argument(self.model, dynamic),
            use_cache=True,
        )
        logits = out.logits[:, -1]
        if self._fits(dynamic, logits):  # same shapes: refill the buffers, keep the graph
            assert self._step is not None
            self._step.reset(lengths)
            self._logits.copy_(logits)
        else:
            self._allocate(dynamic, lengths, logits)
        for layer, source in zip(self._cache.layers, dynamic.layers):
            keys, values = layer.pages
            for row, length in enumerate(self._lengths):  # pages past a row's length unread
                keys[row, :, :length] = source.keys[row, :, input_ids.shape[1] - length :]
                values[row, :, :length] = source.values[row, :, input_ids.shape[1] - length :]
        return self._logits

    def _fits(self, dynamic: Any, logits: torch.Tensor) -> bool:
        """Whether the buffers of the last prefill hold this one (same batch, layers, heads,
        dtype and device): then a captured step still reads and writes the right memory."""
        if self._cache is None or self._logits.shape != logits.shape:
            return False
        pages = [layer.pages[0] for layer in self._cache.layers]
        return len(pages) == len(dynamic.layers) and all(
            (page.shape[:2], page.shape[3], page.dtype, page.device)
            == (source.keys.shape[:2], source.keys.shape[3], source.keys.dtype, source.keys.device)
            for page, source in zip(pages, dynamic.layers)
        )

    def _allocate(self, dynamic: Any, lengths: torch.Tensor, logits: torch.Tensor) -> None:
        """Fresh ``[B, Hkv, max_len, D]`` pages for each layer of ``dynamic``, the step's
        device tensors and the step's input and output buffers; any captured graph is dropped."""
        layer_class, cache_class = _cache_classes()
        self._step, self._graph = DecodeStep(lengths), None
        layers = []
        for layer in dynamic.layers:
            keys, values = layer.keys, layer.values
            if keys.shape != values.shape:
                raise NotImplementedError(
                    f"bik static decode: the cache holds keys {tuple(keys.shape)} and values "
                    f"{tuple(values.shape)} of other shapes (a latent cache, as DeepSeek-V3's, "
                    "expanded at every step), which paged attention cannot read; decode this "
                    "model with model.generate"
                )
            shape = (*keys.shape[:2], self.max_len, keys.shape[3])
            layers.append(layer_class(keys.new_zeros(shape), values.new_zeros(shape), self._step))
        self._cache = cache_class(layers)
        batch, device = logits.shape[0], logits.device
        self._tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self._mask = torch.ones(batch, 1, 1, self.max_len, dtype=torch.bool, device=device)
        self._logits = logits.clone()

    def _run_step(self) -> None:
        """One decode step on the buffers: the part a CUDA graph captures."""
        assert self._step is not None
        running = _RUNNING.set(True)
        try:
            with fused(self._groups):
                out = self.model(
                    input_ids=self._tokens,
                    attention_mask=self._mask,  # 4-D: transformers builds none; pages need none
                    position_ids=self._step.positions[:, None],
                    **cache_argument(self.model, self._cache),
                    use_cache=True,
                )
        finally:
            _RUNNING.reset(running)
        self._logits.copy_(out.logits[:, -1])
        self._step.advance()

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``[B]``); returns the logits of the next ``[B, V]``."""
        if self._step is None:
            raise RuntimeError("StaticDecoder.step: call prefill first")
        if tokens.shape != (len(self._lengths),):
            raise ValueError(
                f"tokens: expected shape ({len(self._lengths)},), one per row, got "
                f"{tuple(tokens.shape)}"
            )
        if max(self._lengths) >= self.max_len:
            raise ValueError(
                f"StaticDecoder.step: a row would exceed max_len {self.max_len} tokens"
            )
        self._tokens.copy_(tokens[:, None])
        self._step.longest = max(self._lengths)
        self._lengths = [n + 1 for n in self._lengths]
        for group in self._distinct_groups:
            group.refresh()
        if self._graph is not None:  # checked when captured: nothing to decide per step
            self._graph.replay()
        elif self._use_graph():
            self._graph = capture_step(self._run_step)
        else:
            self._run_step()
        return self._logits

    def _use_graph(self) -> bool:
        on_cuda = self._tokens.device.type == "cuda"
        graph = on_cuda if self.graph_requested is None else self.graph_requested
        patch: Any = self.model._bik_patch
        if graph and patch.family in MOE_FAMILIES:
            experts = _grouped_backend(patch.backend, self._tokens.device)
            if experts.grouped_matmul is None:
                raise NotImplementedError(
                    f"bik static decode: a {patch.family} model's experts run on the "
                    f"{experts.name} backend, which reads their token counts on the host (one "
                    "matmul per expert in bik.grouped_linear) where a CUDA graph cannot; patch "
                    "with the triton backend (a grouped kernel reading them on the device) or "
                    "pass graph=False to run the steps eagerly (the same bits)"
                )
        if graph and not on_cuda:
            raise ValueError("graph=True: CUDA graphs need the model on a CUDA device")
        return graph

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill, then ``max_new_tokens`` steps; ``choose(logits [B, V]) -> tokens [B]``
        picks each token (default: greedy). Returns (the new tokens ``[B, N]``, the logits
        each was chosen from ``[B, N, V]``)."""
        logits = self.prefill(input_ids, attention_mask)
        return decode_loop(logits, self.step, max_new_tokens, choose)


def decode_loop(
    logits: torch.Tensor,
    step: Callable[[torch.Tensor], torch.Tensor],
    max_new_tokens: int,
    choose: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``max_new_tokens`` tokens from a prefill's ``logits`` [B, V]: ``choose`` picks each
    (default: greedy) and ``step`` feeds it and returns the next logits (a buffer it may
    reuse, so each is copied). Returns (the tokens ``[B, N]``, their logits ``[B, N, V]``)."""
    choose = choose or (lambda scores: scores.argmax(-1))
    tokens, kept = [], []
    for index in range(max_new_tokens):
        kept.append(logits.clone())
        tokens.append(choose(logits))
        if index + 1 < max_new_tokens:
            logits = step(tokens[-1])
    return torch.stack(tokens, 1), torch.stack(kept, 1)
