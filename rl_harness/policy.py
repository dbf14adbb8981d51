"""The policy: fp32 master weights, working copies per side, and the cached supervised warm-up.

The optimiser updates the fp32 master. The rollout and the trainer each run a working copy in
their own dtype with their own kernels (bik-patched or native torch); both are refreshed from
the master before every step, so the only difference between the sides is what the config
injects.
"""

import copy
import hashlib
import json
import random
from pathlib import Path

import torch

import bik
from bik.hf import generation_position_ids

from . import tasks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_master(model_cfg, seed):
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_cfg["path"]:
        model = AutoModelForCausalLM.from_pretrained(model_cfg["path"], torch_dtype=torch.float32)
        if model.config.vocab_size < tasks.VOCAB_SIZE:
            raise ValueError(
                f"model.path: vocabulary of {model.config.vocab_size} is smaller than "
                f"the task alphabet ({tasks.VOCAB_SIZE})"
            )
        return model.train()
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_cfg["family"],
        vocab_size=tasks.VOCAB_SIZE,
        hidden_size=model_cfg["hidden_size"],
        intermediate_size=4 * model_cfg["hidden_size"],
        num_hidden_layers=model_cfg["layers"],
        num_attention_heads=model_cfg["heads"],
        num_key_value_heads=model_cfg["kv_heads"],
        head_dim=model_cfg["head_dim"],
        max_position_embeddings=256,
        pad_token_id=tasks.PAD,
        bos_token_id=tasks.BOS,
        eos_token_id=tasks.EOS,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config).train()


def working_copy(master, dtype, kernels, split_size=0):
    """A copy of ``master`` in ``dtype`` running bik's kernels or native torch."""
    work = copy.deepcopy(master).to(DTYPES[dtype])
    if kernels == "bik":
        bik.patch_model(work, split_size=split_size or None)
    return work


@torch.no_grad()
def refresh(work, master):
    for w, m in zip(work.parameters(), master.parameters()):
        w.copy_(m)


def sft_batch(task_cfg, rng, size):
    """Left-padded BOS+prompt+answer+EOS sequences and a mask of the answer+EOS tokens."""
    rows = []
    for _ in range(size):
        prompt, answer = tasks.sample(
            task_cfg["name"], rng, task_cfg["min_digits"], task_cfg["max_digits"]
        )
        rows.append(([tasks.BOS] + tasks.encode(prompt), tasks.encode(answer) + [tasks.EOS]))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((size, width), tasks.PAD, dtype=torch.long)
    attention, target = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, a) in enumerate(rows):
        start = width - len(p) - len(a)
        ids[i, start:] = torch.tensor(p + a)
        attention[i, start:] = 1
        target[i, width - len(a) :] = 1
    return ids, attention, target


def warmup(master, config, cache_dir):
    """Supervised warm-up on the task so RL starts from partial competence; cached by config."""
    key = json.dumps({k: config[k] for k in ("seed", "model", "task", "warmup")}, sort_keys=True)
    path = Path(cache_dir) / f"warmup-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.exists():
        master.load_state_dict(torch.load(path))
        return path
    rng = random.Random(f"warmup-{config['seed']}")
    opt = torch.optim.AdamW(master.parameters(), lr=config["warmup"]["lr"])
    for _ in range(config["warmup"]["steps"]):
        ids, attention, target = sft_batch(config["task"], rng, config["warmup"]["batch_size"])
        logits = master(
            input_ids=ids, attention_mask=attention, position_ids=generation_position_ids(attention)
        ).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), ids[:, 1:], reduction="none"
        )
        loss = (loss * target[:, 1:]).sum() / target[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(master.state_dict(), path)
    return path
