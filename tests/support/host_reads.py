"""A detector of host reads: what a CUDA graph cannot capture, found on the CPU."""

import contextlib

import torch

# Operators whose result the host must read (a device sync, impossible under graph capture).
HOST_READS = {
    "aten::item",
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::equal",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
}


@contextlib.contextmanager
def host_reads():
    """Collects the host reads made inside: dispatched operators that return a value to the
    host (the profiler sees them without changing how bik dispatches) and ``tolist``, which
    reads a CPU tensor without dispatching."""
    found: list[str] = []
    tolist = torch.Tensor.tolist

    def recorded_tolist(self, *args, **kwargs):
        found.append("Tensor.tolist")
        return tolist(self, *args, **kwargs)

    torch.Tensor.tolist = recorded_tolist  # type: ignore[method-assign]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            yield found
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    found += sorted({event.name for event in prof.events() if event.name in HOST_READS})
