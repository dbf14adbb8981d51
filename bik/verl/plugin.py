"""The plug-ins, registered in every verl process that imports this module.

``VERL_USE_EXTERNAL_MODULES=bik.verl.plugin`` makes verl import it at ``import verl``, in
the driver and in every Ray worker (see :mod:`bik.verl` for what each plug-in does).
"""

from verl.plugin.platform.platform_manager import PlatformRegistry

from .platform import CpuPlatform, use_gloo_process_groups

# First: verl's engine modules read the platform when they are imported.
PlatformRegistry.register(platform="cpu")(CpuPlatform)

from . import audit, checks, engine, rollout  # noqa: E402

engine.install()
rollout.register()
audit.install()
checks.install()
use_gloo_process_groups()
