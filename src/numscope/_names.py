"""Small facts about site names that several modules need: exact-match patterns, natural order, layer
indices."""

from __future__ import annotations

import re

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|block|blocks)\.(\d+)(?:\.|$)")


def exact_pattern(site: str) -> str:
    """An fnmatch pattern that matches exactly ``site`` (glob characters escaped)."""
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in site)


def natural_key(name: str) -> list:
    """Sort key that orders ``layer.2`` before ``layer.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def layer_index(site: str) -> int | None:
    """The transformer-layer index in a site name (``…layer.3.…``, ``…layers.3.…``, ``…h.3.…``,
    ``…blocks.3.…``), or None outside the layers."""
    match = _LAYER.search(site)
    return int(match.group(1)) if match else None
