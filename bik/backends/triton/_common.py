"""Pieces shared by the Triton kernels, and what every launch pins.

The bits a GPU binary produces depend on what the compiler was allowed to choose, so every
launch goes through :class:`Launch`, which fixes the choices that would otherwise be left to
chance (docs/design.md, "GPU binaries"):

- FP contraction: ``enable_fp_fusion`` is passed explicitly (:data:`FP_FUSION`), so a
  multiply feeding an add rounds the same way whatever a Triton release's default is.
- Specialisation: Triton compiles a separate binary for an integer argument equal to 1 or
  divisible by 16, and for a pointer aligned to 16 bytes. Kernels name their batch-like
  integers (rows, query and key lengths, split counts, strides that scale with them) in
  ``do_not_specialize``; :func:`aligned` copies a tensor whose storage is not 16-byte aligned,
  so the binary never changes with a view's offset.
- Warps and stages are part of the launch, never left to a default that may change.

A launch on a GPU goes through a plan (:class:`LaunchPlans`): the first launch of a
specialisation compiles and launches through ``kernel[grid]`` as usual and keeps the compiled
kernel; every later launch with the same specialisation calls that compiled kernel directly,
skipping Triton's binder and cache lookup (2-37 us of host time a call on an H200 host:
benchmarks/README.md). The plan's key is a superset of what Triton's binder specialises on,
so a plan always runs the binary ``kernel[grid]`` would: read off every argument, or, for the
hot decode launches (linear, rms_norm, attention, log_softmax, token_logprobs), given by the
launcher from the few facts that decide it (``Launch.plan_key``, tested to decide the
argument key over a grid of shapes; on a 2-core AMD EPYC a linear's launch side took 12.2 ->
9.1 us with it, a decode attention's 37.4 -> 26.7 us, token_logprobs' 14.9 -> 10.2 us).

``bik.testing.sm90`` compiles the same :class:`Launch` descriptions for Hopper with no GPU and
reads the instructions they became.
"""

import operator
import os
import warnings
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

# Read once, as triton.jit does: under the interpreter the kernels run on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

FP_FUSION = False
"""No FMA contraction: every rounding the kernel source writes happens, as in the interpreter
(fp32 ``tl.dot`` still lowers to FMA: that is the dot's own, fixed, definition)."""

ALIGNMENT = 16
"""Bytes: the pointer alignment every kernel is compiled for (see :func:`aligned`)."""


LAUNCH_PLANS = os.environ.get("BIK_LAUNCH_PLANS", "1") != "0"
"""Whether GPU launches reuse a compiled kernel directly (:class:`LaunchPlans`);
``BIK_LAUNCH_PLANS=0`` sends every launch through ``kernel[grid]`` (same binaries, same bits)."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``triton.cdiv`` costs microseconds a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), in host integer arithmetic."""
    return 1 << max(n - 1, 0).bit_length()


def upcast_dot_operands(dtype):
    """The interpreter stores bfloat16 as raw uint16 and cannot feed it to a matmul; there the
    operands are widened to fp32 first (exact: a bf16 x bf16 product fits in fp32)."""
    return INTERPRET and dtype == torch.bfloat16


