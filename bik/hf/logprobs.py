"""The trainer side: log-probs of finished sequences from one full forward, as rollout
computed them while sampling."""

from collections.abc import Sequence

import torch

from ..ops.log_softmax import token_logprobs


def generation_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids exactly as transformers' generate derives them from the attention mask."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of ``input_ids`` under one full forward, as rollout computed them.

    Returns fp32 ``[B, T]``: entry t is log p(input_ids[t] | input_ids[:t]) where
    ``response_mask[:, t]`` is set, else 0 (position 0 has no prediction). Positions come from
    the attention mask as in generation, and the one-token shift is done here.

    ``attention_mask`` is 1 on each row's tokens: left padding before them, and zeros after
    them where a sequence stopped at EOS before the longest one (exact: under causal
    attention no token sees a later one). A zero between two tokens of a row raises.
    """
    for name, t in (
        ("input_ids", input_ids),
        ("attention_mask", attention_mask),
        ("response_mask", response_mask),
    ):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor [B, T]")
        if t.shape != input_ids.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(input_ids.shape)}, got {tuple(t.shape)}"
            )
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=generation_position_ids(attention_mask),
        use_cache=False,
    ).logits
    logp = token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=logp.device)
    out[:, 1:] = torch.where(response_mask[:, 1:].bool(), logp, 0.0)
    return out


def left_pad(
    sequences: Sequence[torch.Tensor], pad_id: int, extra: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D token tensors into ``ids, attention_mask`` with left padding (+ ``extra``)."""
    width = max(len(s) for s in sequences) + extra
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = seq
        mask[row, width - len(seq) :] = 1
    return ids, mask
