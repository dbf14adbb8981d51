"""The policy: fp32 master weights, working copies per side, and the cached supervised warm-up.

The optimiser updates the fp32 master. The rollout and the trainer each run a working copy in
their own dtype with their own kernels (bik-patched or native torch); both are refreshed from
the master before every step, so the only difference between the sides is what the config
injects.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import random
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import bik
from bik.contract import DTYPE_NAMES
from bik.families import FAMILIES, ExpertShape, Shape
from bik.hf import generation_position_ids
from bik.testing.machine import cpu_numerics
from bik.testing.models import MODELS

from . import tasks, vocab
from .errors import ConfigError
from .logits import round_mantissa
from .rundir import write_atomic

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .config import Config, ModelConfig


def build_master(model_cfg: ModelConfig, seed: int) -> PreTrainedModel:
    """The fp32 master policy: ``model.path`` loaded, or a random-init ``model.family``; its
    config (and generation config) carries the run vocabulary's special ids
    (rl_harness.vocab.of), which the samplers read."""
    from transformers import AutoModelForCausalLM

    words = vocab.of(model_cfg)
    if model_cfg.path:
        try:
            directory = vocab.model_directory(model_cfg.path)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"model.path: cannot load a causal LM from {model_cfg.path!r} ({error})"
            ) from None
        if model.config.vocab_size < words.size:
            what = "task alphabet" if words is vocab.CHAR else "tokenizer's vocabulary"
            raise ConfigError(
                f"model.path: vocabulary of {model.config.vocab_size} is smaller than "
                f"the {what} ({words.size})"
            )
        for config in (model.config, model.generation_config):
            config.pad_token_id, config.bos_token_id = words.pad, words.bos
            config.eos_token_id = words.eos
        return model.train()
    torch.manual_seed(seed)
    config = FAMILIES[model_cfg.family].config(
        policy_shape(model_cfg),
        policy_experts(model_cfg),
        pad_token_id=words.pad,
        bos_token_id=words.bos,
        eos_token_id=words.eos,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config).train()


def policy_shape(model_cfg: ModelConfig) -> Shape:
    """A random-init policy's size (bik.families.Family.config spells it in the family's
    keys): the run vocabulary, an MLP 4 x hidden wide, 256 positions; a hybrid's recurrent
    layers with the attention's heads (``model.kv_heads`` key heads, ``model.heads`` value
    heads of ``model.head_dim``; Nemotron-H's Mamba2 mixer: ``model.heads`` heads,
    ``model.kv_heads`` groups), the last layer full attention."""
    return Shape(
        vocab=vocab.of(model_cfg).size,
        hidden=model_cfg.hidden_size,
        intermediate=4 * model_cfg.hidden_size,
        layers=model_cfg.layers,
        heads=model_cfg.heads,
        kv_heads=model_cfg.kv_heads,
        head_dim=model_cfg.head_dim,
        positions=256,
    )


def policy_experts(model_cfg: ModelConfig) -> ExpertShape | None:
    """A mixture-of-experts policy's experts (None: dense): ``model.experts``, of them
    ``model.experts_per_token`` a token, each 4 x hidden / experts_per_token wide (a token's
    active MLP width is the dense policy's), a shared expert (Qwen2-MoE, Qwen3-Next) 4 x hidden
    wide."""
    if not model_cfg.moe:
        return None
    width = 4 * model_cfg.hidden_size
    top_k = model_cfg.experts_per_token
    return ExpertShape(model_cfg.experts, top_k, max(1, width // top_k), width)


def working_copy(
    master: PreTrainedModel,
    dtype: str,
    kernels: str,
    split_size: int = 0,
    tp_invariant: bool = False,
) -> PreTrainedModel:
    """A copy of ``master`` in ``dtype`` running bik's kernels or native torch (with
    ``tp_invariant``, bik's TP-invariant order: what a TP-sharded bik rollout runs)."""
    # transformers types PreTrainedModel.to through a decorator that drops its signature
    work = copy.deepcopy(master).to(DTYPE_NAMES[dtype])  # type: ignore[arg-type]
    if kernels == "bik":
        bik.patch_model(work, split_size=split_size or None, tp_invariant=tp_invariant)
    return work


@torch.no_grad()
def refresh(work: torch.nn.Module, master: torch.nn.Module, weight_round_bits: int = 0) -> None:
    """Copy the master's weights into ``work``; with ``weight_round_bits``, then round the
    weight of every linear layer to that many mantissa bits (an fp8-like rollout copy)."""
    for w, m in zip(work.parameters(), master.parameters()):
        w.copy_(m)
    if weight_round_bits:
        for module in work.modules():
            if isinstance(module, torch.nn.Linear):
                weight = module.weight
                weight.copy_(round_mantissa(weight.float(), weight_round_bits))


def sft_batch(
    config: Config, rng: random.Random, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt (BOS first, if any) + target + EOS sequences of the run's task and
    vocabulary, and a mask of the target+EOS tokens.

    The first ``round(warmup.long_form_share * size)`` rows take the task's long form as
    their target (rl_harness.tasks.Task.target), the rest the direct answer; no random
    number decides it, so a share of 0 gives the batches of a harness without long forms,
    bit for bit."""
    task, words, task_cfg = tasks.of(config.task), vocab.of(config.model), config.task
    long_rows = round(config.warmup.long_form_share * size)
    rows = []
    with tasks.texts_of(task_cfg):
        for row in range(size):
            example = task.sample(rng, task_cfg.min_digits, task_cfg.max_digits)
            target = task.target(example, long_form=row < long_rows)
            rows.append((words.prompt(example.prompt), [*words.encode(target), words.eos]))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((size, width), words.pad, dtype=torch.long)
    attention, target_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, a) in enumerate(rows):
        start = width - len(p) - len(a)
        ids[i, start:] = torch.tensor(p + a)
        attention[i, start:] = 1
        target_mask[i, width - len(a) :] = 1
    return ids, attention, target_mask


def check_positions(config: Config, positions: int) -> None:
    """Refuse a run whose sequences could exceed the policy's ``positions``: the longest
    warm-up sequence (BOS, prompt, long-form target, EOS) or the longest prompt (BOS
    included) plus rollout.max_new_tokens. Bounds come from the task's ``max_lengths`` (in
    characters: a bound on tokens for the character vocabulary, and for a tokenizer whose
    tokens hold at least one character each)."""
    prompt, target = tasks.of(config.task).max_lengths(config.task.max_digits)
    prompt += 1  # BOS
    if prompt + target + 1 > positions:
        raise ConfigError(
            f"task.max_digits: warm-up sequences of up to {prompt + target + 1} tokens (BOS, "
            f"prompt, long-form target, EOS) at {config.task.max_digits} exceed the policy's "
            f"{positions} positions; expected a smaller task.max_digits"
        )
    if prompt + config.rollout.max_new_tokens > positions:
        raise ConfigError(
            f"rollout.max_new_tokens: expected at most {positions - prompt} (prompts of up to "
            f"{prompt} tokens, BOS included, within the policy's {positions} positions), got "
            f"{config.rollout.max_new_tokens}"
        )


def warmup_seed(config: Config) -> int:
    """The seed of the warm-up (the master's random init and the warm-up data):
    warmup.seed, or the run's seed when it is None."""
    return config.seed if config.warmup.seed is None else config.warmup.seed


def model_files_digest(path: str | Path) -> str:
    """sha256 over the names and contents of every file under a model directory."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(root)).encode() + b"\0")
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def warmup_numerics() -> dict[str, Any]:
    """What the warm-up's bits depend on beyond its config: the torch thread count, the torch
    and transformers versions (the model's code) and the CPU (its vector capability, AMX)."""
    import transformers

    return {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": cpu_numerics(),
    }


def warmup_cache_path(config: Config, cache_dir: str | Path) -> Path:
    """Where the warm-up of ``config`` is cached: keyed by the warm-up seed
    (:func:`warmup_seed`, not the RL seed: runs that differ in ``seed`` only share one
    warm-up under one warmup.seed), the model, task and warm-up sections and, for
    ``model.path``, the content of the model's files (new weights written to the same
    directory get a new warm-up), and what else changes the warm-up's bits: plain torch
    trains it, whose CPU reductions split by thread, so the torch thread count, the torch
    version and the CPU's vector capability (a run on 1 thread never reuses the warm-up of
    a run on 2: its start would silently depend on which ran first)."""
    # warmup.seed enters through "seed" only: a run with warmup.seed=None keeps its key, and
    # one whose warmup.seed equals another's seed (same warm-up) shares that one's cache.
    warmup_section = dataclasses.replace(config.warmup, seed=None)
    sections = {"model": config.model, "task": config.task, "warmup": warmup_section}
    key: dict[str, Any] = {
        "seed": warmup_seed(config),
        **{k: dataclasses.asdict(v) for k, v in sections.items()},
        "numerics": warmup_numerics(),
    }
    if config.warmup.kernels == "torch":  # the keys of the caches made before the key
        del key["warmup"]["kernels"]
    else:  # bik's orders do not split by thread
        del key["numerics"]["threads"]
    if not config.model.chat_template:  # the keys of runs without it stay what they were
        del key["model"]["chat_template"]
    if config.model.path in MODELS:  # its weights are checked against this digest
        key["model_files"] = MODELS[config.model.path].weights_sha256
    elif config.model.path:
        key["model_files"] = model_files_digest(config.model.path)
    text = json.dumps(key, sort_keys=True)
    return Path(cache_dir) / f"warmup-{hashlib.sha256(text.encode()).hexdigest()[:16]}.pt"


def warmup(
    master: PreTrainedModel, config: Config, cache_dir: str | Path, progress: bool = False
) -> Path | None:
    """Supervised warm-up on the task so RL starts from partial competence; cached (see
    :func:`warmup_cache_path`), written atomically; returns the cache's path. ``progress``: a
    line on stderr that says whether the cache was used, and the training's step, loss and
    time left as it goes. ``warmup.steps`` 0: nothing to train and nothing cached (a copy of
    a pretrained model's weights would only fill the disk); returns None."""
    if config.warmup.steps == 0:
        return None
    path = warmup_cache_path(config, cache_dir)
    if path.exists():
        try:
            master.load_state_dict(torch.load(path, weights_only=True))
            if progress:
                print(f"warm-up: the cached one ({path})", file=sys.stderr, flush=True)
            return path
        except Exception as error:  # a damaged cache entry is recomputed, not fatal
            warnings.warn(
                f"{path}: unreadable warm-up cache ({error}); recomputing it", stacklevel=2
            )
    rng = random.Random(f"warmup-{warmup_seed(config)}")
    opt = torch.optim.AdamW(master.parameters(), lr=config.warmup.lr)
    started, total = time.time(), config.warmup.steps
    through_bik = config.warmup.kernels == "bik"
    if through_bik:
        bik.patch_model(master)
    try:
        for step in range(total):
            ids, attention, target = sft_batch(config, rng, config.warmup.batch_size)
            loss = _sft_loss(master, ids, attention, target[:, 1:], through_bik)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if progress and ((step + 1) % 10 == 0 or step + 1 == total):
                _warmup_progress(step + 1, total, loss.item(), started)
    finally:
        if through_bik:
            bik.unpatch_model(master)
    write_atomic(path, lambda tmp: torch.save(master.state_dict(), tmp))
    return path


def _sft_loss(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor,
    target: torch.Tensor,
    through_bik: bool,
) -> torch.Tensor:
    """The mean negative log-likelihood of the ``target`` tokens (a 0 / 1 mask): through
    ``bik.token_logprobs`` (its fixed order, which the patched model's bits keep), or torch's
    cross-entropy (warmup.kernels=torch)."""
    logits = model(
        input_ids=ids, attention_mask=attention, position_ids=generation_position_ids(attention)
    ).logits[:, :-1]
    if through_bik:
        nll = -bik.token_logprobs(logits, ids[:, 1:])
    else:
        nll = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), ids[:, 1:], reduction="none"
        )
    return (nll * target).sum() / target.sum()


def _warmup_progress(done: int, total: int, loss: float, started: float) -> None:
    rate = (time.time() - started) / done
    print(
        f"\rwarm-up [{done}/{total}] loss {loss:.3f} | {rate:.2f} s/step, "
        f"eta {rate * (total - done):.0f} s ",
        end="\n" if done == total else "",
        file=sys.stderr,
        flush=True,
    )