def alignments(*tensors: torch.Tensor) -> tuple[bool, ...]:
    """Whether each tensor starts 16-byte aligned: the part of a plan key Triton's binder reads
    off a pointer."""
    return tuple(t.data_ptr() % ALIGNMENT == 0 for t in tensors)


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it when its first element is not :data:`ALIGNMENT`-byte aligned
    (a view into the middle of a buffer), so every launch sees the alignment it was compiled
    for. Meta tensors (the sm_90a compile check) have no address and pass through."""
    if tensor.device.type == "meta" or tensor.data_ptr() % ALIGNMENT == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


SELF_CHECK_DEVICES = ("cuda",)
"""Where a launch choice meant to keep every bit of a plainer one (a token bucket, TMA loads,
the grouped linear kernel) is checked on the device before its first use (:class:`SelfCheck`)."""


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is recording on ``device``'s current stream (no host sync then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SelfCheck:
    """A launch choice that must give the bits of a plainer one, proven once per key on a
    device of :data:`SELF_CHECK_DEVICES` before its first use. No document promises that a
    GPU binary keeps the bits the interpreter tests show, so the device itself is asked: a
    check that fails, or raises, warns once and keeps the plain choice for that key. While a
    CUDA graph records (no host sync) an unchecked key takes the plain choice and stays
    unchecked, or, where the plain choice cannot be captured (``capturable=False``), is
    refused."""

    def __init__(self, what: str, capturable: bool = True) -> None:
        self.what, self.capturable = what, capturable
        self.results: dict[tuple, bool] = {}

    def allows(self, key: tuple, device: torch.device, check: Callable[[], bool]) -> bool:
        """Whether the choice may run for ``key`` on ``device`` (``check`` proves it)."""
        if device.type not in SELF_CHECK_DEVICES:
            return True
        slot = (*key, device)
        if slot not in self.results and capturing(device):
            if self.capturable:
                return False
            raise RuntimeError(
                f"bik triton: {self.what} is not checked yet for {key} on {device}, and the "
                "check cannot run while a CUDA graph records: run one eager call first"
            )
        if slot not in self.results:
            try:
                self.results[slot], why = check(), "changed bits"
            except Exception as error:  # a check that cannot run proves nothing
                self.results[slot], why = False, f"could not be checked ({error!r})"
            if not self.results[slot]:
                warnings.warn(
                    f"bik triton: {self.what} {why} for {key} on {device}; the plain "
                    "launch runs for it instead (bit-exact, slower)",
                    stacklevel=3,
                )
        return self.results[slot]


_DESCRIPTOR_DEFAULTS = {
    f.name: f.default for f in fields(TensorDescriptor) if f.default is not MISSING
}


def tma_descriptor(tensor: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """The TMA descriptor of ``tensor`` read in boxes of ``block``: the fields Triton's
    constructor sets (its defaults for the optional ones), set directly. Its checks (16-byte
    aligned base and strides, a contiguous last dim, positive sizes, a valid block) cost
    1.1-1.7 us a descriptor on the host (a linear builds three); every caller has already
    made them true (its layout check, :func:`aligned`, the op layer's return on empty
    inputs, constant blocks), so they are not run again on every call."""
    descriptor = object.__new__(TensorDescriptor)
    descriptor.__dict__ = {
        **_DESCRIPTOR_DEFAULTS,
        "base": tensor,
        "shape": [*tensor.shape],
        "strides": [*tensor.stride()],
        "block_shape": block,
    }
    return descriptor


@dataclass
class Launch:
    """One kernel launch described before it runs: ``kernel[grid](**args)`` with pinned options.

    ``args`` names every kernel parameter (tensors, integers, floats and constexprs).
    """

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    extra_options: dict[str, Any] = field(default_factory=dict)
    plan_key: tuple | None = None
    """What decides the binary, said by the launcher more cheaply than :meth:`LaunchPlans.key`
    walks every argument (the hot decode launches): two launches of one kernel with equal
    ``plan_key`` and options must have equal argument keys (tests/backends/
    test_launch_plans.py checks it over random shapes). None: the arguments' key."""

    def options(self) -> dict[str, Any]:
        """The compile options this launch pins."""
        return dict(
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            enable_fp_fusion=FP_FUSION,
            **self.extra_options,
        )

    def __call__(self) -> None:
        if INTERPRET or not LAUNCH_PLANS:
            self.kernel[self.grid](**self.args, **self.options())
        else:
            PLANS.launch(self)


I32 = range(-(2**31), 2**31)
"""The integers Triton passes as 32-bit (wider ones get a 64-bit binary)."""


