"""Public names: ``numscope.__all__`` is the curated list a training script needs, every other name numscope
offers lives in its subpackage's ``__all__``, and each public name is defined once in the package."""

from __future__ import annotations

import ast
import importlib
from collections import defaultdict
from pathlib import Path

import numscope

SRC = Path(numscope.__file__).resolve().parent

CURATED = [
    "LossScaler",
    "NumscopeError",
    "Plan",
    "Recipe",
    "Scaling",
    "band",
    "convert",
    "encode",
    "export",
    "forecast",
    "formats",
    "get_format",
    "load_checkpoint",
    "localize",
    "observe",
    "quantize",
    "recommend",
    "save_checkpoint",
    "sensitivity",
    "unconvert",
]

#: two implementations of one interface, chosen by ``numscope.formats.path`` (the compiled and the native
#: kernels): the same names on purpose
BACKENDS = {"formats/fast.py", "formats/native.py"}


def test_the_package_exports_the_curated_names_and_each_resolves() -> None:
    assert numscope.__all__ == CURATED
    for name in CURATED:
        assert getattr(numscope, name) is not None, name
    assert all(callable(getattr(numscope, name)) for name in CURATED)  # classes, functions, callable modules


def test_every_other_name_is_in_its_subpackages_all() -> None:
    """The names the package reaches lazily but does not list are each in a subpackage's ``__all__``."""
    others = set(numscope._EXPORTS) - set(CURATED) - {"format"}
    assert others  # Format, Site, Analysis, ... are not gone: they moved out of the top-level list
    homes = {}
    for name in others:
        module = importlib.import_module(numscope._EXPORTS[name])
        package = (
            importlib.import_module(module.__name__.rsplit(".", 1)[0]) if "." in module.__name__ else module
        )
        listed = (*getattr(module, "__all__", ()), *getattr(package, "__all__", ()))
        homes[name] = name in listed
    assert all(homes.values()), sorted(n for n, ok in homes.items() if not ok)


def test_each_public_name_is_defined_once() -> None:
    defined: dict[str, list[str]] = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        relative = path.relative_to(SRC)
        if relative.parts[0] == "cli" or any(
            p.startswith("_") and p != "__init__.py" for p in relative.parts
        ):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                defined[node.name].append(relative.as_posix())
    assert len(defined) > 300
    twice = {name: where for name, where in defined.items() if len(where) > 1 and set(where) != BACKENDS}
    assert not twice, twice
