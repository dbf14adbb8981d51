"""Benchmark cases: each pairs a bik call with its non-invariant baseline on the same inputs.

A case is (op, shape label, work, inputs, bik, baseline): ``inputs(device, dtype)`` builds the
arguments of one call (tensors, or a model and its input ids), ``bik(*args)`` and
``baseline(*args)`` run the op on them, and ``work`` = (flops, bytes) of one call.
:meth:`Case.make` returns the two timed functions. Given ``copies > 1`` it clones the inputs
that many times and both functions walk the copies through ONE shared cursor, so across timed
calls (bik's and the baseline's alike) every copy is touched in turn and a copy comes back only
after all the others: when the copies together exceed the GPU's L2 cache, no call finds its
inputs in L2 from an earlier call. Model cases (``rotate=False``) are not copied: their weights
alone exceed the L2 cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

import bik
from bik.distributed import chunked_linear
from bik.families import FAMILIES, TINY_SHAPE, ExpertShape, RecurrentHeads, Shape
from bik.layers.delta_rule import gated_delta_rule
from bik.layers.paged_attention import paged_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Case:
    op: str
    shape: str
    flops: float
    bytes: float
    inputs: Callable  # (device, dtype) -> tuple: the arguments of one call
    bik: Callable  # (*arguments) -> bik's result
    baseline: Callable  # (*arguments) -> the non-invariant baseline's result
    tokens: int = 0  # end-to-end cases: tokens processed per call (for tokens/s)
    rotate: bool = True  # False: the arguments hold a model, never copied

    def make(
        self, device: torch.device, dtype: torch.dtype, copies: int = 1, args: tuple | None = None
    ) -> tuple[Callable[[], object], Callable[[], object]]:
        """(bik_fn, baseline_fn): no-argument calls over ``copies`` copies of the inputs
        (``args``: one set already built), visited in turn by one cursor both functions share."""
        args = self.inputs(device, dtype) if args is None else args
        sets = [args] + [_clone(args) for _ in range(copies - 1 if self.rotate else 0)]
        if len(sets) == 1:
            return (lambda: self.bik(*args)), (lambda: self.baseline(*args))
        cursor = itertools.cycle(sets).__next__
        return (lambda: self.bik(*cursor())), (lambda: self.baseline(*cursor()))


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def input_bytes(args) -> int:
    """Bytes of the tensors among one call's arguments (what a copy of the inputs occupies)."""
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def _randn(*shape, device, dtype):
    return torch.randn(*shape, device=device).to(dtype)


def linear(m: int, k: int, n: int, model: str = "") -> Case:
    def inputs(device, dtype):
        return _randn(m, k, device=device, dtype=dtype), _randn(n, k, device=device, dtype=dtype)

    label = f"M={m} K={k} N={n}" + (f" ({model})" if model else "")
    return Case(
        "linear", label, 2 * m * k * n, 2 * (m * k + n * k + m * n), inputs, bik.linear, F.linear
    )


def tp_linear(m: int, k: int, n: int, model: str = "") -> Case:
    """The tensor-parallel-invariant order of a row-parallel linear
    (bik.distributed.chunked_linear, TP_CHUNKS chunks: on the triton backend its tensor-core
    chunked kernel) vs F.linear."""
    return replace(linear(m, k, n, model), op="tp_linear", bik=chunked_linear)


def linear_packed(m: int, k: int, n: int) -> Case:
    """bik.linear on a weight packed once (bik.pack_weights; a no-op on GPUs) vs F.linear."""

    def inputs(device, dtype):
        layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype).requires_grad_(False)
        layer.weight.copy_(_randn(n, k, device=device, dtype=dtype))
        bik.pack_weights(layer)
        return _randn(m, k, device=device, dtype=dtype), layer

    return Case(
        "linear_packed",
        f"M={m} K={k} N={n}",
        2 * m * k * n,
        2 * (m * k + n * k + m * n),
        inputs,
        lambda x, layer: bik.linear(x, layer.weight),
        lambda x, layer: F.linear(x, layer.weight),
    )


def rms_norm(rows: int, d: int) -> Case:
    def inputs(device, dtype):
        return _randn(rows, d, device=device, dtype=dtype), _randn(d, device=device, dtype=dtype)

    return Case(
        "rms_norm",
        f"rows={rows} D={d}",
        4 * rows * d,
        2 * (2 * rows * d + d),
        inputs,
        lambda x, w: bik.rms_norm(x, w),
        lambda x, w: F.rms_norm(x, (d,), w, 1e-6),
    )


