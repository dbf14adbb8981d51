"""GPU timing beyond eager calls: a call's host cost, and calls replayed from a CUDA graph.

An eager GPU call costs the larger of its host work (argument checks, launch) and its kernels;
replayed from a CUDA graph, the same kernels run with no host work, so the graph time is the
kernels' own. Both sides of a bench row (bik and its baseline) are captured the same way.
"""

import statistics
import time
from collections.abc import Callable

import torch

GRAPH_CALLS = 16
"""Calls captured in one graph: a replay times that many calls back to back."""
HOST_CALLS = 100  # calls issued per host-cost sample


def graphed(fn: Callable[[], object], calls: int = GRAPH_CALLS) -> Callable[[], None]:
    """The replay of ``calls`` calls of ``fn`` captured in one CUDA graph, after two warm-up
    calls on a side stream (torch's documented recipe: lazy initialisation, compilation and
    bik's bucket self-checks happen there, never inside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def host_us(fn: Callable[[], object], device: torch.device, calls: int = HOST_CALLS) -> float:
    """Microseconds of host time to issue one call: ``calls`` calls issued with no wait, per
    call, median of 5 (at decode shapes the GPU's queue takes them without blocking, so this
    is the host's cost, whatever the kernels take; on a CPU, simply the call's time)."""
    return per_call_us(fn, device, calls, wait=False)


def per_call_us(fn: Callable[[], object], device: torch.device, calls: int, *, wait: bool) -> float:
    """Microseconds per call of ``calls`` calls back to back, median of 5; ``wait``: the clock
    stops once the GPU is done (the eager time), else when the last call is issued."""
    fn()
    samples = []
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if wait:
            _sync(device)
        samples.append((time.perf_counter() - start) / calls)
        _sync(device)
    return statistics.median(samples) * 1e6


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sdpa_backend(dtype: torch.dtype) -> "torch.nn.attention.SDPBackend":
    """The SDPA backend a GPU attention baseline is pinned to: FlashAttention for 16-bit
    inputs, the memory-efficient kernel for fp32 (flash takes no fp32)."""
    from torch.nn.attention import SDPBackend

    return SDPBackend.FLASH_ATTENTION if dtype.itemsize == 2 else SDPBackend.EFFICIENT_ATTENTION
