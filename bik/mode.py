"""A global batch-invariant mode: aten ops overridden through torch.library.

Inside ``with bik.batch_invariant_mode():`` (or between ``enable_batch_invariant_mode()`` and
``disable_batch_invariant_mode()``) unmodified torch code runs the aten ops below on bik's
fixed-order kernels, for CPU and CUDA tensors of dtype float32, bfloat16 or float16. Autograd
formulas of these ops call the same overrides, and composite ops reach them through their
decompositions.

Covered, with their ``out=`` and in-place forms:
  * products: mm, addmm, bmm, baddbmm, addbmm, mv, addmv, dot, vdot, _addmm_activation; and
    through them matmul / ``@`` (all ranks), linear, einsum's and tensordot's products, inner,
    chain_matmul, linalg.multi_dot. Every product is bik's matmul in the linear form
    ``rows @ b``: mv(W, x) and dot(x, y) give the bits of x's row in ``x @ W.T`` and
    ``x @ y[:, None]``; addbmm sums its batches as one long K in ascending (batch, k) order.
    ``beta * input + alpha * product`` is applied elementwise after the product (a 1-D input
    with beta = alpha = 1 is added in the fp32 epilogue instead); beta = 0 ignores the input,
    so NaN / Inf in it do not propagate, and alpha = 0 skips the product, as torch does.
  * CUDA kernels torch has only there: mm / bmm / addmm / baddbmm with ``out_dtype`` (fp32
    result of a 16-bit product), _grouped_mm (MoE experts), _foreach_mm. On CPU torch
    decomposes _grouped_mm and _foreach_mm into mm / bmm, which are covered.
  * _log_softmax and _softmax along any dim, 0-d inputs included (contiguous results, as
    torch's), and mean.dim.
  * the CPU flash SDPA kernel, grouped-query attention (``enable_gqa=True``) included.
  * silu and sigmoid (bik.ops.activations' formulas): torch's own fp32 kernels give an
    element different bits in their vector body and their scalar tail, so an MoE block's
    shared-expert gate ``sigmoid(x @ w)`` of shape [T, 1] would depend on T.
Refused with NotImplementedError (bik has no invariant kernel for them): fp8 and
weight-quantised matmuls (_scaled_mm, _scaled_grouped_mm, _weight_int8pack_mm,
_weight_int4pack_mm and variants, _dyn_quant_matmul_4bit, _mixed_dtypes_linear) and 2:4-sparse
ones (_cslt_sparse_mm, _sparse_semi_structured_*); so are other dtypes in the covered ops, and
SDPA with an explicit attn_mask, dropout, or is_causal with Tq != Tk (torch aligns such a
causal mask top-left; bik's queries are the last Tq keys): use bik.attention directly.
Left to torch: integer matmul (_int_mm; integer sums do not depend on the order), sparse and
quantised tensor layouts, other elementwise ops (gelu among them), reductions not overridden
here (sum, var, norm, cumsum, linalg.vecdot, einsum's single-operand sums, convolutions) and
other attention kernels (the CUDA SDPA kernels, nn.MultiheadAttention's fused path): they keep
torch's shape-dependent order.
"""

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from . import _checks, backends
from .contract import FLOAT_DTYPES
from .ops.activations import sigmoid, silu
from .ops.attention import attention
from .ops.log_softmax import log_softmax

_library: torch.library.Library | None = None


def _backend(device: torch.device, op: str = "matmul") -> backends.Backend:
    backend = backends.resolve(device, op)
    if not backend.invariant:
        raise RuntimeError(
            f"bik batch_invariant_mode: the selected backend {backend.name!r} is not "
            "batch-invariant; select an invariant one (bik.set_backend('auto'))"
        )
    return backend


def _arg(op: str, name: str) -> str:
    return f"{name} of aten.{op}"


