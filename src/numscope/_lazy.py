"""Package names resolved on first use, so that importing a package stays cheap and pulls in no layer it
does not need (reading the corpus does not import torch)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

from numscope.errors import NumscopeError


def lazy_exports(
    package: str, names: Mapping[str, str], modules: Mapping[str, str] | None = None
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__``: ``names`` maps a public name to the module that defines
    it (fetched on first use and kept in the package), ``modules`` a name to a module returned itself."""
    modules = dict(modules or {})

    def __getattr__(name: str) -> Any:
        if name in modules:
            return importlib.import_module(modules[name])
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names) | set(modules))

    return __getattr__, __dir__


class MissingDependency(NumscopeError, ImportError):
    """A feature's optional dependency is not installed: the message names the package and the extra."""


#: optional dependency -> the numscope extra that installs it (pyproject.toml)
EXTRAS = {"tokenizers": "demo", "transformers": "demo", "sklearn": "demo", "matplotlib": "report"}


def missing_hint(module: str) -> str | None:
    """``needs P, which is not installed: pip install 'numscope[E]' ...`` for an optional dependency
    (``module``, dotted or not); None for any other module."""
    root = module.split(".")[0]
    if root not in EXTRAS:
        return None
    package = {"sklearn": "scikit-learn"}.get(root, root)
    return (
        f"needs {package}, which is not installed: pip install 'numscope[{EXTRAS[root]}]' "
        f"(or pip install {package})"
    )


def require(module: str, feature: str) -> Any:
    """``import module`` for ``feature``, or a :class:`MissingDependency` saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingDependency(f"{feature} {missing_hint(module)}") from error
