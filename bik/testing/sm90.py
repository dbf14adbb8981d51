"""Compile bik's Triton launches for Hopper (sm_90a) with no GPU or driver, and read the SASS.

The Triton wheel ships ptxas and cuobjdump, and ``triton.compile`` takes an explicit target,
so what a kernel becomes on an H100 (tensor-core instruction, TMA, registers, spills, shared
memory) can be checked on any machine. A launch is described by the backend itself
(:class:`bik.backends.triton._common.Launch`, built from meta tensors), so the binary checked
here is the one a real launch of that shape would get, with the same specialisation.
"""

import dataclasses
import importlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.runtime.jit import KernelInterface

HOPPER = GPUTarget("cuda", 90, 32)  # (backend, compute capability, warp size)
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

_MMA = re.compile(r"\b((?:HGMMA|HMMA|QGMMA|IMMA)(?:\.\w+)+)")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+([^;]*;)")
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


@dataclass(frozen=True)
class Binary:
    """What one compiled kernel is made of."""

    name: str
    num_warps: int
    num_stages: int
    registers: int
    shared_bytes: int
    local_bytes: int  # per-thread stack: > 0 means registers spilled to local memory
    specialization: str  # what the binary was specialised on: the compile-cache key's part
    sass: str

    @property
    def mma(self) -> frozenset[str]:
        """Tensor-core instructions used, e.g. ``HGMMA.64x64x16.F32.BF16``."""
        return mma_instructions(self.sass)

    @property
    def opcodes(self) -> Counter:
        """How often each SASS opcode (with its modifiers) occurs."""
        return Counter(_OPCODE.findall(self.sass))

    def count(self, prefix: str) -> int:
        """Instructions whose opcode starts with ``prefix`` (``"UTMALDG"``, ``"LDL"``, ...)."""
        return sum(n for op, n in self.opcodes.items() if op.split(".")[0] == prefix)

    def code(self) -> str:
        """The instructions with their operands, addresses and encodings dropped: equal for
        binaries that compute the same way."""
        return "\n".join(" ".join(i.split()) for i in _INSTRUCTION.findall(self.sass))


def _specialize(kernel, args: dict) -> tuple[dict, dict, dict]:
    """Signature, constexprs and attributes as ``JITFunction`` builds them at a launch."""
    from triton._C.libtriton import native_specialize_impl

    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = args[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[(index,)] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(
            BaseBackend,
            value,
            param.is_const,
            not param.do_not_specialize,
            not param.do_not_specialize_on_alignment,
        )
        signature[param.name] = kind
        if kind == "constexpr":  # an integer equal to 1
            constexprs[(index,)] = spec
        elif isinstance(spec, str):  # divisible by 16 / aligned to 16 bytes
            attrs[(index,)] = BaseBackend.parse_attr(spec)
    return signature, constexprs, attrs


def mma_instructions(sass: str) -> frozenset[str]:
    """The tensor-core instructions in ``sass``, e.g. ``HGMMA.64x64x16.F32.BF16``."""
    return frozenset(_MMA.findall(sass))


def _run_tool(tool: str, *args: str) -> str:
    return subprocess.run(
        [str(TOOLS / tool), *args], capture_output=True, text=True, check=True
    ).stdout


def dump(path: str | Path) -> tuple[str, str]:
    """(the SASS, the resource usage: ``REG:n STACK:n SHARED:n LOCAL:n`` per kernel) of a cubin
    or of a shared library's embedded sm_90a code, read with the Triton wheel's cuobjdump."""
    return _run_tool("cuobjdump", "-sass", str(path)), _run_tool(
        "cuobjdump", "-res-usage", str(path)
    )


def _compile_here(launch) -> Binary:
    signature, constexprs, attrs = _specialize(launch.kernel, launch.args)
    source = triton.compiler.ASTSource(
        fn=launch.kernel, signature=signature, constexprs=constexprs, attrs=attrs
    )
    compiled = triton.compile(source, target=HOPPER, options=launch.options())
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass, usage = dump(cubin.name)

    def field(name):
        found = re.search(rf"\b{name}:(\d+)", usage)
        return int(found.group(1)) if found else 0

    return Binary(
        name=launch.kernel.__name__,
        num_warps=compiled.metadata.num_warps,
        num_stages=compiled.metadata.num_stages,
        registers=field("REG"),
        shared_bytes=compiled.metadata.shared,
        local_bytes=field("STACK") + field("LOCAL"),
        specialization=repr((signature, constexprs, attrs)),
        sass=sass,
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class _FunctionName:
    """A Triton function by module and name: how a launch's kernel and function arguments
    reach the child process (an interpreter function does not pickle)."""

    module: str
    name: str

    @classmethod
    def of(cls, value: Any) -> Any:
        """``value``'s name if it is a Triton function, else ``value``."""
        if isinstance(value, KernelInterface):
            return cls(value.fn.__module__, value.fn.__name__)
        return value

    def function(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)


def compile_launches(launches: list) -> list[Binary]:
    """The sm_90a binaries of ``launches`` (:class:`~bik.backends.triton._common.Launch` es).

    Under ``TRITON_INTERPRET=1`` (the CPU test suite) every ``triton.jit`` function, Triton's
    own library included, is an interpreter function that cannot be compiled; the launches
    are then compiled in one child process without the interpreter, each kernel (and each
    Triton function passed as an argument) found again by its module and name.
    """
    if not _interpreting():
        return [_compile_here(launch) for launch in launches]
    described = [
        dataclasses.replace(
            launch,
            kernel=_FunctionName.of(launch.kernel),
            args={name: _FunctionName.of(value) for name, value in launch.args.items()},
            plan_key=None,  # (read by launches on a GPU only)
        )
        for launch in launches
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "bik.testing.sm90"],
        input=pickle.dumps(described),
        env=env,
        capture_output=True,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"sm_90a compile failed:\n{done.stderr.decode()[-4000:]}")
    return [Binary(**fields) for fields in pickle.loads(done.stdout)]


def compile_launch(launch) -> Binary:
    """The sm_90a binary of one launch (see :func:`compile_launches`)."""
    return compile_launches([launch])[0]


def _child() -> None:
    """Compile the pickled launches from stdin, pickle the results."""
    # (this module runs as __main__: the launches hold bik.testing.sm90's _FunctionName)
    named = importlib.import_module("bik.testing.sm90")._FunctionName
    results = []
    for launch in pickle.load(sys.stdin.buffer):
        launch.kernel = launch.kernel.function()
        launch.args = {
            name: value.function() if isinstance(value, named) else value
            for name, value in launch.args.items()
        }
        if "UPCAST" in launch.args:  # the interpreter's bf16 work-around; never on a GPU
            launch.args["UPCAST"] = False
        results.append(dataclasses.asdict(_compile_here(launch)))
    sys.stdout.buffer.write(pickle.dumps(results))


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A tensor with a shape, strides and dtype but no storage, to describe a launch."""
    return torch.empty(*shape, dtype=dtype, device="meta")


if __name__ == "__main__":
    _child()
