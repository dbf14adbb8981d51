"""A minimal GGUF reader for bik's registry models, with no dependency beyond numpy and torch.

A machine without the package registry (a GPU image) cannot install the ``gguf`` package that
transformers' GGUF loader needs, yet it can receive the GGUF file itself (``python -m bik model
NAME --pack``). This module reads that file and gives the Hugging Face state dict that
transformers' loader gives, bit for bit: the same dequantization formulas in float32, in the same
order of operations as ``gguf.quants`` (``d * q + m`` for Q4_1, ``q * d`` for Q8_0, no fused
multiply-add), and the same un-permutation of the query and key rows (llama.cpp's converter
interleaves each head's rotary halves; transformers puts them back). ``bik.testing.models``
checks the result against the digest it recorded from transformers' own conversion, so any
drift fails.

Only what the registry models use is read: the llama architecture and the tensor types F32,
F16, Q4_1 and Q8_0. Anything else is refused, naming what was found.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Metadata value types of the GGUF specification: fixed-size scalars by struct format.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# ggml tensor types read here: (elements per block, bytes per block).
F32, F16, Q4_1, Q8_0 = 0, 1, 3, 8
BLOCKS = {F32: (1, 4), F16: (1, 2), Q4_1: (32, 20), Q8_0: (32, 34)}
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_1: "Q4_1", Q8_0: "Q8_0"}


class GGUFError(ValueError):
    """A file this reader cannot read: not GGUF, another version, a tensor type or an
    architecture it does not know; the message names what was found."""


@dataclass(frozen=True)
class Tensor:
    """One tensor as stored: its shape in row-major order (GGUF lists the fastest dimension
    first, this is reversed), its ggml type and its raw bytes."""

    shape: tuple[int, ...]
    kind: int
    raw: np.ndarray  # uint8


class _Cursor:
    """Little-endian reads from a buffer, advancing an offset."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data.data  # a memoryview of the mapped file
        self.offset = 0

    def scalar(self, fmt: str) -> object:
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def count(self, fmt: str = "<Q") -> int:
        """An unsigned integer: a length, a count, a type code or an offset."""
        return int(self.scalar(fmt))  # type: ignore[call-overload]

    def string(self) -> str:
        size = self.count()
        text = bytes(self.data[self.offset : self.offset + size]).decode("utf-8")
        self.offset += size
        return text

    def value(self, kind: int) -> object:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item = self.count("<I")
            return [self.value(item) for _ in range(self.count())]
        raise GGUFError(f"metadata value type {kind} is not one of the GGUF specification's")


def read(path: str | Path) -> tuple[dict[str, object], dict[str, Tensor]]:
    """The metadata and the tensors (raw, in file order) of the GGUF file at ``path``."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(data[:4]) != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it starts with {bytes(data[:4])!r})")
    cursor = _Cursor(data)
    cursor.offset = len(MAGIC)
    version = cursor.count("<I")
    if version not in VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version}; this reader knows {VERSIONS}")
    tensor_count, meta_count = cursor.count(), cursor.count()
    metadata: dict[str, object] = {}
    for _ in range(meta_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.count("<I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.count() for _ in range(cursor.count("<I"))]
        kind, offset = cursor.count("<I"), cursor.count()
        infos.append((name, tuple(reversed(dims)), kind, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))  # type: ignore[call-overload]
    start = -(-cursor.offset // alignment) * alignment  # the data section is aligned
    tensors = {}
    for name, shape, kind, offset in infos:
        if kind not in BLOCKS:
            raise GGUFError(
                f"{path}: tensor {name} has ggml type {kind}; this reader knows "
                f"{', '.join(TYPE_NAMES.values())}"
            )
        per_block, block_bytes = BLOCKS[kind]
        elements = int(np.prod(shape))
        if shape and shape[-1] % per_block:
            raise GGUFError(
                f"{path}: tensor {name} has rows of {shape[-1]} elements, not a multiple of "
                f"{TYPE_NAMES[kind]}'s blocks of {per_block}"
            )
        begin, size = start + offset, elements // per_block * block_bytes
        if begin + size > len(data):
            raise GGUFError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        tensors[name] = Tensor(shape, kind, data[begin : begin + size])
    return metadata, tensors


def dequantize(tensor: Tensor) -> np.ndarray:
    """The tensor in float32, as ``gguf.quants.dequantize`` computes it (same formulas, same
    order of the float32 operations)."""
    if tensor.kind == F32:
        return tensor.raw.view(np.float32).reshape(tensor.shape)
    if tensor.kind == F16:
        return tensor.raw.view(np.float16).astype(np.float32).reshape(tensor.shape)
    blocks = tensor.raw.reshape(-1, BLOCKS[tensor.kind][1])
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if tensor.kind == Q8_0:  # 32 int8 values times the block's scale
        values = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return (values * scale).reshape(tensor.shape)
    # Q4_1: a scale d, a minimum m, then 16 bytes: the low nibbles are elements 0-15, the high
    # nibbles 16-31.
    minimum = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[:, 4:]
    nibbles = np.concatenate((packed & 0x0F, packed >> 4), axis=1).astype(np.float32)
    return ((scale * nibbles) + minimum).reshape(tensor.shape)


# GGUF tensor names of the llama architecture -> Hugging Face's (LlamaForCausalLM).
_LLAMA_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str:
    """The Hugging Face parameter name of a llama GGUF tensor name."""
    base, dot, suffix = name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if layer and layer[2] in _LLAMA_LAYER:
        return f"model.layers.{layer[1]}.{_LLAMA_LAYER[layer[2]]}{dot}{suffix}"
    if base in _LLAMA_GLOBAL:
        return f"{_LLAMA_GLOBAL[base]}{dot}{suffix}"
    raise GGUFError(f"tensor {name}: not a tensor of the llama architecture this reader maps")


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of a query or key projection: within each head the
    rows were reordered from (half, pair) to (pair, half); transformers swaps them back."""
    dim = weight.shape[0] // heads // 2
    rows = weight.reshape(heads, dim, 2, *weight.shape[1:])
    return rows.swapaxes(2, 1).reshape(weight.shape)


def llama_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The float32 Hugging Face state dict of a llama GGUF file, equal bit for bit to what
    transformers' GGUF loader gives."""
    metadata, tensors = read(path)
    architecture = metadata.get("general.architecture")
    if architecture != "llama":
        raise GGUFError(f"{path}: architecture {architecture!r}; this reader maps 'llama' only")
    heads = int(metadata["llama.attention.head_count"])  # type: ignore[call-overload]
    kv_heads = int(metadata.get("llama.attention.head_count_kv", heads))  # type: ignore[call-overload]
    state = {}
    for name, tensor in tensors.items():
        weight = dequantize(tensor)
        if ".attn_q." in name:
            weight = unpermute(weight, heads)
        elif ".attn_k." in name:
            weight = unpermute(weight, kv_heads)
        state[hf_name(name)] = torch.from_numpy(np.array(weight, dtype=np.float32))
    return state
