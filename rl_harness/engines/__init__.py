"""The rollout engines, chosen by ``rollout.engine`` through :data:`ENGINES`.

An engine samples each step's responses from the policy and keeps its own copy of the
policy's weights; what the runner asks of one (``check``, the constructor, ``sample``,
``update``, ``close``) is :class:`~rl_harness.engines.base.Engine`. ``hf``
(:class:`~rl_harness.engines.hf.HfRollout`) samples with transformers on the rollout working
copy; ``vllm`` (:class:`~rl_harness.engines.vllm.VllmRollout`) with an in-process vLLM
engine. A new engine is a module here, a name in :data:`ENGINES` and one in config.ENGINES
(``rollout.engine``'s choices).
"""

from .base import Engine
from .hf import HfRollout
from .vllm import VllmRollout

ENGINES: dict[str, type[Engine]] = {"hf": HfRollout, "vllm": VllmRollout}

__all__ = ["ENGINES", "Engine", "HfRollout", "VllmRollout"]
