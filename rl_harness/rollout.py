"""Rollout: KV-cache sampling with the rollout copy of the policy.

Log-probs of the sampled tokens come from ``bik.token_logprobs`` of the processed logits, the
same formula the trainer uses. Every mismatch source the config can inject lives on this side:
the rollout copy's kernels, dtype and attention split size (see policy.working_copy), and
synthetic perturbations of the rollout logits (``perturb_logits``).
"""

import torch
from transformers import DynamicCache

import bik
from bik.hf import generation_position_ids

from . import tasks


def process_logits(logits, top_k, top_p):
    """Top-k / top-p filtering (-inf outside the kept set), applied identically on both sides."""
    logits = logits.float()
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = bik.log_softmax(sorted_logits).exp()
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def round_mantissa(x, bits):
    """``x`` rounded to ``bits`` mantissa bits (quantised-like logits); 0 = unchanged."""
    if not bits:
        return x
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2.0**bits) / 2.0**bits, exponent)


def perturb_logits(logits, cfg, drift, generator):
    """The synthetic mismatch sources: fresh noise (std), a fixed per-token drift (bias: a
    systematic, biased error), and mantissa rounding."""
    out = logits.float()
    if cfg["logit_noise_std"]:
        noise = torch.randn(out.shape, generator=generator).to(out.device)
        out = out + cfg["logit_noise_std"] * noise
    if cfg["logit_noise_bias"]:
        out = out + cfg["logit_noise_bias"] * drift.to(out.device)
    return round_mantissa(out, cfg["logit_round_bits"])


@torch.no_grad()
def sample(model, prompts, cfg, drift, generator):
    """Sample a response for every prompt (lists of token ids, BOS included).

    Returns dict: ``sequences``, ``attention_mask`` (left padding, then ones), ``response_mask``
    (response tokens up to and including EOS), ``rollout_logp`` ``[B, L]`` fp32 (0 off-response)
    and ``prompt_width``.
    """
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tasks.PAD, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    cache = DynamicCache()
    step_ids, positions = ids, generation_position_ids(attention)
    tokens, logps, in_response = [], [], []
    alive = torch.ones(len(prompts), dtype=torch.bool)
    for _ in range(cfg["max_new_tokens"]):
        logits = model(
            input_ids=step_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        logits = process_logits(
            perturb_logits(logits, cfg, drift, generator), cfg["top_k"], cfg["top_p"]
        )
        probs = bik.log_softmax(logits / cfg["temperature"], dtype=torch.float32).exp()
        token = torch.multinomial(probs, 1, generator=generator)[:, 0]
        token = torch.where(alive, token, tasks.PAD)  # finished rows keep feeding PAD
        logps.append(torch.where(alive, bik.token_logprobs(logits, token, cfg["temperature"]), 0.0))
        tokens.append(token)
        in_response.append(alive)
        alive = alive & (token != tasks.EOS)
        if not bool(alive.any()):
            break
        attention = torch.cat([attention, torch.ones_like(token)[:, None]], dim=1)
        step_ids, positions = token[:, None], positions[:, -1:] + 1
    generated = torch.stack(tokens, dim=1)
    response_mask = torch.stack(in_response, dim=1).long()
    sequences = torch.cat([ids, generated], dim=1)
    full_attention = torch.cat([attention[:, :width], torch.ones_like(generated)], dim=1)
    pad_prompt = torch.zeros_like(ids)
    return {
        "sequences": sequences,
        "attention_mask": full_attention,
        "response_mask": torch.cat([pad_prompt, response_mask], dim=1),
        "rollout_logp": torch.cat([pad_prompt.float(), torch.stack(logps, dim=1)], dim=1),
        "prompt_width": width,
    }
