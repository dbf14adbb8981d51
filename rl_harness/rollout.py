"""Rollout: KV-cache sampling with the rollout copy of the policy.

Log-probs of the sampled tokens come from the run's :class:`~rl_harness.logits.LogitsProcessor`,
the same formula the trainer uses. Every mismatch source the config can inject lives on this
side: the rollout copy's kernels, dtype and attention split size (see policy.working_copy),
and synthetic perturbations of the rollout logits (:func:`rl_harness.logits.perturb`).

Coupled sampling. A token is drawn as ``torch.multinomial`` draws one: an exponential race,
the argmax of p / q with q ~ Exp(1) for every vocabulary entry, which is the Gumbel-max trick
(-log q is Gumbel). The generator of a step is seeded by the run's seed and the step alone, and
each position draws the whole batch's noise at once, so the noise of (seed, step, position,
row) is one fixed number per vocabulary entry whatever the model computes. Two runs of the
same seed (an arm and its zero-mismatch twin) therefore draw the same token wherever their
distributions agree closely enough for the same entry to win the race: they part only where
the mismatch (or a different policy) changes the winner, and a row that has parted goes on
with another prefix. ``rollout.digests`` logs a digest of every response
(:func:`response_digests`), from which rl_harness.studies.edge measures the pair's agreement. A
synthetic perturbation draws its own numbers from the same generator first, which shifts the
race's noise: runs with ``rollout.logit_noise_*`` are not coupled to their twins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from bik.hf import cache_argument, generation_position_ids

from . import routing
from .batch import Rollout, Speculation
from .errors import ConfigError
from .logits import LogitsProcessor, perturb

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .config import RolloutConfig


def check_speculative(cfg: RolloutConfig, master: PreTrainedModel | None) -> None:
    """Refuse speculative decoding (rollout.speculative, either engine) for a policy whose
    cache cannot drop rejected drafts (a recurrent layer's state) or with experts (the
    routing record takes one position a forward)."""
    if cfg.speculative == "none" or master is None:
        return
    if routing.Recorder(master).routers:
        raise ConfigError(
            "rollout.speculative: expected a dense policy; a mixture-of-experts policy's "
            "routing record (rl_harness.routing) takes one position a forward"
        )
    layers = DynamicCache(config=master.config).layers
    if not all(layer.is_croppable for layer in layers):
        raise ConfigError(
            "rollout.speculative: expected a policy whose KV cache can drop rejected "
            "drafts; this one keeps a recurrent state (linear attention or Mamba layers)"
        )


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    prompts: list[list[int]],
    cfg: RolloutConfig,
    drift: torch.Tensor,
    generator: torch.Generator,
    rows: slice | None = None,
    *,
    greedy: bool = False,
    forced: torch.Tensor | None = None,
) -> Rollout:
    """Sample a response for every prompt (lists of token ids: BOS, if the vocabulary has
    one, then the text), or for the prompts ``rows`` (a contiguous range: one rank's share
    under data parallelism). PAD and EOS are the ids in ``model.config`` (the run's
    vocabulary: policy.build_master).

    ``greedy``: decode the most probable token instead (held-out evaluation,
    rl_harness.evaluate): the policy's own logits, without the synthetic perturbations, and
    no random number drawn (``generator`` and ``drift`` go unused).

    ``forced``: the response tokens ``[rows, N]`` of an earlier rollout of these prompts, fed
    instead of drawing (the shadow meter, rl_harness.runner): this model's log-probs of those
    tokens computed the rollout's way, decode over the KV cache; no random number is drawn.

    The prompts are left-padded to the whole batch's width, and every random number is drawn
    for the whole batch, each row using its own: a row's tokens and log-probs do not depend on
    which rows are sampled with it (bik's kernels make the forward independent of the rest).

    Returns the rows sampled (:class:`~rl_harness.batch.Rollout`), with ``routing`` for a
    mixture-of-experts model.
    """
    processor = LogitsProcessor.of(cfg)
    total = len(prompts)
    first, last, _ = (rows or slice(None)).indices(total)
    rows = slice(first, last)
    width = max(len(p) for p in prompts)
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    ids = torch.full((last - first, width), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, p in enumerate(prompts[rows]):
        ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    cache = DynamicCache(config=model.config)  # the layers generate() would build
    step_ids, positions = ids, generation_position_ids(attention)
    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    in_response: list[torch.Tensor] = []
    alive = torch.ones(last - first, dtype=torch.bool)
    recorder = routing.Recorder(model)
    steps = cfg.max_new_tokens if forced is None else forced.shape[1]
    speculating = cfg.speculative != "none" and forced is None
    history = [list(p) for p in prompts[rows]]  # each row's tokens so far, for the drafts
    counts = Speculation()
    with recorder if recorder.routers else contextlib.nullcontext():
        while len(tokens) < steps and bool(alive.any()):
            room = steps - len(tokens) - 1  # drafts past max_new_tokens would never be drawn
            drafts = draft(history, alive, cfg, room, pad) if speculating and tokens else None
            if drafts is None:  # a plain decode step (and the prefill)
                drafts = step_ids.new_empty(len(alive), 0)
            width_k = drafts.shape[1]
            step_ids = torch.cat([step_ids, drafts], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(width_k)], 1)
            scored = model(
                input_ids=step_ids,
                attention_mask=torch.cat([attention, attention.new_ones(len(alive), width_k)], 1),
                position_ids=positions,
                **cache_argument(model, cache),
                use_cache=True,
                logits_to_keep=1 + width_k,  # with drafts: the last input's and each draft's
            ).logits
            counts.forwards += 1
            for j in range(1 + width_k):  # position j: drawn as a decode step would draw it
                logits = scored[:, j]
                if forced is not None:
                    logits = processor.filter(logits)
                    token = forced[:, len(tokens)]
                elif greedy:
                    logits = processor.filter(logits)
                    token = logits.argmax(-1)  # temperature, top-k and top-p keep the argmax
                else:
                    logits = processor.filter(perturb(logits, cfg, drift, generator, rows, total))
                    token = _draw(processor.log_probs(logits).exp(), generator, rows, total)
                token = torch.where(alive, token, pad)  # finished rows keep feeding PAD
                logps.append(torch.where(alive, processor.token_logprobs(logits, token), 0.0))
                tokens.append(token)
                in_response.append(alive)
                if speculating:
                    for row, t in zip(history, token.tolist()):
                        row.append(t)
                alive = alive & (token != eos)
                # the next draft stands if every row still going drew it: the rows then share
                # one length, as plain decoding's do
                if j == width_k or not bool(alive.any()):
                    break
                if not bool(((token == drafts[:, j]) | ~alive).all()):
                    break
                counts.accepted += 1
            drawn = j + 1
            counts.proposed += width_k
            if width_k + 1 > drawn:  # the inputs past the last drawn position leave the cache
                cache.crop(drawn - width_k - 1)
            attention = torch.cat([attention, attention.new_ones(len(alive), drawn)], dim=1)
            next_position = positions[:, -1 - width_k] + drawn  # the first input's, + drawn
            step_ids, positions = token[:, None], next_position[:, None]
    generated = torch.stack(tokens, dim=1)
    response_mask = torch.stack(in_response, dim=1).long()
    sequences = torch.cat([ids, generated], dim=1)
    full_attention = torch.cat([attention[:, :width], torch.ones_like(generated)], dim=1)
    pad_prompt = torch.zeros_like(ids)
    batch = Rollout(
        sequences=sequences,
        attention_mask=full_attention,
        response_mask=torch.cat([pad_prompt, response_mask], dim=1),
        rollout_logp=torch.cat([pad_prompt.float(), torch.stack(logps, dim=1)], dim=1),
        prompt_width=width,
        pad_id=pad,
        speculation=counts if speculating else None,
    )
    if recorder.routers:
        experts = recorder.pop(last - first, calls_along="positions")
        batch.routing = routing.pad_positions(experts, sequences.shape[1])
    return batch


def draft(
    history: list[list[int]], alive: torch.Tensor, cfg: RolloutConfig, room: int, pad: int
) -> torch.Tensor | None:
    """The batch's drafts ``[B, k]`` by prompt lookup: for each row still going, the tokens
    that followed the latest earlier occurrence of its last n tokens (n = speculative_ngram
    down to 1), at most speculative_tokens and ``room``; k is the fewest any such row has
    (the rows go on together, so a longer draft could not stand past it). None where a row
    has none or there is no room. Finished rows' drafts are PAD: nothing of theirs is kept."""
    limit = min(cfg.speculative_tokens, room)
    if limit < 1:
        return None
    found = [
        lookup(row, cfg.speculative_ngram, limit) if go else []
        for row, go in zip(history, alive.tolist())
    ]
    k = min(len(f) for f, go in zip(found, alive.tolist()) if go)
    if k == 0:
        return None
    return torch.tensor([f[:k] if go else [pad] * k for f, go in zip(found, alive.tolist())])


def lookup(tokens: list[int], ngram: int, limit: int) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the last n
    ``tokens`` (n from ``ngram`` down to 1; the first n with a match and a continuation)."""
    for n in range(min(ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the latest match first
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + limit]
    return []


def _draw(probs: torch.Tensor, generator: torch.Generator, rows: slice, total: int) -> torch.Tensor:
    """One token per row of ``probs``, rows ``rows`` of a ``total``-row batch, drawn as
    ``torch.multinomial`` draws the whole batch: it takes random numbers for every element of
    its input at once (a row's token is argmax p / q, q ~ Exp(1)), so a share draws the whole
    batch's numbers, other rows standing in as uniform, and keeps its own rows."""
    if probs.shape[0] == total:
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    whole = probs.new_ones(total, probs.shape[1])
    whole[rows] = probs
    return torch.multinomial(whole, 1, generator=generator)[rows, 0]


DIGEST_HEX = 4  # hex digits per response: 16 bits, so two different responses collide 1 in 65536


def response_digests(sequences: torch.Tensor, response_mask: torch.Tensor) -> str:
    """One string of :data:`DIGEST_HEX` hex digits per row: a CRC-32 of the row's response
    tokens (those of ``response_mask``), cut to 16 bits. Equal responses give equal digests,
    so two runs' digests of a step say which rows sampled the same response."""
    digests = []
    for row, mask in zip(sequences.tolist(), response_mask.tolist()):
        tokens = [t for t, m in zip(row, mask) if m]
        crc = zlib.crc32(b"".join(t.to_bytes(4, "little") for t in tokens))
        digests.append(f"{crc & 0xFFFF:0{DIGEST_HEX}x}")
    return "".join(digests)


def pad_responses(batch: Rollout, length: int) -> Rollout:
    """``batch`` (from :func:`sample`) extended to ``length`` columns as a finished row goes on
    in :func:`sample` while other rows still generate: PAD tokens, attended, off the response,
    log-prob 0. Data-parallel ranks pad their shares to the batch's longest response, so each
    rank's rows equal the single-process batch's rows, columns included."""
    extra = length - batch.sequences.shape[1]
    if extra == 0:
        return batch

    def extend(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.cat([t, t.new_full((t.shape[0], extra), value)], dim=1)

    return dataclasses.replace(
        batch,
        sequences=extend(batch.sequences, batch.pad_id),
        attention_mask=extend(batch.attention_mask, 1),
        response_mask=extend(batch.response_mask, 0),
        rollout_logp=extend(batch.rollout_logp, 0.0),
        routing=None if batch.routing is None else routing.pad_positions(batch.routing, length),
    )
