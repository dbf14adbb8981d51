"""The baseline of a captured bik decode: an unpatched Hugging Face model decoding greedily
from transformers' own static KV cache, each step captured in a CUDA graph as it is.

bik's :class:`bik.hf.StaticDecoder` replays one CUDA graph per decode step; its fair
baseline is the unpatched model under the same kind of capture (a plain ``torch.cuda.graph``
of the eager step: no Inductor, whose fusions would change the bits against the eager
trainer), not the unpatched model's eager ``generate``, whose host work a graph removes.
:class:`PlainStaticDecode` is that baseline: ``transformers.StaticCache`` (every row writes
its new key at one shared position, its write index a device tensor), a 4-D boolean key mask
that the step extends in place, per-row positions on the device. Nothing in a step reads a
tensor's value on the host (tests/tools/test_bench_plain_static.py checks it on the CPU, where
the step runs eagerly), so the capture is the eager step's own kernels.

Full-attention models only (the Qwen3 and Llama shapes of the GPU probe): a sliding-window
layer's static cache rolls, which the single key mask here does not follow; refused.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hf.cache_keyword import cache_argument
from ..hf.logprobs import generation_position_ids
from ..hf.static_decode import capture_step, decode_loop


def _refuse_windows(config: Any) -> None:
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise NotImplementedError(
            f"PlainStaticDecode: layer types {sorted(layer_types)}; only full-attention "
            "models are decoded here (a sliding window's static cache rolls)"
        )


class PlainStaticDecode:
    """Greedy decode of an unpatched model over ``transformers.StaticCache`` (``max_len``
    positions, prompt included); on CUDA each step is one captured graph, replayed. A later
    prefill of the same batch size reuses the cache and the graph."""

    def __init__(self, model: Any, max_len: int) -> None:
        _refuse_windows(model.config)
        self.model, self.max_len = model, max_len
        self._cache: Any = None
        self._graph: Any = None
        self._logits = torch.empty(0)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the left-padded prompt; returns the logits of each row's next token ``[B, V]``."""
        from transformers import StaticCache

        batch, length = input_ids.shape
        if length >= self.max_len:
            raise ValueError(
                f"input_ids: {length} positions leave no room in max_len {self.max_len}"
            )
        if self._cache is None or self._logits.shape[0] != batch:
            self._cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
            self._graph = None
        else:
            self._cache.reset()  # zeroed in place: a captured step keeps its addresses
        positions = generation_position_ids(attention_mask)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            **cache_argument(self.model, self._cache),
            use_cache=True,
        )
        logits, device = out.logits[:, -1], input_ids.device
        keys = torch.zeros(batch, 1, 1, self.max_len, dtype=torch.bool, device=device)
        keys[:, 0, 0, :length] = attention_mask.bool()
        if self._graph is None:
            self._tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
            self._keys, self._positions, self._logits = keys, positions[:, -1:] + 1, logits.clone()
            self._write_at = torch.tensor([length], device=device)
        else:
            self._keys.copy_(keys)
            self._positions.copy_(positions[:, -1:] + 1)
            self._logits.copy_(logits)
            self._write_at.fill_(length)
        self._written = length
        return self._logits

    def _run_step(self) -> None:
        """One decode step on the buffers: the part a CUDA graph captures."""
        self._keys.index_fill_(3, self._write_at, True)  # the new token's key, every row
        out = self.model(
            input_ids=self._tokens,
            attention_mask=self._keys,  # 4-D: transformers uses it as given
            position_ids=self._positions,
            **cache_argument(self.model, self._cache),
            use_cache=True,
        )
        self._logits.copy_(out.logits[:, -1])
        self._positions += 1
        self._write_at += 1

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row; returns the next logits (a buffer the next step reuses)."""
        if self._written >= self.max_len:
            raise ValueError(
                f"PlainStaticDecode.step: the cache's {self.max_len} positions are full"
            )
        self._tokens.copy_(tokens[:, None])
        self._written += 1
        if self._tokens.device.type != "cuda":
            self._run_step()
        elif self._graph is None:
            self._graph = capture_step(self._run_step)
        else:
            self._graph.replay()
        return self._logits

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill and greedy steps: (the new tokens ``[B, N]``, their logits ``[B, N, V]``)."""
        return decode_loop(self.prefill(input_ids, attention_mask), self.step, max_new_tokens)
