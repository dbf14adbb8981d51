"""What tests, benchmarks, the RL harness and the command line share to build their inputs:
the tiny model presets (one per family, shaped only by ``Family.tiny_config``), the model
loader that takes a preset, a real model or a directory, and the random prompt sets the vLLM
comparisons sample from. Nothing here computes bik's numerics.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..families import FAMILIES
from . import models

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PRESETS = {f"tiny-{family}": family for family in FAMILIES}
SHARED_PREFIX = 40  # tokens: more than one 32-token KV block, so the prefix cache is hit
MAX_PROMPT = 48


def load_model(
    name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> PreTrainedModel:
    """A preset (random-init tiny config, no download), a real model of :mod:`bik.testing.models`
    (prepared on first use) or a local model directory."""
    from transformers import AutoModelForCausalLM

    if name in models.MODELS:
        model = AutoModelForCausalLM.from_pretrained(models.path(name))
    elif name in PRESETS:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(FAMILIES[PRESETS[name]].tiny_config())
    elif Path(name).is_dir():
        model = AutoModelForCausalLM.from_pretrained(name)
    else:
        raise ValueError(
            f"model: expected a preset ({', '.join(PRESETS)}), a real model "
            f"({', '.join(models.MODELS)}) or a local model directory, got {name!r}"
        )
    # transformers types .to through a decorator that drops its signature
    return model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]


def sample_prompts(seed: int, count: int, vocab: int) -> list[list[int]]:
    """``count`` prompts of random token ids (2 to 48 tokens, ids >= 3 to avoid the usual
    special ids); every other prompt starts with one shared 40-token prefix."""
    rng = random.Random(f"{seed}-vllm-prompts")
    low = 3 if vocab > 3 else 0
    shared = [rng.randrange(low, vocab) for _ in range(SHARED_PREFIX)]
    prompts = []
    for index in range(count):
        if index % 2:
            tail = [rng.randrange(low, vocab) for _ in range(rng.randrange(1, 9))]
            prompts.append(shared + tail)
        else:
            prompts.append([rng.randrange(low, vocab) for _ in range(rng.randrange(2, MAX_PROMPT))])
    return prompts


# The families bik's engine runs exactly (bik.families' vLLM column), which --family takes.
ENGINE_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.vllm.startswith("exact"))


def save_model(
    directory: str, hidden: int, layers: int, vocab: int, seed: int = 0, family: str = "qwen3"
) -> str:
    """Save a random-init model into ``directory``: Qwen3 (head_dim 64, GQA, MLP 3 x hidden)
    or another of ENGINE_FAMILIES' tiny preset (cases.family_config) at this size."""
    from transformers import AutoModelForCausalLM

    from .cases import family_config, qwen3_config

    if family not in ENGINE_FAMILIES:
        raise ValueError(f"family: expected one of {', '.join(ENGINE_FAMILIES)}, got {family!r}")
    if hidden % 64:
        raise ValueError(f"hidden: expected a multiple of 64, got {hidden}")
    if family == "qwen3":
        config = qwen3_config(hidden, layers, vocab, 1024)
    else:
        config = family_config(family, hidden, layers, vocab, 1024, engine=True)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory
