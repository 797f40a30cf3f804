"""Modules that are also the function they are named after.

``numscope.sites``, ``numscope.convert``, ``numscope.observe`` and ``numscope.formats`` are public functions
*and* modules of the same name. Importing a submodule binds the package attribute to the module, which
would shadow the function; making the module callable keeps ``numscope.convert(model, plan)`` and
``numscope.sites.attach(...)`` both working, whatever was imported first.
"""

from __future__ import annotations

import sys
import types
from typing import Any


def make_callable(module_name: str, function_name: str) -> None:
    """Let the module ``module_name`` be called as its own function ``function_name``."""
    module = sys.modules[module_name]

    class _CallableModule(types.ModuleType):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(self, function_name)(*args, **kwargs)

    _CallableModule.__name__ = f"CallableModule[{module_name}]"
    module.__class__ = _CallableModule
