"""The name of the machine a figure was measured on (the GPU, or the CPU model and the torch
threads): the bench, the demo and the benchmarks print it beside their numbers."""

import platform

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            model = next(
                line.split(":", 1)[1].strip() for line in info if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    return f"{model} ({torch.get_num_threads()} threads)"
