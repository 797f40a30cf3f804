"""Settings dataclasses that describe their own command-line flags.

A field made with :func:`setting` carries its help text and what a flag needs to parse and check it (its
name, bounds, choices, whether ``none`` switches it off); ``numscope.cli`` generates each verb's flags from
the dataclass and reads them back into it, so the Python API and the command line share one set of
defaults. The module sits in the lowest layer: any package's settings may use it."""

from __future__ import annotations

from dataclasses import Field, field
from typing import Any

OFF = "none"
"""What a flag of a field that may be switched off (``off=True``) holds when given as ``none`` or ``off``
(the field then gets None; an absent flag keeps the field's default)."""


def setting(
    default: Any,
    help: str,
    minimum: float | None = None,
    positive: bool = False,
    choices: tuple[str, ...] | None = None,
    *,
    flag: str | None = None,
    kind: type | None = None,
    metavar: str | None = None,
    off: bool = False,
    shown: str | None = None,
) -> Any:
    """A dataclass field that also describes its command-line flag: the help text; for numbers the smallest
    allowed value (``minimum``) or that it must be > 0 (``positive``); for names the allowed ones
    (``choices``); the flag's name (``flag``, default ``--field-name``); the value's type (``kind``: int,
    float or str; default the default's type, needed where the default is None); ``metavar``; ``off``:
    ``none`` or ``off`` on the command line gives None; ``shown``: how the help states the default (default:
    the value itself)."""
    metadata = {
        "help": help,
        "minimum": minimum,
        "positive": positive,
        "choices": choices,
        "flag": flag,
        "kind": kind,
        "metavar": metavar,
        "off": off,
        "shown": shown,
    }
    return field(default=default, metadata=metadata)


def flag_of(item: Field[Any]) -> str:
    """The command-line flag of a :func:`setting` field."""
    return item.metadata.get("flag") or "--" + item.name.replace("_", "-")


def kind_of(item: Field[Any]) -> type:
    """The type a :func:`setting` field's flag parses to (int, float or str)."""
    if item.metadata.get("kind") is not None:
        return item.metadata["kind"]
    default = item.default
    if isinstance(default, bool) or default is None:
        raise TypeError(f"setting {item.name}: give kind= where the default is {default!r}")
    return int if isinstance(default, int) else float if isinstance(default, float) else str


def shown_default(item: Field[Any]) -> str:
    """The default of a :func:`setting` field as its flag's help states it."""
    if item.metadata.get("shown") is not None:
        return str(item.metadata["shown"])
    if item.default is None:
        return "off" if item.metadata.get("off") else "none"
    return f"{item.default:g}" if isinstance(item.default, float) else str(item.default)


def check_settings(settings: Any) -> None:
    """Check the :func:`setting` fields of a settings dataclass against what their flags allow (the type;
    ``minimum``; ``positive``; ``choices``; None only where ``off`` or the default). Raises
    :class:`numscope.errors.SettingsError` naming the first wrong one as the Python API does
    (``TrainConfig.steps``); the command line prints it under its flag."""
    import math
    from dataclasses import fields

    from numscope.errors import SettingsError

    for item in fields(settings):
        if "help" not in item.metadata:
            continue
        value = getattr(settings, item.name)
        where = f"{type(settings).__name__}.{item.name}"
        if value is None:
            if item.metadata.get("off") or item.default is None:
                continue
            raise SettingsError(where, "a value is required; got None")
        kind = kind_of(item)
        minimum, positive, choices = (item.metadata.get(k) for k in ("minimum", "positive", "choices"))
        if kind is str:
            if not isinstance(value, str) or (choices and value not in choices):
                allowed = ", ".join(choices) if choices else "a name"
                raise SettingsError(where, f"one of {allowed}; got {value!r}")
            continue
        number = kind is float and isinstance(value, int | float) and not isinstance(value, bool)
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            at_least = "" if minimum is None else f" ≥ {minimum:g}"
            raise SettingsError(where, f"must be an integer{at_least}; got {value!r}")
        if kind is float and not (number and math.isfinite(value)):
            raise SettingsError(where, f"must be a finite number; got {value!r}")
        if positive and not value > 0:
            raise SettingsError(where, f"must be > 0; got {value!r}")
        if minimum is not None and value < minimum:
            raise SettingsError(where, f"must be ≥ {minimum:g}; got {value!r}")
