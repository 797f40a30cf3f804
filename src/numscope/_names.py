"""Small facts about names that several modules need: site names (exact-match patterns, natural order,
layer indices) and the names of runs trained again from another seed."""

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


def layer_role(site: str) -> str:
    """A site's name with its layer index replaced by ``*`` (``model.layers.*.mlp.down_proj``): the role the
    site plays in every layer; a site outside the layers keeps its name."""
    match = _LAYER.search(site)
    if match is None:
        return site
    return site[: match.start(1)] + "*" + site[match.end(1) :]


def seed_run_name(name: str, seed: int) -> str:
    """The name of run ``name`` trained again from another seed: ``fp32-seed1``."""
    return f"{name}-seed{seed}"


def parse_seed_run(name: str) -> tuple[str, int] | None:
    """``("recommended", 1)`` for ``recommended-seed1`` (see :func:`seed_run_name`); None for other names."""
    base, _, seed = name.rpartition("-seed")
    return (base, int(seed)) if base and seed.isdigit() else None
