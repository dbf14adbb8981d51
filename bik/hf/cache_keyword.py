"""The KV cache's keyword, across transformers 5.x: 5.24 renamed ``past_key_values`` (and the
recurrent layers' ``cache_params``) to ``cache``. bik's forwards accept every name, and bik
calls a model with the one its forward declares (an old name warns, then goes away)."""

import inspect
from typing import Any

_NAMES = ("cache", "past_key_values", "cache_params")


def pop_cache(kwargs: dict[str, Any], given: Any = None) -> Any:
    """The cache a layer was called with (``given``: the one a named parameter took), every
    name of it removed from ``kwargs`` so none reaches the attention function."""
    for name in _NAMES:
        value = kwargs.pop(name, None)
        if given is None:
            given = value
    return given


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for a call of ``model`` (its forward's name for the cache). Read
    once per model class: decode loops call a model once a token, and reading a decorated
    forward's signature costs tens of microseconds."""
    model_class = type(model)
    if model_class not in _KEYWORDS:
        parameters = inspect.signature(model_class.forward).parameters
        _KEYWORDS[model_class] = "cache" if "cache" in parameters else "past_key_values"
    return {_KEYWORDS[model_class]: cache}


_KEYWORDS: dict[type, str] = {}  # model class -> its forward's name for the cache
