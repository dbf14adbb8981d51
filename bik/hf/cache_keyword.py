"""The KV cache's keyword, across transformers 5.x: 5.24 renamed ``past_key_values`` (and the
recurrent layers' ``cache_params``) to ``cache``. bik's forwards accept every name, and bik
calls a model with the one its forward declares (an old name warns, then goes away)."""

import inspect
from typing import Any

import torch

_NAMES = ("cache", "past_key_values", "cache_params")


def pop_cache(kwargs: dict[str, Any], given: Any = None) -> Any:
    """The cache a layer was called with (``given``: the one a named parameter took), every
    name of it removed from ``kwargs`` so none reaches the attention function."""
    for name in _NAMES:
        value = kwargs.pop(name, None)
        if given is None:
            given = value
    return given


def cache_argument(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for a call of ``model`` (its forward's name for the cache)."""
    parameters = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in parameters else "past_key_values": cache}
