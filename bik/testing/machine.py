"""The machine a figure was measured on (the GPU, or the CPU model and the torch threads): the
bench, the demo and the benchmarks print it beside their numbers; and what plain torch's CPU
bits depend on (:func:`cpu_numerics`), which rl_harness records with each run."""

import functools
import os
import platform

import torch

LOADED = 0.5  # a 1-minute load average above this share of the CPUs: a loaded machine


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():
                    break
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's model name (``platform.processor()`` where /proc/cpuinfo has none)."""
    return _cpuinfo().get("model name") or platform.processor() or "unknown CPU"


def cpu_numerics() -> str:
    """The CPU as plain torch's bits see it: its model, the vector capability torch's kernels
    dispatch to (AVX2, AVX512) and whether it has AMX, which oneDNN's bf16 matmuls use: an
    Intel Xeon and an AMD EPYC both report AVX512, yet round bf16 products differently."""
    amx = ", AMX" if "amx_bf16" in _cpuinfo().get("flags", "").split() else ""
    return f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()}{amx})"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({torch.get_num_threads()} threads)"


def cpu_capability() -> str:
    """The CPU's vector capability as bik's and torch's kernels use it: torch's dispatch level
    (AVX2, AVX512), then AVX512-BF16 (bik's bf16 matmul pairs) and AMX (oneDNN's bf16
    matmuls) where the CPU has them."""
    flags = _cpuinfo().get("flags", "").split()
    extras = [
        name
        for flag, name in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX"))
        if flag in flags
    ]
    return ", ".join([torch.backends.cpu.get_cpu_capability(), *extras])


def machine_load() -> dict[str, float]:
    """The 1-minute load average and the CPU count (what else runs on the machine)."""
    return {"load_1min": os.getloadavg()[0], "cpus": os.cpu_count() or 1}


def loaded(load: dict[str, float]) -> bool:
    """Whether a :func:`machine_load` says the machine was busy with other work."""
    return load["load_1min"] > LOADED * load["cpus"]


def machine_line() -> str:
    """The CPU the figures below come from (its vector capability decides which kernels run,
    and so the times), the threads, and the load average, with a warning on a busy machine."""
    load = machine_load()
    line = (
        f"machine: {cpu_model()} ({cpu_capability()}), {torch.get_num_threads()} torch threads; "
        f"load average {load['load_1min']:.2f} on {load['cpus']} CPUs"
    )
    if loaded(load):
        line += "\n  warning: other work is running here; the times below are not this CPU's"
    return line
