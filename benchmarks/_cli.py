"""Argument types shared by the benchmarks: a bad value is one argparse error line, not a crash later."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(least: int, most: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` for a whole number in ``least..most`` (``most`` None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least or (most is not None and value > most):
            bounds = f"at least {least}" if most is None else f"from {least} to {most}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its own messages
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_float(text: str) -> float:
    """An argparse ``type`` for a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def probability(text: str) -> float:
    """An argparse ``type`` for a share in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def shape_2d(text: str) -> tuple[int, int]:
    """An argparse ``type`` for ``ROWSxCOLS`` with both sizes at least 1, e.g. ``64x128``."""
    parts = text.lower().split("x")
    try:
        rows, cols = (int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS, e.g. 64x128, got {text!r}") from None
    if rows < 1 or cols < 1:
        raise argparse.ArgumentTypeError(f"both sizes must be at least 1, got {text!r}")
    return rows, cols
