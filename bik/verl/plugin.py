"""The plug-ins, registered in every verl process that imports this module.

``VERL_USE_EXTERNAL_MODULES=bik.verl.plugin`` makes verl import it at ``import verl``, in
the driver and in every Ray worker (see :mod:`bik.verl` for what each plug-in does).
"""

import verl
from verl.plugin.platform.platform_manager import PlatformRegistry

from . import TESTED_VERL
from .checks import check_version
from .platform import CpuPlatform, use_gloo_process_groups

check_version(verl.__version__, TESTED_VERL)

# First: verl's engine modules read the platform when they are imported.
PlatformRegistry.register(platform="cpu")(CpuPlatform)

from . import audit, checks, engine, rollout  # noqa: E402

engine.install()
rollout.register()
audit.install()
checks.install()
use_gloo_process_groups()