def _covered(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise NotImplementedError(
            f"bik batch_invariant_mode: {_arg(op, name)} is {t.dtype}; only float32, bfloat16 "
            "and float16 are covered: cast it, or run this op outside the mode"
        )


# --- products ------------------------------------------------------------------------------


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a [B, M, K] @ b [B, K, N] (+ bias [N])``, operands already checked, on the backend's
    fixed-order kernel."""
    batch, m, k = a.shape
    n = b.shape[2]
    if not (batch and m and n and k):
        out = a.new_zeros(batch, m, n)
        return out if bias is None else out + bias
    # Kernels read rows of a (and the bias) contiguously; b may have any strides (W^T views).
    if a.stride(-1) != 1:
        a = a.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    return _backend(a.device).kernel("matmul")(a, b, bias)


def _operands(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor, rank: int):
    """Float dtype, rank, matching dtype / device, K (and batch for rank 3) of ``a @ b``."""
    for name, t in ((a_name, a), (b_name, b)):
        _covered(op, name, t)
        _checks.rank(_arg(op, name), t, rank)
    _checks.same_dtype(_arg(op, b_name), b, a_name, a)
    _checks.same_device(_arg(op, b_name), b, a_name, a)
    _checks.dim_size(_arg(op, b_name), b, rank - 2, a.shape[-1], f"K, the last dim of {a_name}")
    if rank == 3:
        _checks.dim_size(_arg(op, b_name), b, 0, a.shape[0], f"the batch of {a_name}")


def _vector(op: str, name: str, v: torch.Tensor, size: int, what: str, ref_name, ref) -> None:
    _covered(op, name, v)
    _checks.rank(_arg(op, name), v, 1)
    _checks.same_dtype(_arg(op, name), v, ref_name, ref)
    _checks.same_device(_arg(op, name), v, ref_name, ref)
    _checks.dim_size(_arg(op, name), v, 0, size, what)


def _plus_input(op, product, input, beta, alpha, shape: torch.Size, ref_name, ref):
    """``beta * input + alpha * product(None)`` with torch's rules for beta = 0 / alpha = 0;
    a 1-D input with beta = alpha = 1 goes into the product's fp32 epilogue, ``product(input)``."""
    _covered(op, "self", input)
    _checks.same_dtype(_arg(op, "self"), input, ref_name, ref)
    _checks.same_device(_arg(op, "self"), input, ref_name, ref)
    try:
        broadcastable = torch.broadcast_shapes(input.shape, shape) == shape
    except RuntimeError:
        broadcastable = False
    if not broadcastable:
        raise ValueError(
            f"{_arg(op, 'self')}: expected a shape broadcastable to {tuple(shape)}, "
            f"got {tuple(input.shape)}"
        )
    if beta == 1 and alpha == 1 and input.shape == shape[-1:]:
        return product(input)
    # alpha = 0: like BLAS, torch does not read the matrices (their NaN do not propagate).
    out = product(None) if alpha != 0 else ref.new_zeros(shape)
    if alpha not in (0, 1):
        out = out * alpha
    if beta != 0:  # beta = 0: torch ignores the input, NaN and Inf included
        out = out + (input if beta == 1 else input * beta)
    return out


def _mm(op: str, self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    _operands(op, "self", self, "mat2", mat2, 2)
    return _matmul(self[None], mat2[None])[0]


def _bmm(op: str, self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    _operands(op, "self", self, "mat2", mat2, 3)
    return _matmul(self, mat2)


def _addmm(op, self, mat1, mat2, *, beta=1, alpha=1):
    _operands(op, "mat1", mat1, "mat2", mat2, 2)
    shape = torch.Size((mat1.shape[0], mat2.shape[1]))
    product = lambda bias: _matmul(mat1[None], mat2[None], bias)[0]
    return _plus_input(op, product, self, beta, alpha, shape, "mat1", mat1)


def _addmm_activation(op, self, mat1, mat2, *, beta=1, alpha=1, use_gelu=False):
    out = _addmm(op, self, mat1, mat2, beta=beta, alpha=alpha)
    if not use_gelu:
        return F.relu(out)
    # torch's CUDA kernel applies cuBLASLt's tanh GELU, its CPU kernel the exact one.
    return F.gelu(out, approximate="tanh" if out.device.type == "cuda" else "none")


def _baddbmm(op, self, batch1, batch2, *, beta=1, alpha=1):
    _operands(op, "batch1", batch1, "batch2", batch2, 3)
    shape = torch.Size((batch1.shape[0], batch1.shape[1], batch2.shape[2]))
    product = lambda bias: _matmul(batch1, batch2, bias)
    return _plus_input(op, product, self, beta, alpha, shape, "batch1", batch1)


def _addbmm(op, self, batch1, batch2, *, beta=1, alpha=1):
    _operands(op, "batch1", batch1, "batch2", batch2, 3)
    batch, m, k = batch1.shape
    n = batch2.shape[2]
    # The batches form one long K, so each output element sums its (batch, k) terms in one
    # fixed ascending order (not a sum of per-batch rounded products).
    a = batch1.transpose(0, 1).reshape(1, m, batch * k)
    b = batch2.reshape(1, batch * k, n)
    product = lambda bias: _matmul(a, b, bias)[0]
    return _plus_input(op, product, self, beta, alpha, torch.Size((m, n)), "batch1", batch1)


def _matvec(mat: torch.Tensor, vec: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The linear form: vec is the one row and mat^T the weight, so mv(W, x) is x's row of x @ W.T.
    return _matmul(vec[None, None], mat.t()[None], bias)[0, 0]


def _mv(op: str, self: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    _covered(op, "self", self)
    _checks.rank(_arg(op, "self"), self, 2)
    _vector(op, "vec", vec, self.shape[1], "K, the last dim of self", "self", self)
    return _matvec(self, vec, None)


def _addmv(op, self, mat, vec, *, beta=1, alpha=1):
    _covered(op, "mat", mat)
    _checks.rank(_arg(op, "mat"), mat, 2)
    _vector(op, "vec", vec, mat.shape[1], "K, the last dim of mat", "mat", mat)
    product = lambda bias: _matvec(mat, vec, bias)
    return _plus_input(op, product, self, beta, alpha, torch.Size(mat.shape[:1]), "mat", mat)


def _dot(op: str, self: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    # vdot conjugates its first argument: the same as dot for the real dtypes covered.
    _covered(op, "self", self)
    _checks.rank(_arg(op, "self"), self, 1)
    _vector(op, "tensor", tensor, self.shape[0], "the size of self", "self", self)
    return _matmul(self[None, None], tensor[None, :, None])[0, 0, 0]


def _with_out_dtype(op: str, fn: Callable) -> Callable:
    """The ``out_dtype`` overload (``op.dtype``) of a product: positional args, then out_dtype."""

    def kernel(*args, **kwargs):
        *tensors, out_dtype = args
        dtype = tensors[-1].dtype
        if out_dtype != dtype:
            if out_dtype != torch.float32 or dtype not in (torch.bfloat16, torch.float16):
                raise ValueError(
                    f"{_arg(op, 'out_dtype')}: expected {dtype} or, for float16 / bfloat16 "
                    f"operands, torch.float32; got {out_dtype}"
                )
            # 16-bit products are exact in fp32, so this is the fp32 accumulation of the
            # operands' products, returned without the final rounding to 16 bits.
            tensors = [t.float() for t in tensors]
        return fn(*tensors, **kwargs)

    return kernel


def _grouped_mm(op, self, mat2, offs=None, bias=None, out_dtype=None):
    """torch's grouped GEMM (one weight per expert), group by group on bik's matmul."""
    _covered(op, "self", self)
    _covered(op, "mat2", mat2)
    _checks.same_dtype(_arg(op, "mat2"), mat2, "self", self)
    _checks.same_device(_arg(op, "mat2"), mat2, "self", self)
    if bias is not None:
        raise ValueError(f"{_arg(op, 'bias')}: expected None (torch's kernel has no bias either)")
    # torch's own checks of shapes, offs and out_dtype, run on shape-only (meta) copies
    meta = lambda t: None if t is None else torch.empty_like(t, device="meta")
    torch.ops.aten._grouped_mm(meta(self), meta(mat2), meta(offs), None, out_dtype)
    out_dtype = out_dtype or self.dtype
    a, b = (self, mat2) if out_dtype == self.dtype else (self.float(), mat2.float())
    ends = [] if offs is None else offs.tolist()
    starts = [0, *ends[:-1]]
    grouped = {(2, 3): a.shape[0], (3, 2): b.shape[1], (2, 2): a.shape[1]}.get((a.dim(), b.dim()))
    if any(e < s for s, e in zip(starts, ends)) or (ends and ends[-1] > grouped):
        raise ValueError(
            f"{_arg(op, 'offs')}: expected non-decreasing group ends in [0, {grouped}], got {ends}"
        )
    if a.dim() == 3 and b.dim() == 3:
        return _matmul(a, b).to(out_dtype)
    if a.dim() == 2 and b.dim() == 3:  # rows (tokens) grouped by expert
        out = a.new_zeros(a.shape[0], b.shape[2])  # rows past the last group stay zero
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = _matmul(a[None, s:e], b[g : g + 1])[0]
    elif a.dim() == 3:  # output columns grouped
        out = a.new_zeros(a.shape[1], b.shape[1])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[:, s:e] = _matmul(a[g : g + 1], b[None, :, s:e])[0]
    else:  # K grouped: one product per group (zeros for an empty group)
        out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[g] = _matmul(a[None, :, s:e], b[None, s:e])[0]
    return out.to(out_dtype)


def _foreach_mm(op: str, self: list, mat2: list) -> list:
    if len(self) != len(mat2):
        raise ValueError(f"{_arg(op, 'mat2')}: expected {len(self)} tensors, got {len(mat2)}")
    return [_mm(op, a, b) for a, b in zip(self, mat2)]


def _refuse(op: str, what: str) -> Callable:
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"bik batch_invariant_mode: aten.{op} ({what}) has no batch-invariant kernel in "
            "bik; use dense float32 / bfloat16 / float16 weights and a plain matmul "
            "(nn.Linear, bik.linear), or run this op outside the mode"
        )

    return kernel


# --- row-wise ops --------------------------------------------------------------------------


def _log_softmax(op, self, dim, half_to_float):
    _covered(op, "self", self)
    _backend(self.device, "log_softmax")  # refuses a non-invariant backend
    if self.dim() == 0:  # torch treats a 0-d tensor as one element along dim 0 / -1
        return _log_softmax(op, self.reshape(1), dim, half_to_float).reshape(())
    out_dtype = torch.float32 if half_to_float else self.dtype
    moved = self.movedim(dim, -1)  # IndexError for a bad dim, as torch
    # torch returns a contiguous tensor whatever the dim and the input's layout.
    return log_softmax(moved, dtype=out_dtype).movedim(-1, dim).contiguous()


def _softmax(op, self, dim, half_to_float):
    out_dtype = torch.float32 if half_to_float else self.dtype
    return _log_softmax(op, self, dim, True).exp().to(out_dtype)


def _reduced_dims(op: str, dim, ndim: int) -> list[int]:
    """``dim`` of a reduction, wrapped and sorted; None or [] means every dim (torch's rule)."""
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    size = max(ndim, 1)  # a 0-d tensor accepts dim 0 and -1
    for d in dims:
        if not -size <= d < size:
            raise IndexError(
                f"Dimension out of range (expected to be in range of [{-size}, {size - 1}], "
                f"but got {d})"
            )
    wrapped = sorted(d % size for d in dims)
    if len(set(wrapped)) != len(wrapped):
        raise ValueError(f"{_arg(op, 'dim')}: expected distinct dims, got {dims}")
    return wrapped


def _mean_dim(op, self, dim, keepdim=False, *, dtype=None):
    _covered(op, "self", self)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        # a float64 mean would need float64 accumulation, which bik's kernels do not do
        raise NotImplementedError(
            f"{op} under batch_invariant_mode: dtype={dtype} is not covered (bik accumulates "
            "in float32); compute the mean outside the mode, or pass a float32, bfloat16 or "
            "float16 dtype"
        )
    dims = _reduced_dims(op, dim, self.dim())
    if self.dim() == 0:
        return _mean_dim(op, self.reshape(1), [0], False, dtype=dtype).reshape(())
    kept = [d for d in range(self.dim()) if d not in dims]
    kept_shape, count = [self.shape[d] for d in kept], math.prod(self.shape[d] for d in dims)
    rows = self.permute(*kept, *dims).reshape(math.prod(kept_shape), count).float()
    # One fixed-order sum per row: a matmul with a ones column (ascending k, fp32).
    ones = torch.ones(1, count, 1, device=self.device)
    total = _matmul(rows[None], ones)[0, :, 0]
    out = (total / count).reshape(kept_shape)  # an empty row gives 0 / 0 = NaN, as torch
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out.to(dtype or self.dtype)


# --- activations ---------------------------------------------------------------------------


def _activation(fn: Callable) -> Callable:
    def kernel(op, self):
        if not self.is_floating_point():  # torch computes integer inputs in the default dtype
            self = self.to(torch.get_default_dtype())
        return fn(self)

    return kernel


# --- attention -----------------------------------------------------------------------------


def _sdpa_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    op = "_scaled_dot_product_flash_attention_for_cpu"
    for name, t in (("query", query), ("key", key), ("value", value)):
        _covered(op, name, t)
    if attn_mask is not None or dropout_p or (is_causal and query.shape[2] != key.shape[2]):
        raise NotImplementedError(
            "bik batch_invariant_mode: SDPA with attn_mask, dropout, or is_causal with Tq != Tk "
            "is not covered; call bik.attention with kv_start instead"
        )
    _backend(query.device, "attention")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = attention(query, key, value, causal=is_causal, scale=scale)  # GQA natively
    # logsumexp is only read by torch's backward kernel: plain fp32 math (deterministic), the
    # kv heads repeated for GQA the way that kernel pairs them (query head h, kv head h // g).
    k = key.float().repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = torch.matmul(query.float(), k.transpose(-1, -2)) * scale
    if is_causal:
        scores = scores.masked_fill(
            torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf")
        )
    return out, torch.logsumexp(scores, dim=-1)


# --- out= and in-place forms ---------------------------------------------------------------


def _out_form(op: str, fn: Callable) -> Callable:
    """The ``out=`` overload ``op`` of ``fn``: bik's result written into ``out`` as torch does."""

    def kernel(*args, out, **kwargs):
        result = fn(*args, **kwargs)
        _checks.same_device(_arg(op, "out"), out, "the result", result)
        if out.dtype != result.dtype:
            raise TypeError(
                f"{_arg(op, 'out')}: expected dtype {result.dtype} (the result's), got {out.dtype}"
            )
        if out.shape != result.shape:
            if out.numel():  # torch's deprecation warning; an empty out is resized silently
                warnings.warn(
                    f"An output with one or more elements was resized since it had shape "
                    f"{list(out.shape)}, which does not match the required output shape "
                    f"{list(result.shape)}.",
                    UserWarning,
                    stacklevel=2,
                )
            out.resize_(result.shape)
        return out.copy_(result)

    return kernel


def _inplace_form(op: str, fn: Callable) -> Callable:
    def kernel(self, *args, **kwargs):
        result = fn(self, *args, **kwargs)
        if result.shape != self.shape:
            raise ValueError(
                f"{_arg(op, 'self')}: expected shape {tuple(result.shape)} (the result's; an "
                f"in-place op does not broadcast self), got {tuple(self.shape)}"
            )
        return self.copy_(result)

    return kernel


# --- registration --------------------------------------------------------------------------

# aten op -> (bik kernel, its out= overload, its in-place overload), on CPU and CUDA
_COVERED_FORMS: dict[str, tuple[Callable[..., torch.Tensor], str, str | None]] = {
    "mm": (_mm, "mm.out", None),
    "addmm": (_addmm, "addmm.out", "addmm_"),
    "bmm": (_bmm, "bmm.out", None),
    "baddbmm": (_baddbmm, "baddbmm.out", "baddbmm_"),
    "addbmm": (_addbmm, "addbmm.out", "addbmm_"),
    "mv": (_mv, "mv.out", None),
    "addmv": (_addmv, "addmv.out", "addmv_"),
    "dot": (_dot, "dot.out", None),
    "vdot": (_dot, "vdot.out", None),
    "_addmm_activation": (_addmm_activation, "_addmm_activation.out", None),
    "_log_softmax": (_log_softmax, "_log_softmax.out", None),
    "_softmax": (_softmax, "_softmax.out", None),
    "mean.dim": (_mean_dim, "mean.out", None),
    "silu": (_activation(silu), "silu.out", "silu_"),
    "sigmoid": (_activation(sigmoid), "sigmoid.out", "sigmoid_"),
}

# What torch has only as CUDA kernels (on CPU it decomposes them into covered ops).
_CUDA_ONLY_FORMS: dict[str, tuple[Callable[..., torch.Tensor], str]] = {
    "mm.dtype": (_mm, "mm.dtype_out"),
    "bmm.dtype": (_bmm, "bmm.dtype_out"),
    "addmm.dtype": (_addmm, "addmm.dtype_out"),
    "baddbmm.dtype": (_baddbmm, "baddbmm.dtype_out"),
}

_REFUSED = {
    "_scaled_mm": "fp8 matmul",
    "_scaled_mm.out": "fp8 matmul",
    "_scaled_mm_v2": "fp8 matmul",
    "_scaled_mm_v2.out": "fp8 matmul",
    "_scaled_grouped_mm": "fp8 grouped matmul",
    "_scaled_grouped_mm_v2": "fp8 grouped matmul",
    "_weight_int8pack_mm": "int8 weight-only matmul",
    "_weight_int4pack_mm": "int4 weight-only matmul",
    "_weight_int4pack_mm_for_cpu": "int4 weight-only matmul",
    "_weight_int4pack_mm_with_scales_and_zeros": "int4 weight-only matmul",
    "_dyn_quant_matmul_4bit": "4-bit dynamically quantised matmul",
    "_mixed_dtypes_linear": "mixed-dtype quantised linear",
    "_cslt_sparse_mm": "2:4-sparse matmul",
    "_sparse_semi_structured_linear": "2:4-sparse matmul",
    "_sparse_semi_structured_mm": "2:4-sparse matmul",
    "_sparse_semi_structured_addmm": "2:4-sparse matmul",
}


def _exists(overload: str) -> bool:
    """Whether this torch has the aten ``overload`` ("name" or "name.overload")."""
    name, _, variant = overload.partition(".")
    try:
        return (variant or "default") in getattr(torch.ops.aten, name).overloads()
    except (AttributeError, RuntimeError):  # an op this torch does not have
        return False


def _build() -> tuple[dict[str, Callable], dict[str, Callable]]:
    both: dict[str, Callable] = {}
    cuda: dict[str, Callable] = {}
    for op, (fn, out, inplace) in _COVERED_FORMS.items():
        both[op] = functools.partial(fn, op)
        if out:
            both[out] = _out_form(out, functools.partial(fn, out))
        if inplace:
            both[inplace] = _inplace_form(inplace, functools.partial(fn, inplace))
    for op, (fn, out) in _CUDA_ONLY_FORMS.items():
        cuda[op] = _with_out_dtype(op, functools.partial(fn, op))
        cuda[out] = _out_form(out, _with_out_dtype(out, functools.partial(fn, out)))
    cuda["_grouped_mm"] = functools.partial(_grouped_mm, "_grouped_mm")
    cuda["_foreach_mm"] = functools.partial(_foreach_mm, "_foreach_mm")
    for op, what in _REFUSED.items():
        both[op] = _refuse(op, what)
    keep = lambda table: {op: fn for op, fn in table.items() if _exists(op)}
    return keep(both), keep(cuda)


_BOTH, _CUDA_ONLY = _build()


def enable_batch_invariant_mode() -> None:
    """Route the covered aten ops of CPU and CUDA tensors through bik (idempotent)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    for key in ("CPU", "CUDA"):
        for op, fn in _BOTH.items():
            library.impl(op, fn, key)
    for op, fn in _CUDA_ONLY.items():
        library.impl(op, fn, "CUDA")
    library.impl("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu, "CPU")
    _library = library


def disable_batch_invariant_mode() -> None:
    """Restore torch's own kernels."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


def is_batch_invariant_mode_enabled() -> bool:
    return _library is not None


@contextlib.contextmanager
def batch_invariant_mode() -> Iterator[None]:
    """Context manager form of :func:`enable_batch_invariant_mode`; restores the previous state."""
    was_enabled = is_batch_invariant_mode_enabled()
    enable_batch_invariant_mode()
    try:
        yield
    finally:
        if not was_enabled:
            disable_batch_invariant_mode()
