"""Only the demos: the BERT masked-LM demo (``main``: its configuration, runs, claims and report) and the
CNN demo (``cnn``). The training runs they are made of live in :mod:`numscope.run`. Names are resolved lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "DemoConfig": "numscope.demo.main",
    "DemoError": "numscope.demo.main",
    "quick_config": "numscope.demo.main",
    "run_demo": "numscope.demo.main",
    "CNNConfig": "numscope.demo.cnn",
    "run_cnn_demo": "numscope.demo.cnn",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'numscope.demo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
