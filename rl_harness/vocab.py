"""The run's vocabulary: the character vocabulary, or the tokenizer of a local model.

:func:`of` gives a run's vocabulary: the :class:`CharVocab` (the tasks' characters, ids from
3; 0, 1, 2 are PAD, BOS, EOS) unless ``model.path`` is a directory holding a Hugging Face
tokenizer, whose :class:`TokenizerVocab` then encodes the prompts and decodes the responses.
Both give ``pad``, ``bos`` (None: prompts start with their first text token), ``eos``,
``size``, ``encode``, ``decode`` and ``prompt``. policy.build_master writes the special ids
into the policy's config, where the samplers read them.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from bik.testing import models

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import ModelConfig

CHARS = "0123456789+=,:abcdefghijklmnopqrstuvwxyz"
"""The characters of every shipped task: they fix the random-init policy's vocabulary."""
VOCAB_SIZE = 3 + len(CHARS)
UNKNOWN = "\ufffd"
"""What an id outside the vocabulary decodes to (a loaded model.path may sample one): no
task's character, so such a response never matches an answer."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A model directory holding any of these holds a tokenizer."""


class OutOfVocabulary(ValueError):
    """A text with a character the character vocabulary lacks (rl_harness.tasks reports it
    as a ConfigError naming the task)."""


class CharVocab:
    """One id per character of :data:`CHARS` (from 3), after PAD 0, BOS 1 and EOS 2."""

    pad, bos, eos, size = 0, 1, 2, VOCAB_SIZE
    _ids: ClassVar[dict[str, int]] = {c: i + 3 for i, c in enumerate(CHARS)}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as error:
            raise OutOfVocabulary(
                f"the character {error.args[0]!r} of {text!r} is not in the character "
                f"vocabulary {CHARS!r}"
            ) from None

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` up to the first EOS (PAD and BOS dropped)."""
        out = []
        for i in ids:
            if i == self.eos:
                break
            if i >= 3:
                out.append(CHARS[i - 3] if i < self.size else UNKNOWN)
        return "".join(out)

    def prompt(self, text: str) -> list[int]:
        """The token ids of a prompt: BOS, then ``text``."""
        return [self.bos, *self.encode(text)]


class TokenizerVocab:
    """A Hugging Face tokenizer: texts encoded without special tokens; EOS is the
    tokenizer's (required), PAD its pad token or else EOS, BOS its BOS token or None, when
    prompts are the text's tokens alone."""

    def __init__(self, tokenizer: Any, path: str, chat_template: bool = False) -> None:
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"model.path: the tokenizer in {path!r} has no EOS token")
        self.tokenizer = tokenizer
        self.eos: int = tokenizer.eos_token_id
        self.pad: int = self.eos if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self.bos: int | None = tokenizer.bos_token_id
        self.size: int = len(tokenizer)
        if chat_template and not tokenizer.chat_template:
            raise ConfigError(f"model.chat_template: the tokenizer in {path!r} has none")
        self.chat_template = chat_template
        self._special = set(tokenizer.all_special_ids) | {self.pad}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` up to the first EOS (special tokens dropped; an id beyond the
        tokenizer decodes to :data:`UNKNOWN`)."""
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i == self.eos:
                break
            if i >= self.size:
                out += [self.tokenizer.decode(run), UNKNOWN]
                run = []
            elif i not in self._special:
                run.append(i)
        return "".join([*out, self.tokenizer.decode(run)])

    def prompt(self, text: str) -> list[int]:
        """The token ids of a prompt: BOS (if the tokenizer has one), then ``text``; with
        ``chat_template``, ``text`` as the user turn of the tokenizer's chat template, up to
        the start of the assistant's answer."""
        if self.chat_template:
            turn = [{"role": "user", "content": text}]
            return list(
                self.tokenizer.apply_chat_template(turn, add_generation_prompt=True)["input_ids"]
            )
        return ([] if self.bos is None else [self.bos]) + self.encode(text)


Vocab = CharVocab | TokenizerVocab
CHAR = CharVocab()


def of(model_cfg: ModelConfig) -> Vocab:
    """The vocabulary of a run's model section (see the module docstring)."""
    return _load(model_cfg.path, model_cfg.chat_template)


def model_directory(path: str) -> str:
    """The local directory of ``model.path``: a real model of bik.testing.models by name
    (prepared
    on first use), or the directory itself."""
    if path in models.MODELS:
        try:
            return str(models.path(path))
        except models.ModelUnavailableError as error:
            raise ConfigError(f"model.path: {error}") from None
    return path


@functools.lru_cache(maxsize=8)
def _load(path: str | None, chat_template: bool = False) -> Vocab:
    if path is not None:
        path = model_directory(path)
    if path is None or not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        if chat_template:
            raise ConfigError(f"model.chat_template: {path!r} holds no tokenizer")
        return CHAR
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ConfigError(f"model.path: cannot load the tokenizer in {path!r} ({error})") from None
    return TokenizerVocab(tokenizer, path, chat_template)
