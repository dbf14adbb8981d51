"""The config sections' machinery: a frozen dataclass whose fields are coerced from Python
values or ``--set`` strings and checked against their constraints (rl_harness.config)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import field
from typing import Any, ClassVar

from .errors import ConfigError


def spec(default: Any, **check: Any) -> Any:
    """A field with constraints (``ge``, ``gt``, ``le``, ``lt``, ``choices``, ``multiple_of``)
    that ``Section`` checks; a float must also be finite."""
    return field(default=default, metadata={"check": check})


def _expected(kind: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a finite number"}.get(
        kind, "a string"
    )


def _coerce(key: str, kind: type, optional: bool, value: Any) -> Any:
    """``value`` (a Python value, or a ``--set`` string) as ``kind``, or ConfigError."""
    if optional and (
        value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
    ):
        return None
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        try:
            if kind is bool:
                if text not in ("true", "false", "1", "0"):
                    raise ValueError
                return text in ("true", "1")
            return kind(text)
        except ValueError:
            raise ConfigError(f"{key}: expected {_expected(kind)}, got {value!r}") from None
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


_KINDS = {
    "int": (int, False),
    "float": (float, False),
    "bool": (bool, False),
    "str": (str, False),
    "str | None": (str, True),
    "int | None": (int, True),
}


def _bounds(check: Mapping[str, Any]) -> str:
    parts = []
    for op, text in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if op in check:
            parts.append(f"{text} {check[op]:g}")
    return " and ".join(parts)


class Section:
    """Coerces and checks every field of a frozen dataclass against its metadata, then runs
    the section's own cross-field checks (``_validate``)."""

    SECTION: ClassVar[str] = ""
    # every section is a dataclass: this declares it to the type checker (no runtime effect)
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def _key(self, name: str) -> str:
        return f"{self.SECTION}.{name}" if self.SECTION else name

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.type not in _KINDS:
                continue  # a nested section: already constructed and checked
            kind, optional = _KINDS[f.type]
            key = self._key(f.name)
            value = _coerce(key, kind, optional, getattr(self, f.name))
            object.__setattr__(self, f.name, value)
            check = f.metadata.get("check")
            if check is None or value is None:
                continue
            if "choices" in check and value not in check["choices"]:
                raise ConfigError(f"{key}: expected one of {check['choices']}, got {value!r}")
            if kind is float and not math.isfinite(value):
                raise ConfigError(f"{key}: expected a finite number, got {value!r}")
            if kind in (int, float):
                ok = (
                    value >= check.get("ge", -math.inf)
                    and value > check.get("gt", -math.inf)
                    and value <= check.get("le", math.inf)
                    and value < check.get("lt", math.inf)
                )
                if not ok:
                    noun = "an integer" if kind is int else "a number"
                    raise ConfigError(f"{key}: expected {noun} {_bounds(check)}, got {value!r}")
                if kind is int and value % check.get("multiple_of", 1):
                    raise ConfigError(
                        f"{key}: expected a multiple of {check['multiple_of']}, got {value!r}"
                    )
        self._validate()

    def _validate(self) -> None:
        """Checks that involve several fields of the section."""
