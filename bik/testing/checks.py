"""The invariance checks of a causal LM, each comparing token log-probs bit for bit (the
checks of ``python -m bik verify``, shared with the Hugging Face tests):

  batch_1_vs_n      a sequence alone vs the same sequence in a left-padded batch of N
  needle            one prompt at random positions in random batches (several trials)
  decode_vs_prefill generate() with the KV cache vs one full forward of the finished batch
  chunked_prefill   the sequence fed in random chunks through the KV cache vs one forward
  left_padding      the sequence behind P pad tokens vs unpadded

:func:`first_divergent_module` names the first module whose output depends on the batch.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import hf
from ..ops.log_softmax import token_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# -- batches -------------------------------------------------------------------------------


def _logprobs(model, sequences, pad_id, extra=0):
    """Per-sequence log-probs of every token after the first, from one padded forward."""
    device = model.device
    ids, mask = hf.left_pad(sequences, pad_id, extra)
    out = hf.sequence_logprobs(model, ids.to(device), mask.to(device), mask.to(device))
    return [out[row, out.shape[1] - len(seq) + 1 :] for row, seq in enumerate(sequences)]


def _random_tokens(rng, vocab, length):
    return torch.tensor([rng.randrange(3, vocab) for _ in range(length)])


def _compare(a, b):
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return torch.equal(a, b), diff


# -- checks --------------------------------------------------------------------------------


def check_batch(
    model: PreTrainedModel, rng: random.Random, vocab: int, pad_id: int
) -> tuple[bool, float]:
    seq = _random_tokens(rng, vocab, 24)
    others = [_random_tokens(rng, vocab, rng.randrange(4, 40)) for _ in range(6)]
    position = rng.randrange(len(others) + 1)
    batch = others[:position] + [seq] + others[position:]
    return _compare(_logprobs(model, [seq], pad_id)[0], _logprobs(model, batch, pad_id)[position])


def check_needle(
    model: PreTrainedModel, rng: random.Random, vocab: int, pad_id: int, trials: int = 3
) -> tuple[bool, float]:
    needle = _random_tokens(rng, vocab, 16)
    alone = _logprobs(model, [needle], pad_id)[0]
    results = []
    for _ in range(trials):
        hay = [_random_tokens(rng, vocab, rng.randrange(4, 48)) for _ in range(rng.randrange(1, 9))]
        position = rng.randrange(len(hay) + 1)
        batch = hay[:position] + [needle] + hay[position:]
        results.append(_compare(alone, _logprobs(model, batch, pad_id)[position]))
    return all(r[0] for r in results), max(r[1] for r in results)


def check_decode(
    model: PreTrainedModel, rng: random.Random, vocab: int, pad_id: int, new_tokens: int = 8
) -> tuple[bool, float]:
    prompts = [_random_tokens(rng, vocab, rng.randrange(3, 20)) for _ in range(3)]
    ids, mask = hf.left_pad(prompts, pad_id)
    device = model.device
    # GenerationMixin.generate: its output's type follows the flags (Any here)
    out = cast(Any, model).generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=pad_id,
    )
    generated = out.sequences[:, ids.shape[1] :]
    rollout = token_logprobs(torch.stack(out.logits, dim=1), generated)
    full_mask = torch.cat([mask.to(device), torch.ones_like(generated)], dim=1)
    trained = hf.sequence_logprobs(model, out.sequences, full_mask, full_mask)[:, ids.shape[1] :]
    return _compare(rollout, trained)


def check_chunked(
    model: PreTrainedModel, rng: random.Random, vocab: int, pad_id: int
) -> tuple[bool, float]:
    from transformers import DynamicCache

    seq = _random_tokens(rng, vocab, 30).to(model.device)
    cuts = sorted(rng.sample(range(1, len(seq)), 3))
    cache, pieces = DynamicCache(config=model.config), []  # the layers generate() would build
    for start, stop in zip([0, *cuts], [*cuts, len(seq)]):
        logits = model(
            input_ids=seq[None, start:stop],
            **hf.cache_argument(model, cache),
            use_cache=True,
            position_ids=torch.arange(start, stop, device=seq.device)[None],
        ).logits
        pieces.append(logits[0])
    chunked = token_logprobs(torch.cat(pieces)[:-1], seq[1:])
    return _compare(chunked, _logprobs(model, [seq.cpu()], pad_id)[0])


def check_left_padding(
    model: PreTrainedModel, rng: random.Random, vocab: int, pad_id: int
) -> tuple[bool, float]:
    seq = _random_tokens(rng, vocab, 20)
    return _compare(
        _logprobs(model, [seq], pad_id)[0],
        _logprobs(model, [seq], pad_id, extra=rng.randrange(1, 40))[0],
    )


CHECKS = {
    "batch_1_vs_n": check_batch,
    "needle": check_needle,
    "decode_vs_prefill": check_decode,
    "chunked_prefill": check_chunked,
    "left_padding": check_left_padding,
}


def run_checks(model: PreTrainedModel, seed: int = 0) -> dict[str, tuple[bool, float]]:
    """{check name: (bit-identical, max abs diff)} for ``model`` as it is (patched or not)."""
    vocab, pad_id = model.config.vocab_size, model.config.pad_token_id or 0
    results = {}
    with torch.no_grad():
        for name, check in CHECKS.items():
            results[name] = check(model, random.Random(f"{seed}-{name}"), vocab, pad_id)
    return results


def first_divergent_module(model: PreTrainedModel, seed: int = 0) -> str | None:
    """The first module (in execution order) whose output for a sequence differs between
    batch 1 and a left-padded batch of 8 (wide enough that plain matmuls pick other kernels on
    CPUs with and without AVX-512), or None. If that module's input already differs, the
    source is an op between modules (such as the attention function) and is named as such."""
    rng = random.Random(seed)
    vocab, pad_id = model.config.vocab_size, model.config.pad_token_id or 0
    seq = _random_tokens(rng, vocab, 12)
    batch = [
        _random_tokens(rng, vocab, 40),
        seq,
        *(_random_tokens(rng, vocab, 40) for _ in range(6)),
    ]
    runs = []
    for sequences, row in (([seq], 0), (batch, 1)):
        outputs: list[tuple[str, str, torch.Tensor | None, torch.Tensor | None]] = []
        hooks = [
            m.register_forward_hook(_recorder(name, m, outputs, row, len(seq)))
            for name, m in model.named_modules()
            if name
        ]
        ids, mask = hf.left_pad(sequences, pad_id)
        with torch.no_grad():
            model(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                position_ids=hf.generation_position_ids(mask).to(model.device),
            )
        for hook in hooks:
            hook.remove()
        runs.append(outputs)
    for (name, kind, in_a, out_a), (_, _, in_b, out_b) in zip(*runs):
        if not _same(out_a, out_b):
            if _same(in_a, in_b):
                return f"{name} ({kind})"
            parent = name.rsplit(".", 1)[0]
            return (
                f"an op that is not a module, inside {parent} (the input of {name} ({kind}) "
                "already differs: e.g. the attention function)"
            )
    return None


def _same(a, b):
    """Equal, or not comparable (missing or differently shaped)."""
    return a is None or b is None or a.shape != b.shape or torch.equal(a, b)


def _recorder(name, module, outputs, row, length):
    def keep(t):
        t = t[0] if isinstance(t, tuple) and t else t
        if (
            isinstance(t, torch.Tensor)
            and t.dim() >= 2
            and t.shape[0] > row
            and t.shape[1] >= length
        ):
            return t[row, -length:].detach().clone()
        return None

    def hook(_module, inputs, output):
        outputs.append((name, type(module).__name__, keep(inputs), keep(output)))

    return hook
