"""verl's CPU platform: every rank a process on this machine's cores, collectives on gloo.

verl asks its platform for the device, the collective backend and the Ray resource a worker
takes. Here the device is ``cpu`` and the collectives ``gloo``; a worker still asks Ray for a
"GPU", which ``ray_init.num_gpus`` makes logical (one per worker, no hardware behind it), so
verl's placement code runs unchanged. Selected with ``VERL_PLATFORM=cpu``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _no_memory(*args: Any, **kwargs: Any) -> int:
    return 0


# What verl calls on ``get_torch_device()``: ``torch.cpu``'s own functions where it has them;
# the allocator's caches and statistics, which a CPU process does not keep, as no-ops and 0;
# the RNG, which is torch's; and the name its FLOPs table looks up ("CPU": no peak known).
_DEVICE = SimpleNamespace(
    **{
        name: getattr(torch.cpu, name)
        for name in ("device_count", "synchronize", "is_available", "current_stream", "stream")
    },
    current_device=lambda: "cpu",
    set_device=_nothing,
    get_device_name=lambda *a: "CPU",
    empty_cache=_nothing,
    ipc_collect=_nothing,
    reset_peak_memory_stats=_nothing,
    set_per_process_memory_fraction=_nothing,
    memory_allocated=_no_memory,
    memory_reserved=_no_memory,
    max_memory_allocated=_no_memory,
    max_memory_reserved=_no_memory,
    mem_get_info=lambda *a: (0, 0),
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
)


class CpuPlatform(PlatformBase):
    """verl on CPU cores: gloo collectives and logical Ray "GPU"s, one a worker."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE  # type: ignore[return-value]

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        # verl moves tensors with ``.to(get_device_id())``: the CPU's device, not an index.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def use_gloo_process_groups() -> None:
    """verl's workers join their process group as ``cpu:gloo,<device>:<backend>``, which on
    this platform names ``cpu`` twice (torch refuses it): they join as ``cpu:gloo`` here."""
    from verl.utils import distributed
    from verl.workers import engine_workers

    join = distributed.initialize_global_process_group_ray

    def join_on_gloo(timeout_second: int | None = None, backend: str | None = None) -> Any:
        return join(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    engine_workers.initialize_global_process_group_ray = join_on_gloo