def _argument_key(value: Any, specialized: bool) -> Any:
    """What Triton's binder specialises a non-constexpr argument on, or a superset of it:
    a tensor's dtype and 16-byte alignment, a descriptor's dtype, block and alignment, an
    integer's width and (unless ``do_not_specialize``) whether it is 1 or divisible by 16.
    The exact types come first (by identity: half the cost of an isinstance chain), integers
    first of all: lengths and strides are most of a launch's arguments."""
    kind = type(value)
    if kind is int:  # _int_key, inlined: the call would cost a third of the key
        in_i32 = value in I32
        return (in_i32, value == 1, value % 16 == 0) if specialized else in_i32
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return value.dtype, value.data_ptr() % ALIGNMENT == 0
    if kind is float:
        return float
    if isinstance(value, TensorDescriptor):
        base = value.base
        return base.dtype, tuple(value.block_shape), base.data_ptr() % ALIGNMENT == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return _int_key(value, specialized)
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % ALIGNMENT == 0
    if isinstance(value, float):
        return float
    raise TypeError(f"bik launch: no plan key for an argument of type {type(value).__name__}")


def _int_key(value: int, specialized: bool) -> Any:
    if not specialized:
        return value in I32
    return value in I32, value == 1, value % 16 == 0


class LaunchPlans:
    """Compiled kernels by specialisation key: a launch whose key was seen calls the compiled
    kernel with its arguments in the kernel's parameter order (as ``kernel[grid]`` does after
    its own lookup); an unseen key launches through ``kernel[grid]`` and keeps what it
    compiled. Launch hooks (a profiler) send every launch through ``kernel[grid]``."""

    def __init__(self) -> None:
        self.compiled: dict[tuple, Any] = {}
        self._parameters: dict[Any, tuple[tuple[str, bool, bool], ...]] = {}
        self._arguments: dict[Any, Callable[[dict[str, Any]], tuple]] = {}

    def parameters(self, kernel: Any) -> tuple[tuple[str, bool, bool], ...]:
        """(name, is constexpr, specialised) for each of ``kernel``'s parameters, in order."""
        if kernel not in self._parameters:
            self._parameters[kernel] = tuple(
                (p.name, p.is_constexpr, not p.do_not_specialize) for p in kernel.params
            )
        return self._parameters[kernel]

    def arguments(self, kernel: Any) -> Callable[[dict[str, Any]], tuple]:
        """Reads ``kernel``'s arguments off a launch's ``args`` in its parameter order, in one
        C-level ``itemgetter`` (a Python loop over attention's 56 parameters took 2 us)."""
        if kernel not in self._arguments:
            names = [name for name, _, _ in self.parameters(kernel)]
            self._arguments[kernel] = (
                operator.itemgetter(*names) if len(names) > 1 else lambda args: (args[names[0]],)
            )
        return self._arguments[kernel]

    def key(self, launch: Launch, device: int) -> tuple:
        arguments = tuple(
            launch.args[name] if constexpr else _argument_key(launch.args[name], specialized)
            for name, constexpr, specialized in self.parameters(launch.kernel)
        )
        return (
            launch.kernel,
            device,
            launch.num_warps,
            launch.num_stages,
            tuple(sorted(launch.extra_options.items())),
            arguments,
        )

    @staticmethod
    def site_key(launch: Launch, device: int) -> tuple:
        """The plan of a launch whose launcher gave its ``plan_key``."""
        options = tuple(sorted(launch.extra_options.items())) if launch.extra_options else ()
        return (
            launch.kernel,
            device,
            launch.num_warps,
            launch.num_stages,
            options,
            ("site", launch.plan_key),  # never equal to an argument key
        )

    def launch(self, launch: Launch) -> None:
        hooked = knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls
        device = torch.cuda.current_device()
        key = self.key(launch, device) if launch.plan_key is None else self.site_key(launch, device)
        compiled = None if hooked else self.compiled.get(key)
        if compiled is None:
            compiled = launch.kernel[launch.grid](**launch.args, **launch.options())
            self.compiled[key] = compiled.result() if hasattr(compiled, "result") else compiled
            return
        grid = (*launch.grid, 1, 1)
        compiled.run(
            grid[0],
            grid[1],
            grid[2],
            torch._C._cuda_getCurrentRawStream(device),
            compiled.function,
            compiled.packed_metadata,
            None,  # launch metadata and hooks: only for a profiler, which takes the path above
            None,
            None,
            *self.arguments(launch.kernel)(launch.args),
        )


PLANS = LaunchPlans()


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` with an fp32 accumulator; fp32 operands use IEEE fp32, never TF32."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")
