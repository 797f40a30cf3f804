"""Only the demos: the BERT masked-LM demo (``main``: its configuration, runs, claims and report) and the
CNN demo (``cnn``). The training runs they are made of live in :mod:`numscope.run`. Names are resolved lazily.
"""

from __future__ import annotations

from numscope._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "DemoConfig": "numscope.demo.main",
    "DemoError": "numscope.demo.main",
    "quick_config": "numscope.demo.main",
    "run_demo": "numscope.demo.main",
    "CNNConfig": "numscope.demo.cnn",
    "run_cnn_demo": "numscope.demo.cnn",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