def log_softmax(rows: int, vocab: int) -> Case:
    def inputs(device, dtype):
        return (_randn(rows, vocab, device=device, dtype=dtype),)

    return Case(
        "log_softmax",
        f"rows={rows} V={vocab}",
        5 * rows * vocab,
        2 * 2 * rows * vocab,
        inputs,
        lambda x: bik.log_softmax(x),
        lambda x: torch.log_softmax(x, -1),
    )


def token_logprobs(rows: int, vocab: int) -> Case:
    def inputs(device, dtype):
        x = _randn(rows, vocab, device=device, dtype=dtype)
        return x, torch.randint(vocab, (rows,), device=device)

    def baseline(x, tokens):
        return torch.log_softmax(x.float(), -1).gather(-1, tokens[:, None])[:, 0]

    return Case(
        "token_logprobs",
        f"rows={rows} V={vocab}",
        5 * rows * vocab,
        2 * rows * vocab,
        inputs,
        bik.token_logprobs,
        baseline,
    )


def attention(
    batch: int, heads: int, kv_heads: int, tq: int, tk: int, dim: int, model: str = ""
) -> Case:
    """Decode when tq == 1 (baseline: SDPA over the whole cache), else causal prefill."""
    causal = tq > 1

    def inputs(device, dtype):
        q = _randn(batch, heads, tq, dim, device=device, dtype=dtype)
        k, v = (_randn(batch, kv_heads, tk, dim, device=device, dtype=dtype) for _ in range(2))
        return q, k, v

    def baseline(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    pairs = tq * tk / (2 if causal else 1)
    flops = 4 * batch * heads * pairs * dim
    traffic = 2 * (2 * batch * heads * tq * dim + 2 * batch * kv_heads * tk * dim)
    kind = "decode" if tq == 1 else "prefill"
    label = f"B={batch} H={heads}/{kv_heads} Tq={tq} Tk={tk} D={dim}"
    return Case(
        f"attention_{kind}",
        label + (f" ({model})" if model else ""),
        flops,
        traffic,
        inputs,
        lambda q, k, v: bik.attention(q, k, v, causal=causal),
        baseline,
    )


PAGE = 16  # tokens per KV-cache page (vLLM's default block size)


def paged_decode(batch: int, heads: int, kv_heads: int, tk: int, dim: int, model: str = "") -> Case:
    """One new token per sequence over a paged KV cache whose pages lie in shuffled order, as
    an engine leaves them: bik's paged attention (cpu: one kernel reading the block table;
    other backends: each sequence's pages gathered, then bik.attention) vs the same pages
    gathered by one index, then SDPA."""
    pages = -(-tk // PAGE)
    query_start, seq_lens = list(range(batch + 1)), [tk] * batch

    def inputs(device, dtype):
        q = _randn(batch, heads, dim, device=device, dtype=dtype)
        k, v = (
            _randn(batch * pages, kv_heads, PAGE, dim, device=device, dtype=dtype) for _ in range(2)
        )
        table = torch.randperm(batch * pages, device=device).view(batch, pages).to(torch.int32)
        return q, k, v, table

    def run_bik(q, k, v, table):
        return paged_attention(q, k, v, table, query_start, seq_lens, scale=dim**-0.5)

    def baseline(q, k, v, table):
        def gather(cache):  # [batch, kv_heads, tk, dim]
            pages_first = cache[table.long()].transpose(1, 2)
            return pages_first.reshape(batch, kv_heads, pages * PAGE, dim)[:, :, :tk]

        out = F.scaled_dot_product_attention(q.unsqueeze(2), gather(k), gather(v), enable_gqa=True)
        return out[:, :, 0]

    flops = 4 * batch * heads * tk * dim
    traffic = 2 * (2 * batch * heads * dim + 2 * batch * kv_heads * tk * dim)
    label = f"B={batch} H={heads}/{kv_heads} Tk={tk} D={dim} page={PAGE}"
    return Case(
        "attention_paged_decode",
        label + (f" ({model})" if model else ""),
        flops,
        traffic,
        inputs,
        run_bik,
        baseline,
    )


# The MoE variant: 16 experts of width hidden / 2, 4 per token (Qwen3-MoE's shape, scaled down).
MOE_EXPERTS, MOE_TOP_K = 16, 4


def _qwen_shape(
    hidden: int, layers: int, vocab: int, positions: int, recurrent: RecurrentHeads | None = None
) -> Shape:
    """The benchmarks' Qwen-style shape: head_dim 64, GQA (one KV head per 4 query heads),
    MLP 3 x hidden."""
    return Shape(
        vocab=vocab,
        hidden=hidden,
        intermediate=3 * hidden,
        layers=layers,
        heads=hidden // 64,
        kv_heads=max(1, hidden // 256),
        head_dim=64,
        positions=positions,
        recurrent=recurrent,
        full_attention_every=4,
    )


def qwen3_config(hidden: int, layers: int, vocab: int, positions: int, moe: bool = False):
    """The benchmarks' Qwen3-style config (:func:`_qwen_shape`); with ``moe``, Qwen3-MoE with
    MOE_EXPERTS experts, MOE_TOP_K per token."""
    family = FAMILIES["qwen3_moe" if moe else "qwen3"]
    experts = ExpertShape(MOE_EXPERTS, MOE_TOP_K, hidden // 2) if moe else None
    return family.config(_qwen_shape(hidden, layers, vocab, positions), experts, pad_token_id=0)


def qwen3_5_config(hidden: int, layers: int, vocab: int, positions: int):
    """A Qwen3.5-style hybrid of :func:`_qwen_shape`: three Gated DeltaNet layers in four (the
    last of each four full attention, as the model's default), linear heads of 128 (hidden /
    128 key heads, twice as many value heads)."""
    heads = RecurrentHeads(hidden // 128, 2 * (hidden // 128), 128, 128)
    shape = _qwen_shape(hidden, layers, vocab, positions, heads)
    return FAMILIES["qwen3_5_text"].config(shape, pad_token_id=0)


def family_config(
    family: str, hidden: int, layers: int, vocab: int, positions: int, engine: bool = False
):
    """``family``'s tiny preset (bik.families: its features switched on, e.g. DeepSeek-V3's
    latent attention, gpt-oss's sinks and sliding window) at ``hidden`` and ``layers`` layers,
    its layer-type pattern repeated over them; with ``engine``, the keys vLLM needs too
    (Family.engine_config)."""
    record = FAMILIES[family]
    shape = replace(TINY_SHAPE, vocab=vocab, hidden=hidden, layers=layers, positions=positions)
    return (record.engine_config if engine else record.tiny_config)(shape)


def smollm2_config(positions: int):
    """SmolLM2-135M's shapes (the embedded real model: Llama, 30 layers, hidden 576, MLP 1536,
    9 query / 3 KV heads of 64, vocabulary 49152, tied embeddings), to be randomly
    initialised."""
    shape = Shape(49152, 576, 1536, 30, 9, 3, 64, positions)
    return FAMILIES["llama"].config(shape, tie_word_embeddings=True, pad_token_id=0)


def plain_and_patched(config, device, dtype):
    import copy

    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
    patched = copy.deepcopy(plain)
    bik.patch_model(patched, pack_weights=True)  # weights packed once (a no-op on GPUs)
    return plain, patched


def moe_block(tokens: int, hidden: int) -> Case:
    """One Qwen3-MoE sparse block (router + experts), patched vs transformers' own."""

    def inputs(device, dtype):
        config = qwen3_config(hidden, 1, 1024, 64, moe=True)
        plain, patched = plain_and_patched(config, device, dtype)
        return plain, patched, _randn(1, tokens, hidden, device=device, dtype=dtype)

    def call(model, x):
        with torch.no_grad():
            return model.model.layers[0].mlp(x)

    inner = hidden // 2
    flops = 2 * tokens * (MOE_TOP_K * 3 * hidden * inner + MOE_EXPERTS * hidden)
    traffic = 2 * (MOE_EXPERTS * 3 * hidden * inner + 2 * tokens * hidden)
    label = f"T={tokens} hidden={hidden} experts={MOE_EXPERTS} top{MOE_TOP_K}"
    return Case(
        "moe_block",
        label,
        flops,
        traffic,
        inputs,
        lambda plain, patched, x: call(patched, x),
        lambda plain, patched, x: call(plain, x),
        rotate=False,
    )


def delta_rule(batch: int, tokens: int, heads: int, k_dim: int = 128, v_dim: int = 128) -> Case:
    """The gated delta rule (Gated DeltaNet's recurrence, from a cached state) vs the
    non-invariant form transformers runs without flash-linear-attention: its chunked form for
    a prompt, its recurrent form for a decode step (``tokens == 1``)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as plain

    def inputs(device, dtype):
        q, k = (_randn(batch, tokens, heads, k_dim, device=device, dtype=dtype) for _ in "qk")
        v = _randn(batch, tokens, heads, v_dim, device=device, dtype=dtype)
        g = -torch.rand(batch, tokens, heads, device=device)  # a log decay in [-1, 0]
        beta = torch.rand(batch, tokens, heads, device=device)
        state = torch.randn(batch, heads, k_dim, v_dim, device=device) / k_dim
        return q, k, v, g.to(dtype), beta.to(dtype), state

    def ours(q, k, v, g, beta, state):
        return gated_delta_rule(q, k, v, g, beta, state, use_qk_l2norm=True)

    baseline_form = (
        plain.torch_recurrent_gated_delta_rule
        if tokens == 1
        else plain.torch_chunk_gated_delta_rule
    )

    def baseline(q, k, v, g, beta, state):
        return baseline_form(
            q,
            k,
            v,
            g,
            beta,
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    # per token and head: decay, two reads and the write over the K x V state (7 K V flops);
    # the state is read and written once a call, the inputs and output once
    flops = 7 * batch * tokens * heads * k_dim * v_dim
    traffic = 8 * batch * heads * k_dim * v_dim + 2 * batch * tokens * heads * (
        2 * k_dim + 2 * v_dim
    )
    label = f"B={batch} T={tokens} H={heads} K={k_dim} V={v_dim}"
    return Case("delta_rule", label, flops, traffic, inputs, ours, baseline)


def generate_or_forward(
    model: PreTrainedModel, ids: torch.Tensor, kind: str, new_tokens: int, pad: int
) -> torch.Tensor:
    with torch.no_grad():
        if kind == "forward":
            return model(input_ids=ids).logits
        # GenerationMixin.generate: its output's type follows the flags (Any here)
        return cast(Any, model).generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
        )


def real_model(kind: str, batch: int, length: int, new_tokens: int = 16) -> Case:
    """The real model (SmolLM2-135M-Instruct, bik.testing.models: prepared on first use), patched
    with bik vs unpatched, on random token ids: one forward over ``batch x length`` tokens,
    or greedy decode of ``new_tokens`` tokens after them."""

    def inputs(device, dtype):
        import copy

        from transformers import AutoModelForCausalLM

        from . import models

        path = models.path("smollm2")
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        patched = copy.deepcopy(plain)
        bik.patch_model(patched, pack_weights=True)
        vocab = plain.config.vocab_size
        return plain, patched, torch.randint(3, vocab, (batch, length), device=device)

    pad = 2  # SmolLM2's <|im_end|>, its pad and EOS token
    call = lambda model, ids: generate_or_forward(model, ids, kind, new_tokens, pad)
    return Case(
        f"e2e_smollm2_{kind}",
        f"SmolLM2-135M B={batch} T={length}" + (f" +{new_tokens}" if kind == "decode" else ""),
        0,
        0,
        inputs,
        lambda plain, patched, ids: call(patched, ids),
        lambda plain, patched, ids: call(plain, ids),
        batch * (length if kind == "forward" else new_tokens),
        rotate=False,
    )


def end_to_end(
    kind: str,
    batch: int,
    length: int,
    hidden: int,
    layers: int,
    new_tokens: int = 16,
    moe: bool = False,
) -> Case:
    """A random-init Qwen3-style (or Qwen3-MoE) model, patched with bik vs unpatched: one
    forward over ``batch x length`` tokens, or greedy decode of ``new_tokens`` tokens after
    that prompt."""
    return _model_case(
        f"e2e_moe_{kind}" if moe else f"e2e_{kind}",
        kind,
        f"B={batch} T={length} hidden={hidden} layers={layers}",
        lambda: qwen3_config(hidden, layers, 32000, length + new_tokens, moe),
        batch,
        length,
        new_tokens,
    )


def hybrid_decode(batch: int, length: int, hidden: int, layers: int, new_tokens: int = 16) -> Case:
    """Greedy decode with a random-init Qwen3.5-style hybrid (:func:`qwen3_5_config`), patched
    (its recurrences token by token, through the backend's delta-rule kernel) vs unpatched
    (transformers' PyTorch chunked prefill and recurrent decode)."""
    return _model_case(
        "e2e_hybrid_decode",
        "decode",
        f"B={batch} T={length} hidden={hidden} layers={layers} (Qwen3.5-style)",
        lambda: qwen3_5_config(hidden, layers, 32000, length + new_tokens),
        batch,
        length,
        new_tokens,
    )


def family_decode(family: str, batch: int, length: int, layers: int, new_tokens: int = 16) -> Case:
    """Greedy decode with a random-init model of :func:`family_config` at hidden 512 and
    ``layers`` layers, patched vs unpatched."""

    def config():
        return family_config(family, 512, layers, 32000, max(4096, length + new_tokens))

    return _model_case(
        f"e2e_{family}_decode",
        "decode",
        f"B={batch} T={length} hidden=512 layers={layers} ({FAMILIES[family].name} tiny preset)",
        config,
        batch,
        length,
        new_tokens,
    )


def smollm2_decode(batch: int, length: int, new_tokens: int = 16) -> Case:
    """Greedy decode with a random-init model of SmolLM2-135M's shapes, patched vs unpatched."""
    return _model_case(
        "e2e_decode",
        "decode",
        f"B={batch} T={length} (SmolLM2-135M shapes)",
        lambda: smollm2_config(length + new_tokens),
        batch,
        length,
        new_tokens,
    )


def _model_case(op, kind, label, make_config, batch, length, new_tokens) -> Case:
    def inputs(device, dtype):
        config = make_config()
        plain, patched = plain_and_patched(config, device, dtype)
        ids = torch.randint(1, config.vocab_size, (batch, length), device=device)
        return plain, patched, ids

    call = lambda model, ids: generate_or_forward(model, ids, kind, new_tokens, 0)

    tokens = batch * (length if kind == "forward" else new_tokens)
    return Case(
        op,
        label,
        0,
        0,
        inputs,
        lambda plain, patched, ids: call(patched, ids),
        lambda plain, patched, ids: call(plain, ids),
        tokens,
        rotate=False,
    )


def cpu_cases(quick: bool) -> list[Case]:
    """A small transformer on a CPU: hidden 256-1024, rows 1-4096, decode over 128-2048 keys."""
    if quick:
        return [
            linear(1, 256, 256),
            linear(64, 256, 256),
            rms_norm(64, 256),
            log_softmax(16, 4096),
            token_logprobs(16, 4096),
            attention(1, 4, 4, 1, 256, 64),
            attention(1, 4, 4, 64, 64, 64),
            moe_block(16, 256),
            delta_rule(1, 64, 2, 64, 64),
            end_to_end("forward", 2, 32, 256, 2),
        ]
    cases = [linear(m, h, h) for h in (256, 1024) for m in (1, 64, 256, 1024, 4096)]
    decode_shapes = ((1024, 1024), (512, 1536), (1536, 512), (512, 32000))
    cases += [linear_packed(m, k, n) for m in (1, 4, 16) for k, n in decode_shapes]
    cases += [rms_norm(r, d) for d in (256, 1024) for r in (1, 64, 4096)]
    cases += [log_softmax(r, 32000) for r in (1, 64, 256)]
    cases += [token_logprobs(r, 32000) for r in (1, 64, 256)]
    cases += [attention(b, 8, 8, 1, t, 64) for b in (1, 8) for t in (128, 512, 2048)]
    cases += [attention(1, 8, 8, 512, 512, 64)]
    cases += [end_to_end("forward", 4, 256, 512, 4), end_to_end("decode", 4, 64, 512, 4)]
    cases += [moe_block(t, 512) for t in (1, 64, 1024)]
    cases += [delta_rule(b, t, 4) for b, t in ((1, 1), (8, 1), (1, 256), (4, 512))]
    cases += [family_decode(family, 4, 64, 4) for family in ("deepseek_v3", "gpt_oss")]
    cases += [end_to_end("forward", 4, 256, 512, 4, moe=True)]
    cases += [end_to_end("decode", 4, 64, 512, 4, moe=True)]
    cases += [real_model("forward", 4, 256), real_model("decode", 4, 64)]
    return cases


# Linear layers of Llama / Qwen models from 1B to 8B, (model and layer, K, N) with
# y = x @ W.T, W [N, K]; from the models' published configs (hidden, intermediate, heads,
# KV heads, vocab).
LINEAR_SHAPES = [
    ("Llama-3.2-1B q/o", 2048, 2048),
    ("Llama-3.2-1B gate/up", 2048, 8192),
    ("Llama-3.2-1B down", 8192, 2048),
    ("Qwen2.5-1.5B gate/up", 1536, 8960),
    ("Qwen2.5-1.5B down", 8960, 1536),
    ("Llama-3.1-8B q/o", 4096, 4096),
    ("Llama-3.1-8B k/v", 4096, 1024),
    ("Llama-3.1-8B gate/up", 4096, 14336),
    ("Llama-3.1-8B down", 14336, 4096),
    ("Qwen2.5-7B gate/up", 3584, 18944),
    ("Qwen2.5-7B down", 18944, 3584),
]
ROW_PARALLEL_SHAPES = [  # what tensor parallelism splits along K: o_proj and down_proj
    ("Llama-3.1-8B o", 4096, 4096),
    ("Llama-3.1-8B down", 14336, 4096),
]
DECODE_ROWS, PREFILL_ROWS = (1, 16, 64), (2048, 8192)  # M: decode batches, prefill tokens
LM_HEAD = ("Llama-3.1-8B lm_head", 4096, 128256)


def cuda_cases(quick: bool) -> list[Case]:
    """Llama / Qwen 1-8B shapes: their linear layers at M <= 64 (decode) and M >= 2048
    (prefill, training); GQA decode over 1k-32k keys (and 8k through a paged cache), causal
    prefill of 512-8k tokens; RMSNorm at hidden 2048-4096, log-softmax over 32k-152k
    vocabularies; patched models end to end (SmolLM2-135M's shapes among them)."""
    if quick:
        return [linear(m, 4096, 4096, "Llama-3.1-8B q/o") for m in (1, 64, 2048)] + [
            rms_norm(2048, 4096),
            log_softmax(64, 32000),
            attention(1, 32, 8, 1, 8192, 128, "Llama-3.1-8B"),
            attention(1, 32, 8, 2048, 2048, 128, "Llama-3.1-8B"),
            end_to_end("decode", 4, 128, 1024, 4),
        ]
    rows = DECODE_ROWS + PREFILL_ROWS
    cases = [linear(m, k, n, model) for model, k, n in LINEAR_SHAPES for m in rows]
    cases += [linear(m, LM_HEAD[1], LM_HEAD[2], LM_HEAD[0]) for m in (1, 64, 2048)]
    cases += [tp_linear(m, k, n, model) for model, k, n in ROW_PARALLEL_SHAPES for m in rows]
    cases += [rms_norm(r, d) for d in (2048, 3584, 4096) for r in (1, 64, 2048, 8192)]
    cases += [log_softmax(r, v) for v in (32000, 128256, 152064) for r in (1, 64, 2048)]
    cases += [token_logprobs(r, v) for v in (128256, 152064) for r in (64, 2048)]
    llama, qwen = (32, 8, "Llama-3.1-8B"), (28, 4, "Qwen2.5-7B")
    cases += [
        attention(b, h, kv, 1, t, 128, model)
        for h, kv, model in (llama, qwen)
        for b in (1, 16)
        for t in (1024, 8192, 32768)
    ]
    cases += [attention(1, 32, 8, t, t, 128, "Llama-3.1-8B") for t in (512, 2048, 8192)]
    cases += [paged_decode(b, 32, 8, 8192, 128, "Llama-3.1-8B") for b in (1, 16)]
    cases += [end_to_end("forward", 8, 2048, 2048, 8), end_to_end("decode", 16, 512, 2048, 8)]
    cases += [smollm2_decode(16, 512), hybrid_decode(16, 512, 2048, 8, 8)]
    cases += [moe_block(t, 2048) for t in (1, 256, 8192)]
    cases += [end_to_end("forward", 8, 2048, 2048, 8, moe=True)]
    cases += [real_model("forward", 8, 2048), real_model("decode", 16, 512)]
    return cases


def cases_for(device_type: str, quick: bool) -> list[Case]:
    """The cases run on a device of this type (building a case allocates nothing)."""
    return cuda_cases(quick) if device_type == "cuda" else cpu_cases(quick)


def all_ops() -> list[str]:
    """Every op some case list times, in first-seen order (what ``--ops`` accepts)."""
    lists = (cases_for(kind, quick) for kind in ("cpu", "cuda") for quick in (True, False))
    return list(dict.fromkeys(case.op for cases in lists for case in cases))
