"""The package layout's one rule (docs/architecture.md): a lower layer never imports a higher one, at the
top of a module or inside a function; there is no exception."""

from __future__ import annotations

import re
from pathlib import Path

import numscope

#: the layers, lowest first (docs/architecture.md)
ORDER = (
    "errors", "_compat", "_device", "_progress", "_names", "_atomic", "_rng", "_sums", "_callable", "_lazy",
    "_settings", "vocab", "formats",
    "metrics", "_root_call", "sites", "plan", "convert", "analysis", "distributed", "observe", "sensitivity",
    "advisor", "train", "run", "report", "study", "forecast", "diagnose", "integrations", "demo", "workflow",
    "cli",
)  # fmt: skip
#: none: the plan study and the demo share their experiment through numscope.run.experiment
EXCEPTIONS: set[tuple[str, str]] = set()
IMPORT = re.compile(r"^\s*(?:from (numscope[\w.]*) import|import (numscope[\w.]*))", re.M)
#: the names of ``from numscope import a, b`` or ``from numscope import (a, b)``: each may be a layer
FROM_ROOT = re.compile(r"^\s*from numscope import (?:\(([^)]*)\)|([^\n(]+))", re.M)


def _layer(module: str) -> str:
    return module.split(".")[1]


def test_no_module_imports_a_higher_layer() -> None:
    root = Path(numscope.__file__).parent
    modules = sorted(root.rglob("*.py"))
    layers = {_layer("numscope." + ".".join(p.relative_to(root).with_suffix("").parts)) for p in modules}
    assert layers - {"__init__"} <= set(ORDER), f"modules of no layer: {sorted(layers - set(ORDER))}"
    upward = set()
    for path in modules:
        me = ".".join(("numscope", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        if me == "numscope":
            continue
        source = path.read_text(encoding="utf-8")
        targets = [match.group(1) or match.group(2) for match in IMPORT.finditer(source)]
        for match in FROM_ROOT.finditer(source):
            names = (match.group(1) or match.group(2)).split("#")[0]
            targets += [f"numscope.{name.split(' as ')[0].strip()}" for name in names.split(",")]
        for target in targets:
            if target == "numscope" or _layer(target) not in ORDER:  # the package itself, or a name in it
                continue
            if ORDER.index(_layer(target)) > ORDER.index(_layer(me)):
                upward.add((me, target))
    assert upward == EXCEPTIONS


def test_gemm_names_are_written_through_the_vocabulary() -> None:
    """The code names the three GEMMs by :class:`numscope.vocab.Gemm`, never by a string literal (docstrings,
    comments and messages may spell them): a misspelt literal would match nothing without an error."""
    import io
    import tokenize

    root = Path(numscope.__file__).parent
    literals = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "vocab.py":
            continue
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
        for token in tokens:
            if token.type == tokenize.STRING and token.string.strip("\"'") in ("fprop", "dgrad", "wgrad"):
                literals.append(f"{path.relative_to(root)}:{token.start[0]}: {token.string}")
    assert literals == []


#: the plan package's modules, lowest first: each imports only those before it (the named recipes register
#: themselves with plan.py: Plan.recipe looks them up without importing recipes.py)
PLAN_ORDER = ("spec", "presets", "files", "plan", "recipes", "targets", "export")
PLAN_EXCEPTIONS: set[tuple[str, str]] = set()


def test_the_plan_package_has_no_import_circle() -> None:
    root = Path(numscope.__file__).parent / "plan"
    upward = set()
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts == ("__init__",):
            continue
        me = parts[0]
        for match in IMPORT.finditer(path.read_text(encoding="utf-8")):
            target = (match.group(1) or match.group(2)).split(".")
            if target[:2] != ["numscope", "plan"] or len(target) < 3:
                continue
            if PLAN_ORDER.index(target[2]) > PLAN_ORDER.index(me):
                upward.add((me, target[2]))
    assert upward == PLAN_EXCEPTIONS


#: the questions that decide which quantizer computes a cast (native C, torch dtype, compiled, eager)
PATH_QUESTIONS = re.compile(
    r"\b(?:native\.covers|covers_block|native_enabled|native\.available|fast_enabled|fast\.supports"
    r"|packs_columns)\("
)


def test_only_the_path_module_chooses_the_quantizer() -> None:
    """:func:`numscope.formats.path.quantizer_paths` is the one place that asks which quantizer path
    covers a cast; quantize, convert and the metrics call it (native.py and fast.py answer the questions
    and check their own inputs; the public switches live in formats/__init__.py)."""
    root = Path(numscope.__file__).parent
    answering = {"formats/path.py", "formats/native.py", "formats/fast.py", "formats/__init__.py"}
    askers = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name in answering:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#")[0]
            if PATH_QUESTIONS.search(code) and not code.lstrip().startswith("def "):
                askers.append(f"{name}:{number}: {line.strip()}")
    assert askers == []


#: what a study's result looks like in prose: a loss in nats, a rank correlation, a standard deviation, a
#: measured ratio (a figure such as "0.59 nats", "Spearman 0.94", "sd 0.027", "1.16×")
STUDY_FIGURE = re.compile(
    r"\d(?:\.\d+)? ?nats|Spearman[^.\n]{0,25}?\d\.\d|\bsd \(?[-+]?\d|[-+]?\d\.\d+ ?×"
    r"|\d(?:\.\d+)?[-–]\d(?:\.\d+)?x\b|\b\d+ s (?:after|per|for|against)\b"
)


def test_no_study_figure_in_a_docstring_or_a_help_text() -> None:
    """Results live on the documentation pages that hold their studies (docs/), never in docstrings or
    ``--help`` texts, where they go stale: those link to the page instead."""
    import io
    import tokenize

    root = Path(numscope.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
        for token in tokens:
            if token.type == tokenize.STRING and (match := STUDY_FIGURE.search(token.string)):
                found.append(f"{path.relative_to(root)}:{token.start[0]}: {match.group(0)!r}")
    assert found == []


def _package_edges(folder: Path, package: str) -> dict[str, set[str]]:
    """Within one folder of the package, which of its modules each module imports (at the top, in a function
    or under TYPE_CHECKING alike), by module name."""
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    edges: dict[str, set[str]] = {name: set() for name in names}
    for name in names:
        source = (folder / f"{name}.py").read_text(encoding="utf-8")
        for match in IMPORT.finditer(source):
            parts = (match.group(1) or match.group(2)).split(".")
            if ".".join(parts[:-1]) == package and parts[-1] in names and parts[-1] != name:
                edges[name].add(parts[-1])
        for match in re.finditer(rf"^\s*from {re.escape(package)} import ([\w, ]+)", source, re.M):
            edges[name] |= {n.strip() for n in match.group(1).split(",")} & (names - {name})
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_inside_any_folder() -> None:
    """Inside every folder of the package the modules import one another in one direction: no circle, not
    even one through a function-level or TYPE_CHECKING import (the runtime and the interception mode meet
    through a protocol, the named recipes register themselves with Plan)."""
    root = Path(numscope.__file__).parent
    circles = {}
    for folder in [root, *sorted(p for p in root.iterdir() if (p / "__init__.py").is_file())]:
        package = ".".join(("numscope", *folder.relative_to(root).parts))
        if (found := _cycle(_package_edges(folder, package))) is not None:
            circles[package] = " -> ".join(found)
    assert circles == {}


def test_the_tests_are_laid_out_like_the_packages() -> None:
    """Every package of ``src/numscope`` has a folder of its name under ``tests/`` holding its tests, so that
    a newcomer finds a module's tests where the module is."""
    root = Path(numscope.__file__).parent
    tests = Path(__file__).parent
    packages = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    missing = [name for name in packages if not any((tests / name).glob("test_*.py"))]
    assert packages and missing == [], f"packages without a tests/<package>/ folder of tests: {missing}"
